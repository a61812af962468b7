"""The drafter's training step alone, on a GPU: MFU by the useful-FLOPs count, and a kernel breakdown.

Batches are synthetic and already in GPU memory (random context, random ids), packed to a token
budget from a length mix, so only the step is timed: `dflash bench train` measures the loader
against this in-memory rate on a real cache. It imports whichever `dflash_cache` is first on
PYTHONPATH, so the same script times two versions of the code side by side (BENCHMARKS.md).

    python benchmarks/bench_step.py --mix default --token-budget 4096 --steps 20 [--profile]
    python benchmarks/bench_step.py --mix long --token-budget 32768
    python benchmarks/bench_step.py --mix short --token-budget 8192   # the most blocks a batch can hold
    python benchmarks/bench_step.py --like smollm2-hf --token-budget 65536   # the drafter of another target's shape
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

try:  # whichever dflash_cache is first on PYTHONPATH (two versions side by side); else this checkout's
    import dflash_cache  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache.bench.kernels import kernel_breakdown
from dflash_cache.bench.shapes import QWEN3_8B, lognormal_lengths, shape_of
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.family import FAMILY, StepFlops
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.metrics import peak_flops
from dflash_cache.train.stage import train_step


def lengths_for(mix: str, n: int, seed: int = 0) -> np.ndarray:
    if mix == "default":
        return lognormal_lengths(n, seed=seed)
    lo, hi = {"long": (16384, 32768), "mid": (12288, 24576), "short": (64, 256)}[mix]
    return np.random.default_rng(seed).integers(lo, hi, size=n)


def pack(lengths: np.ndarray, budget: int, seed: int = 0) -> list[list[int]]:
    """Token-budget batches of similar lengths (sorted, then cut), in shuffled order."""
    batches, cur, used = [], [], 0
    for n in sorted(lengths.tolist(), reverse=True):
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(n)
        used += n
    batches.append(cur)
    np.random.default_rng(seed).shuffle(batches)
    return batches


def make_batch(lens: list[int], width: int, vocab: int, g: torch.Generator) -> SimpleNamespace:
    n = sum(lens)
    offsets = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
    ids = torch.randint(0, vocab - 1, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    for s, ln in zip(offsets[:-1].tolist(), lens, strict=True):
        mask[s : s + ln // 5] = False  # the prompt: unsupervised
    context = torch.randn(n, width, device="cuda", dtype=torch.bfloat16)
    return SimpleNamespace(host=(ids, mask, offsets), context=context, num_tokens=n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mix", default="default", choices=["default", "short", "mid", "long"])
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--like", help="a target directory: its drafter's shape instead of the Qwen3-8B one")
    a = ap.parse_args()

    dev = torch.device("cuda")
    shape = shape_of(a.like) if a.like else QWEN3_8B
    dcfg = DrafterConfig.from_target(shape, target_layer_ids=None, mask_token_id=shape["vocab_size"] - 1,
                                     num_draft_layers=a.layers, block_size=16)  # fmt: skip
    cfg = TrainConfig(cache=Path("."), out=Path("."), token_budget=a.token_budget)
    torch.manual_seed(0)
    model = DFlashDrafter(dcfg).to(dev)
    flops = StepFlops(model)
    vocab, hidden = dcfg.vocab_size, dcfg.hidden_size
    embed = torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    head = torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    n_samples = {"default": 4000, "short": 4000}.get(a.mix, 64)
    batches = pack(lengths_for(a.mix, n_samples), a.token_budget)
    need = a.warmup + a.steps
    batches = (batches * (need // len(batches) + 1))[:need]
    g = torch.Generator().manual_seed(0)
    data = [make_batch(b, dcfg.num_context_layers * hidden, vocab, g) for b in batches]

    objective = FAMILY.bind(dcfg, cfg.drafter_settings(), reduce=True)

    def step(i: int) -> tuple[int, torch.Tensor, int]:
        blocks = train_step(objective, model, embed, head, data[i], torch.Generator().manual_seed(i)).blocks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return blocks.layout.num_blocks, blocks.layout.block_anchor.sum(), data[i].num_tokens

    t_compile = time.perf_counter()
    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    t_compile = time.perf_counter() - t_compile
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    counts = []
    start.record()
    for i in range(a.warmup, need):
        counts.append(step(i))
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    useful = sum(flops(nb, ctx, int(anchors)) for nb, anchors, ctx in counts)
    peak = peak_flops(dev)
    result = {
        "label": a.label, "mix": a.mix, "token_budget": a.token_budget, "steps": a.steps, "hidden": dcfg.hidden_size,
        "steps_per_s": a.steps / seconds, "context_tok_s": sum(c[2] for c in counts) / seconds,
        "blocks_per_step": sum(c[0] for c in counts) / a.steps, "ctx_per_step": sum(c[2] for c in counts) / a.steps,
        "tflops": useful / seconds / 1e12, "mfu": useful / seconds / peak if peak else None,
        "peak_gpu_GB": torch.cuda.max_memory_allocated() / 1e9, "warmup_s": t_compile,
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
    }  # fmt: skip
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(a.warmup, min(need, a.warmup + 4)):
                step(i)
            torch.cuda.synchronize()
        result.update(kernel_breakdown(prof.key_averages(), 4))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
