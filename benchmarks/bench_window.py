"""A drafter layer's block attention at long context on a GPU: full attention against sliding windows,
forward and backward, side by side in one run.

One sample of `--length` tokens with 512 anchors drawn at random, blocks of 16, the Qwen3-8B drafter's
heads (32 query heads, 8 key/value heads, head dimension 128), bf16; compiled flex attention with
each rule's BlockMask (`drafters/attention.py`). Prints the median milliseconds of each and its ratio
to full attention.

    python benchmarks/bench_window.py --length 65536 --windows 2048,8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache.drafters.attention import BlockLayout, block_attention  # noqa: E402


def layout(length: int, anchors: int, block: int, device: str) -> BlockLayout:
    g = torch.Generator().manual_seed(0)
    picked = torch.randperm(length - block, generator=g)[:anchors].sort().values
    return BlockLayout.build(torch.tensor([0, length]), torch.zeros(len(picked), dtype=torch.long), picked,
                             block).to(device)  # fmt: skip


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` runs after two warm-ups, timed with CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--windows", default="2048,8192")
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    dev, B, hq, hkv, d = "cuda", 16, 32, 8, 128
    lay = layout(args.length, args.anchors, B, dev)
    nq, nc = lay.num_blocks * B, lay.num_context
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(nq, hq, d), (nc, hkv, d), (nc, hkv, d), (nq, hkv, d), (nq, hkv, d)]
    tensors = [torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    probe = torch.randn(nq, hq, d, device=dev, generator=g, dtype=torch.bfloat16)
    rows = []
    for window in [None, *(int(w) for w in args.windows.split(","))]:
        def fwd(window=window):
            with torch.no_grad():
                block_attention(*tensors, lay, impl="flex", window=window)

        def fwd_bwd(window=window):
            out = block_attention(*tensors, lay, impl="flex", window=window)
            torch.autograd.grad((out * probe).sum(), tensors)

        rows.append({"window": window, "forward_ms": timed(fwd, args.repeats),
                     "forward_backward_ms": timed(fwd_bwd, args.repeats)})  # fmt: skip
    full = rows[0]
    for r in rows:
        r["ratio_to_full"] = round(r["forward_backward_ms"] / full["forward_backward_ms"], 3)
    print(json.dumps({"device": torch.cuda.get_device_name(), "length": args.length, "anchors": lay.num_blocks,
                      "rows": rows}, indent=1))  # fmt: skip
    print(f"{'window':>8} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x full':>7}")
    for r in rows:
        name, fwd, both = r["window"] or "full", r["forward_ms"], r["forward_backward_ms"]
        print(f"{name:>8} {fwd:9.2f} {both:11.2f} {r['ratio_to_full']:7.3f}")


if __name__ == "__main__":
    main()
