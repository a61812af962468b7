"""What a new prompt costs before its first step, at batch 1 on a GPU: the prefill's attention
across prompt lengths, and `dflash eval`'s prefills against its steps on a real target.

    python benchmarks/bench_prefill.py --target MODEL_DIR --data humaneval.jsonl --limit 30 --out prefill.json

1. **Attention of a new length.** torch's SDPA, causal, bf16, at the target's head geometry, once
   a layer for as many layers as the target has, for 20 prompt lengths not seen before: the
   backend torch picks by default (cuDNN's on Hopper: it builds a plan for each new shape) and the
   flash/efficient/math backends the engine's prefill keeps to.
2. **Eval's prefills.** `evaluate` three times in one process, on the first `--limit` prompts of
   `--data`, with a random DSpark drafter of `--draft-layers` layers (its tau is about 1, so every
   step commits about one token): each run's prefill milliseconds a prompt and its step time
   without them, speculative and the target alone. The first run meets every prompt length for the
   first time; the later ones find whatever the process cached.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache import drafters  # noqa: E402
from dflash_cache.cache.spec import default_layer_ids  # noqa: E402
from dflash_cache.drafters.dflash.config import DrafterConfig  # noqa: E402
from dflash_cache.drafters.dspark.config import DSparkConfig  # noqa: E402
from dflash_cache.eval.config import EvalConfig  # noqa: E402
from dflash_cache.eval.decode import evaluate  # noqa: E402
from dflash_cache.target.config import text_config  # noqa: E402
from dflash_cache.target.taps import SDPA_BACKENDS  # noqa: E402


def attention_ms(tc: dict, lengths: range, backends: list | None) -> float:
    """Median milliseconds of one prompt's attention through every layer, for lengths not seen before."""
    heads, kv_heads = tc["num_attention_heads"], tc.get("num_key_value_heads") or tc["num_attention_heads"]
    d = tc.get("head_dim") or tc["hidden_size"] // heads
    times = []
    for n in lengths:
        q = torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, d, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            for _ in range(tc["num_hidden_layers"]):
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=heads != kv_heads)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def run_figures(r) -> dict:
    s, prompts = r.settings, len(r.samples)
    steps = sum(x["steps"] for x in r.samples)
    spec, spec_pre = s["spec_seconds"], s["spec_prefill_seconds"]
    alone, alone_pre, tokens = s["target_seconds"], s["target_prefill_seconds"], s["target_new_tokens"]
    return {"prompts": prompts, "steps": steps, "new_tokens": r.new_tokens,
            "spec_prefill_ms_per_prompt": 1e3 * spec_pre / prompts,
            "target_prefill_ms_per_prompt": 1e3 * alone_pre / prompts,
            "spec_ms_per_step_without_prefill": 1e3 * (spec - spec_pre) / steps,
            "target_ms_per_token_without_prefill": 1e3 * (alone - alone_pre) / tokens,
            "outputs_equal": sum(bool(x["same_as_target"]) for x in r.samples)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="model directory")
    ap.add_argument("--data", required=True, help="prompts, as dflash eval --data takes them")
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    config = json.loads((Path(args.target) / "config.json").read_text())
    tc = text_config(config)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    attention_ms(tc, range(4000, 4002), None)  # the kernels' first load
    result["attention_ms_new_length"] = {
        "default": attention_ms(tc, range(100, 120), None),
        "flash, efficient, math (the prefill's)": attention_ms(tc, range(200, 220), SDPA_BACKENDS),
    }
    print("attention", json.dumps(result["attention_ms_new_length"]), flush=True)

    family = drafters.family("dspark")
    dcfg = DrafterConfig.from_target(config, mask_token_id=0, num_draft_layers=args.draft_layers,
                                     target_layer_ids=default_layer_ids(tc["num_hidden_layers"]))  # fmt: skip
    cfg = DSparkConfig(**dataclasses.asdict(dcfg) | {"block_size": family.default_block_size})
    torch.manual_seed(0)
    drafter = args.out.with_suffix(".drafter")
    family.save_serving(family.model(cfg), cfg, drafter)
    ecfg = EvalConfig(target=args.target, drafter=drafter, data=args.data, limit=args.limit,
                      max_new_tokens=args.max_new_tokens, batch_size=1)  # fmt: skip
    result["eval_runs"] = []
    for _ in range(3):
        result["eval_runs"].append(run_figures(evaluate(ecfg)))
        print("eval", json.dumps(result["eval_runs"][-1]), flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
