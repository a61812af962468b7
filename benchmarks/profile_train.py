"""The train stage's own step on a cache, on a GPU: its MFU and where its GPU time goes.

The drafter, optimizer and loader are `dflash bench train`'s (the train stage's, on one rank); the
first batches of epoch 0 are loaded once, stepped once to compile every shape, then timed and
profiled already on the GPU. `--no-loss-kernel` steps with the loss's PyTorch expression instead of
its Triton kernel (`kernels/loss.py`), to set the two side by side on one machine.

    dflash bench extract --shape smollm2-135m --final-hidden --tokens 800000 --out /dev/shm/x
    python benchmarks/profile_train.py --cache /dev/shm/x --drafter dspark --draft-layers 2 --token-budget 32768
    (the same with --no-loss-kernel)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache.bench.kernels import kernel_breakdown  # noqa: E402
from dflash_cache.bench.train import _BenchSteps  # noqa: E402
from dflash_cache.train.config import TrainConfig  # noqa: E402
from dflash_cache.train.metrics import peak_flops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--drafter", default=TrainConfig.drafter)
    ap.add_argument("--draft-layers", type=int, default=TrainConfig.draft_layers)
    ap.add_argument("--token-budget", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-loss-kernel", action="store_true")
    a = ap.parse_args()

    dev = torch.device("cuda")
    cfg = TrainConfig(cache=a.cache, out=a.cache, drafter=a.drafter, draft_layers=a.draft_layers,
                      token_budget=a.token_budget)  # fmt: skip
    steps = _BenchSteps(cfg, dev)
    if a.no_loss_kernel:  # the same objective, its loss the PyTorch expression instead of the kernel
        s = steps.setup
        s.objective = s.family.bind(s.dcfg, s.settings, reduce=True, loss_tiles=None)
    batches = list(itertools.islice(steps.setup.loader.epoch(0), a.warmup + a.steps))
    if len(batches) < a.warmup + a.steps:
        raise SystemExit(f"the cache holds {len(batches)} batches at this budget: fewer than --warmup + --steps")
    for b in batches:
        steps.step(b)
    torch.cuda.synchronize()
    steps.useful.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for b in batches[a.warmup :]:
        steps.step(b)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    useful = steps.useful_flops()
    result = {"drafter": a.drafter, "draft_layers": a.draft_layers, "token_budget": cfg.token_budget,
              "loss_kernel": not a.no_loss_kernel, "steps": a.steps, "s_per_step": seconds / a.steps,
              "tflops": useful / seconds / 1e12, "mfu": useful / seconds / peak_flops(dev),
              "context_tok_s": sum(b.num_tokens for b in batches[a.warmup :]) / seconds,
              "peak_gpu_GB": torch.cuda.max_memory_allocated() / 1e9,
              "gpu": torch.cuda.get_device_name(dev)}  # fmt: skip

    from torch.profiler import ProfilerActivity, profile

    profiled = batches[a.warmup : a.warmup + 4]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in profiled:
            steps.step(b)
        torch.cuda.synchronize()
    result.update(kernel_breakdown(prof.key_averages(), len(profiled), top=15))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
