"""The chunked losses alone, forward and backward, on a GPU: the Triton kernel against the compiled
PyTorch expression, and the products alone (the floor), at a drafter's head shape.

Random bf16 rows at SmolLM2's head (hidden 576, vocabulary 49,152) by default: DSpark's loss (CE +
L1 to the target's softmax, a Markov bias of rank 256) and DFlash's cross-entropy. MFU counts the
useful FLOPs (`DSparkFlops`' per-slot terms; 4 V H a row for cross-entropy) over the H200's peak.

    python benchmarks/bench_loss.py --rows 32768
    python benchmarks/bench_loss.py --tiles 2048x8,4096x8,1024x4,2048x16     # the kernel's LossTiles, block x warps
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache.drafters import losses  # noqa: E402
from dflash_cache.kernels.tiles import (
    DEFAULT_LOSS_TILES,  # noqa: E402
    LossTiles,  # noqa: E402
)
from dflash_cache.train.metrics import peak_flops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--chunks", default="4096,8192")
    ap.add_argument("--tiles", default="", help="the kernel's LossTiles, logits a load and warps a program, "
                    "BLOCKxWARPS each (2048x8,4096x16): DSpark's loss through the kernel at each, after the other runs")
    a = ap.parse_args()
    dev = torch.device("cuda")
    n, h, v, r = a.rows, a.hidden, a.vocab, a.rank
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=g) * scale).bfloat16().requires_grad_(grad)

    hidden, bias, w2 = rand(n, h, grad=True), rand(n, r, grad=True), rand(v, r, scale=0.05, grad=True)
    head, target = rand(v, h, scale=0.05), rand(n, h)
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    a_w, b_w = torch.rand(n, device=dev, generator=g) / n, torch.rand(n, device=dev, generator=g) / n

    def products(chunk: int, tiles: LossTiles | None) -> None:
        """The PyTorch path's products alone: logits, target logits, the gradients (no loss, no tiles)."""
        for s in range(0, n, chunk):
            z = bias[s : s + chunk].detach()
            logits = torch.addmm(F.linear(hidden[s : s + chunk].detach(), head), z, w2.detach().T)
            F.linear(target[s : s + chunk], head)
            logits @ head, logits @ w2.detach(), logits.T @ z

    def tv(chunk: int, tiles: LossTiles | None) -> None:  # tiles None: the compiled expression
        total, *_ = losses.chunked_tv_loss(hidden, head, labels, a_w, b_w, bias=bias, bias_weight=w2, target=target,
                                           chunk_size=chunk, kernel_tiles=tiles)  # fmt: skip
        total.backward()

    def ce(chunk: int, tiles: LossTiles | None) -> None:
        losses.chunked_loss(hidden, head, labels, a_w, chunk, kernel_tiles=tiles)[0].backward()

    tv_flops = n * v * (6 * h + 6 * r)
    runs = [("dspark, products alone", products, tv_flops, None),
            ("dspark, compiled expression", tv, tv_flops, None), ("dspark, kernel", tv, tv_flops, DEFAULT_LOSS_TILES),
            ("dflash ce, compiled expression", ce, 4 * n * v * h, None),
            ("dflash ce, kernel", ce, 4 * n * v * h, DEFAULT_LOSS_TILES)]  # fmt: skip
    for tile in filter(None, a.tiles.split(",")):
        runs.append((f"dspark, kernel {tile}", tv, tv_flops, LossTiles(*(int(v) for v in tile.split("x")))))
    for name, fn, flops, tiles in runs:
        for chunk in (int(c) for c in a.chunks.split(",")):
            torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                fn(chunk, tiles)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                fn(chunk, tiles)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - t0) / 10
            print(json.dumps({"run": name, "chunk": chunk, "rows": n, "ms": round(seconds * 1e3, 2),
                              "tflops": round(flops / seconds / 1e12, 1),
                              "mfu": round(flops / seconds / peak_flops(dev), 3),
                              "peak_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
