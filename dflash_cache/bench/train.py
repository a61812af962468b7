"""`dflash bench train`: drafter steps with the real loader against the same steps on batches
already on the device, with the useful TFLOP/s and MFU of the step."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from dflash_cache.bench.config import TrainBenchConfig
from dflash_cache.bench.io import drop_page_cache
from dflash_cache.bench.kernels import kernel_breakdown
from dflash_cache.bench.measure import PeakRSS, timer
from dflash_cache.bench.shapes import QWEN3_8B, BenchError
from dflash_cache.train.config import TrainConfig, drafter_config
from dflash_cache.train.cost import run_token_budget

if TYPE_CHECKING:
    from dflash_cache.train.loader import CacheLoader
    from dflash_cache.train.stream import PackedBatch


def _in_stage_threads(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Run `fn` on its device (default: the GPU where there is one) with the train stage's CPU
    threads: with torch's one a core, a rank's OpenMP teams fight the loader's decoders."""

    @functools.wraps(fn)
    def run(*args: Any, device: torch.device | None = None, **kwargs: Any) -> dict[str, Any]:
        from dflash_cache.core.devices import Worker
        from dflash_cache.core.threads import worker_threads
        from dflash_cache.train.stage import THREADS_PER_GPU

        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with worker_threads(Worker(0, 1, device), per_gpu=THREADS_PER_GPU):
            return fn(*args, device=device, **kwargs)

    return run


