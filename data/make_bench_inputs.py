"""Inputs for end-to-end GPU runs of the real CLI at a real model shape (BENCHMARKS.md, follow mode):

- a random-weight Qwen3-8B-shaped target directory (safetensors, bf16) that `dflash extract`
  loads like any local model, with the bundled tiny target's tokenizer and chat template (token
  ids stay far below the 151,936-entry vocabulary; throughput does not depend on the weights);
- a synthetic chat dataset whose assistant turns follow the benchmarks' log-normal length mix
  (median about 600 tokens, 64-3072), made of common English words.

The weights are initialised on the GPU when there is one (an 8B model on a CPU takes minutes).

Usage: ``python data/make_bench_inputs.py TARGET_DIR DATA.jsonl [--rows 1800]``
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_cache.bench import QWEN3_8B, lognormal_lengths

TINY = Path(__file__).resolve().parent / "tiny-target"
WORDS = ("the of and to in is was for on are with as at be this have from or had by word but what some we can out "
         "other were all there when up use your how said an each she which do their time if will way about many "
         "then them write would like so these her long make thing see him two has look more day could go come did "
         "number sound no most people my over know water than call first who may down side been now find").split()
WORDS_PER_TOKEN = 0.74  # the tiny tokenizer makes about 1.35 tokens of each of these words


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("--rows", type=int, default=1800)
    args = ap.parse_args()

    cfg = AutoConfig.for_model(**QWEN3_8B)
    tiny = json.loads((TINY / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tiny:
            setattr(cfg, key, tiny[key])
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(args.target, max_shard_size="4GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (TINY / name).exists():
            shutil.copy(TINY / name, args.target / name)

    rng = np.random.default_rng(0)
    with open(args.data, "w") as f:
        for n in lognormal_lengths(args.rows):
            reply = " ".join(rng.choice(WORDS, size=max(8, int(n * WORDS_PER_TOKEN))))
            messages = [{"role": "user", "content": " ".join(rng.choice(WORDS, size=12))},
                        {"role": "assistant", "content": reply}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"target {args.target}, {args.rows} rows in {args.data}")


if __name__ == "__main__":
    main()
