"""Inputs for end-to-end GPU runs of the real CLI at a real model shape (BENCHMARKS.md, follow mode):

- a random-weight Qwen3-8B-shaped target directory (safetensors, bf16) that `dflash extract`
  loads like any local model, with the bundled tiny target's tokenizer and chat template (token
  ids stay far below the 151,936-entry vocabulary; throughput does not depend on the weights);
  or, with ``--tokenizer qwen3``, a tokenizer and template laid out like Qwen3's
  (``tests/family_targets.py``: no mask token, ``<think>`` handling of the official template,
  ``len(tokenizer)`` far below ``vocab_size``), so the run meets what a real Qwen3 target brings;
- a synthetic chat dataset whose assistant turns follow the benchmarks' log-normal length mix
  (median about 600 tokens, 64-3072), made of common English words. With ``--tokenizer qwen3``
  a third of the rows are two exchanges long and two thirds carry reasoning (``<think>`` inline,
  or a ``reasoning_content`` field), as regenerated Qwen3 answers do.

The weights are initialised on the GPU when there is one (an 8B model on a CPU takes minutes).

Usage: ``python benchmarks/make_bench_inputs.py TARGET_DIR DATA.jsonl [--rows 1800] [--tokenizer tiny|qwen3]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_cache.bench.shapes import QWEN3_8B, lognormal_lengths

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny-target"
WORDS = (
    "the of and to in is was for on are with as at be this have from or had by word but what some we can out "
    "other were all there when up use your how said an each she which do their time if will way about many "
    "then them write would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been now find"
).split()
WORDS_PER_TOKEN = 0.74  # the tiny tokenizer makes about 1.35 tokens of each of these words


def tiny_rows(rows: int) -> list[dict]:
    """Single-turn chats for the bundled tiny tokenizer, one reply per length of the mix."""
    rng = np.random.default_rng(0)
    out = []
    for n in lognormal_lengths(rows):
        reply = " ".join(rng.choice(WORDS, size=max(8, int(n * WORDS_PER_TOKEN))))
        messages = [{"role": "user", "content": " ".join(rng.choice(WORDS, size=12))},
                    {"role": "assistant", "content": reply}]  # fmt: skip
        out.append({"messages": messages})
    return out


def qwen3_rows(rows: int, tokenizer) -> list[dict]:
    """Chats as a Qwen3 user has them: by thirds, single-turn plain, single-turn with inline
    reasoning, and two exchanges whose first answer reasons inline (the template drops it) and
    whose last gives its reasoning in `reasoning_content`. The last reply follows the length mix."""
    rng = np.random.default_rng(0)
    sample = list(rng.choice(WORDS, size=2000))
    words_per_token = len(sample) / len(tokenizer(" ".join(sample), add_special_tokens=False)["input_ids"])

    def words(tokens: int) -> str:
        return " ".join(rng.choice(WORDS, size=max(8, int(tokens * words_per_token))))

    out = []
    for i, n in enumerate(lognormal_lengths(rows)):
        kind = i % 3
        reply = {"role": "assistant", "content": words(n)}
        if kind == 1:
            reply["content"] = f"<think>\n{words(n // 3)}\n</think>\n\n{words(n - n // 3)}"
        messages = [{"role": "user", "content": words(12)}]
        if kind == 2:
            messages += [{"role": "assistant", "content": f"<think>\n{words(40)}\n</think>\n\n{words(60)}"},
                         {"role": "user", "content": words(12)}]  # fmt: skip
            reply = {"role": "assistant", "content": words(n - n // 3), "reasoning_content": words(n // 3)}
        out.append({"messages": [*messages, reply]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("--rows", type=int, default=1800)
    ap.add_argument("--tokenizer", choices=("tiny", "qwen3"), default="tiny",
                    help="the bundled tiny target's, or one laid out like Qwen3's (default %(default)s)")  # fmt: skip
    args = ap.parse_args()

    cfg = AutoConfig.for_model(**QWEN3_8B)
    if args.tokenizer == "qwen3":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import family_targets

        tokenizer = family_targets.build_tokenizer("qwen3")
        generation = family_targets.generation_config("qwen3", tokenizer)
        ids = {"eos_token_id": generation.eos_token_id, "pad_token_id": generation.pad_token_id}
    else:
        tiny = json.loads((TINY / "config.json").read_text())
        ids = {key: tiny[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in tiny}
    for key, value in ids.items():
        setattr(cfg, key, value)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(args.target, max_shard_size="4GB")
    if args.tokenizer == "qwen3":
        tokenizer.save_pretrained(args.target)
        generation.save_pretrained(args.target)
        rows = qwen3_rows(args.rows, tokenizer)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            if (TINY / name).exists():
                shutil.copy(TINY / name, args.target / name)
        rows = tiny_rows(args.rows)

    with open(args.data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"target {args.target}, {args.rows} rows in {args.data}")


if __name__ == "__main__":
    main()