@_in_stage_threads
def train(cache: Path, *, steps: int = TrainBenchConfig.steps, warmup: int = 3, token_budget: int | None = None,
          max_anchors: int = TrainConfig.max_anchors, block_size: int | None = TrainConfig.block_size,
          draft_layers: int = TrainConfig.draft_layers, readers: int | None = None, cold: bool = False,
          device: torch.device | None = None, drafter: str = TrainConfig.drafter, length: int | None = None,
          config: dict = QWEN3_8B, storage: str = "auto", project: int | str = "auto",
          sliding_window: int | Literal["full"] | None = TrainConfig.sliding_window,
          full_attention_layers: list[int] | None = TrainConfig.full_attention_layers,
          profile: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Drafter steps with the real loader reading `cache` vs the same steps on batches already on
    the device. Both phases run the same batches (the first `steps` of epoch 0 after `warmup`),
    after every one of them has run once untimed, so neither phase pays for compiling.
    Also the useful TFLOP/s and MFU of the in-memory steps (the drafter family's count,
    `Family.flops`). The drafter, its optimizer and the loader are the train stage's own
    (`stage.setup`), on one rank; `drafter` names the family (dspark needs a `final_hidden` cache).

    `cold` evicts the cache's files from the page cache first, so the loader reads the disk.
    `loader_GBps` (bytes on disk read per second by the loader) and `step_GBps` (what the
    in-memory step would consume) set the loader against `bench disk`'s bandwidth.

    `length`: `cache` is written first (it must not exist or be empty), holding samples of that
    many tokens at `config`'s shape (`extract.random_cache`, in `storage`, projected as `project`
    says: by default as `dflash extract` projects, H values a token in fp8), as many as the
    warm-up and measured steps take at `token_budget` (one a step without it). `project` and
    `storage` in the result are the cache's, written or given.

    `sliding_window` and `full_attention_layers` are `dflash train`'s (refused by `TrainConfig`,
    before a cache is written); the useful FLOPs (`useful_tflop_per_step`, an in-memory
    step's, and MFU) count only the context keys a window lets a block attend (`context_keys`).
    `profile`: where the step's time goes, after the timed phases (`_profile`)."""
    from dflash_cache.train.metrics import peak_flops

    cfg = TrainConfig(cache=cache, out=cache, token_budget=token_budget, max_anchors=max_anchors,
                      block_size=block_size, draft_layers=draft_layers, drafter=drafter,
                      sliding_window=sliding_window, full_attention_layers=full_attention_layers,
                      **({"readers": readers} if readers else {}))  # fmt: skip
    written = {}
    if length is not None:
        written = {"length": length, "samples": (steps + warmup) * max(1, (token_budget or 0) // length)}
        _write_cache(cache, length, written["samples"], config, storage, project, drafter, device)
    steps_of = _BenchSteps(cfg, device)
    s, loader = steps_of.setup, steps_of.setup.loader
    n = min(steps + warmup, loader.num_batches(0))
    files = [p for p in cache.glob("units/**/*") if p.is_file()]
    disk_bytes_per_token = sum(p.stat().st_size for p in files) / max(1, loader.epoch_tokens)
    # Every batch's shapes are compiled before either phase is timed: the compiled stages meet
    # a new shape now and then in the first tens of steps of a run, and a warm-up of a few steps
    # left those compiles inside the loader phase, which then looked slow where the run showed no
    # loader wait (BENCHMARKS.md, "Loader against in-memory batches").
    for batch in itertools.islice(loader.epoch(0), n):
        steps_of.step(batch)
    if cold:
        drop_page_cache(files)
    times: dict[str, float] = {}
    wait, peak_gpu, peak_rss = _loader_phase(steps_of, warmup, n, times)
    measured = n - warmup
    context_tokens = sum(u[1] for u in steps_of.useful)
    kept = _memory_phase(steps_of, warmup, n, times)
    memory_tokens = sum(u[1] for u in steps_of.useful)
    useful = steps_of.useful_flops()
    tflops = useful / times["memory"] / 1e12
    peak = peak_flops(device)
    shares = None if profile is None else _profile(steps_of, kept, profile)
    loader.close()
    proj = loader.spec.projection
    return {
        **written, "project": proj.rank if proj else "none", "storage": loader.spec.storage.dtype,
        "drafter": s.family.name, "block_size": s.dcfg.block_size, **_window(s.dcfg),
        "steps": measured, "token_budget": cfg.token_budget, "max_anchors": max_anchors,
        "drafter_hidden": s.dcfg.hidden_size, "drafter_layers": s.dcfg.num_hidden_layers,
        "loader_steps_s": measured / times["loader"], "memory_steps_s": measured / times["memory"],
        "ratio": times["memory"] / times["loader"], "loader_wait_per_step_s": wait / max(1, measured),
        "context_tok_s": context_tokens / times["loader"], "peak_gpu_GB": peak_gpu / 1e9, "peak_rss_GB": peak_rss / 1e9,
        "readers": cfg.readers, "useful_tflop_per_step": useful / max(1, measured) / 1e12,
        "memory_tflops": tflops, "memory_mfu": tflops * 1e12 / peak if peak else None,
        "cold": cold, "loader_GBps": context_tokens * disk_bytes_per_token / times["loader"] / 1e9,
        "step_GBps": memory_tokens * disk_bytes_per_token / times["memory"] / 1e9, "resident_batches": len(kept),
        "profile": None if profile is None else str(profile), "profile_shares": shares,
    }  # fmt: skip


def _window(dcfg: Any) -> dict[str, Any]:
    """The drafter's window as it was built, and the layers that keep full attention beside it
    (None where none does, as the setting says it)."""
    full = [i for i, w in enumerate(dcfg.windows) if w is None] if dcfg.sliding_window else []
    return {"sliding_window": dcfg.sliding_window, "full_attention_layers": full or None}


class _BenchSteps:
    """The train stage's own drafter, optimizer and loader on one rank (`stage.setup`, writing nothing
    to `cfg.out`), and its steps: each one a forward, backward and the stage's optimizer step
    (`stage.optimizer_step`, clipping included), whose useful-FLOPs terms (`Family.flops`) are kept
    in `useful`. Without a token budget, the stage's default for this drafter on a cache too large
    to cap it."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        from dflash_cache.cache.spec import read_spec
        from dflash_cache.core.devices import Worker
        from dflash_cache.train.stage import setup

        if cfg.token_budget is None:
            spec = read_spec(cfg.cache)
            cfg.token_budget = run_token_budget(cfg, drafter_config(cfg, spec), spec, device, few_steps_cap=False)
        self.setup = setup(Worker(0, 1, device), cfg)
        self.flops = self.setup.family.flops(self.setup.model)
        self.useful: list[tuple] = []  # (blocks, context tokens, context keys attended, scored slots) a step

    def step(self, batch: PackedBatch) -> None:
        from dflash_cache.train.stage import optimizer_step, train_step

        s = self.setup
        out = train_step(s.objective, s.model, s.embed, s.head, batch, s.anchors(batch), s.cfg.grad_accum)
        optimizer_step(s)
        blocks = out.blocks
        self.useful.append((blocks.layout.num_blocks, batch.num_tokens, self.flops.context_keys(blocks.layout),
                            0 if out.scored is None else out.scored))  # fmt: skip

    def useful_flops(self) -> float:
        """The useful FLOPs of the steps in `useful`."""
        return sum(self.flops(nb, ctx, int(anchors), int(scored)) for nb, ctx, anchors, scored in self.useful)


def _profile(steps_of: _BenchSteps, kept: list[PackedBatch], path: Path) -> dict[str, float] | None:
    """Two in-memory steps under `torch.profiler`; their operators by self device time (self CPU
    time on a CPU), the 40 costliest, as a table at `path`, under a line that sets the device's
    busy time beside the wall time and, on a GPU, the kernel classes' shares (`kernels.py`): where
    a step that falls short of the MFU it should reach spends its time, and whether the device
    waits on the host. Returns the shares (None on a CPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from dflash_cache.core.atomic import write_atomic

    device = steps_of.setup.worker.device
    cuda = device.type == "cuda"
    wall: dict[str, float] = {}
    with profiler(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        with timer(device, wall, "steps"):
            for i in range(2):
                steps_of.step(kept[i % len(kept)])
    steps_of.useful.clear()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = prof.key_averages()
    kernels = kernel_breakdown(ops, 2)  # the kernels alone: an op's self device time is theirs again
    busy = 2 * kernels["kernel_ms_per_step"] / 1e3 if kernels else sum(op.self_cpu_time_total for op in ops) / 1e6
    where = "on the device" if cuda else "on the CPU"
    head = f"2 steps: {wall['steps'] * 1e3:.1f} ms wall, {busy * 1e3:.1f} ms {where} ({busy / wall['steps']:.0%})"
    shares = kernels.get("profile")
    if shares:
        head += "\nkernel time: " + ", ".join(f"{name} {share:.1%}" for name, share in shares.items())
    write_atomic(path, f"{head}\n{ops.table(sort_by=sort, row_limit=40)}\n")
    return shares


def _memory_phase(steps_of: _BenchSteps, warmup: int, n: int, times: dict[str, float]) -> list[PackedBatch]:
    """The same batches as the loader phase's, already on the device (`resident`), stepped in turn
    (times["memory"]); returns them."""
    loader, device = steps_of.setup.loader, steps_of.setup.worker.device
    room = torch.cuda.get_device_properties(device).total_memory // 5 if device.type == "cuda" else None
    kept = resident(loader, warmup, n, room)
    steps_of.useful.clear()
    with timer(device, times, "memory"):
        for i in range(n - warmup):
            steps_of.step(kept[i % len(kept)])
    return kept


def _loader_phase(steps_of: _BenchSteps, warmup: int, n: int, times: dict[str, float]) -> tuple[float, int, int]:
    """Batches `warmup` to `n` of epoch 0 stepped as the real loader streams them (times["loader"]);
    returns the loader's wait over them, the peak GPU memory (bytes, 0 on a CPU) and the peak RSS."""
    loader, device = steps_of.setup.loader, steps_of.setup.worker.device
    it = loader.epoch(0)
    for _ in range(warmup):
        next(it)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wait0 = loader.wait_seconds
    steps_of.useful.clear()
    with PeakRSS() as rss, timer(device, times, "loader"):
        for _ in range(warmup, n):
            steps_of.step(next(it))
    wait = loader.wait_seconds - wait0
    peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return wait, peak_gpu, rss.peak


def resident(loader: CacheLoader, start: int, stop: int, room: int | None) -> list[PackedBatch]:
    """Batches `start` to `stop` of epoch 0 held on the device for the in-memory phase, as many as
    fit in `room` bytes (at least one; None: all). `train` gives them a fifth of the GPU: at 64K
    tokens a sample, twenty batches of a five-layer cache's context would fill an 80 GB GPU."""
    kept: list[PackedBatch] = []
    held = 0
    for batch in itertools.islice(loader.epoch(0), start, stop):
        size = sum(t.numel() * t.element_size() for t in (batch.context, batch.final) if t is not None)
        if kept and room is not None and held + size > room:
            break
        kept.append(batch)
        held += size
    return kept


def _write_cache(cache: Path, length: int, samples: int, config: dict, storage: str, project: int | str,
                 drafter: str, device: torch.device) -> None:  # fmt: skip
    """`bench train --length`'s cache: `samples` samples of `length` tokens, random values of what
    `dflash extract --project` stores (and the final hidden state for a family that trains on it)."""
    from dflash_cache.bench.extract import random_cache
    from dflash_cache.drafters import family

    if cache.exists() and (not cache.is_dir() or any(cache.iterdir())):
        raise BenchError(f"--cache {cache}: with --length the benchmark writes a new cache there; give a path that "
                         "does not exist yet")  # fmt: skip
    random_cache(cache, config, np.full(samples, length), storage=storage, project=project,
                 final_hidden=family(drafter).needs_final_hidden, device=device)  # fmt: skip
