"""Training metrics: a batch's block metrics (per-slot accuracy and the implied acceptance length, as
sums that reduce across ranks and batches), what the steps since the last line did (`StepWindow`,
summed across DDP ranks), the records of a run (`MetricsLog`: metrics.jsonl and the progress bar),
the per-rank audit trail of `--trace`, and the hardware peak the useful FLOPs of a step (the
drafter family's count, `Family.flops`) are measured against (MFU)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dflash_cache.core.jsonl import dumps_line, iter_lines

if TYPE_CHECKING:
    from dflash_cache.drafters import Output

# Dense bf16 peak FLOP/s by GPU name (vendor datasheets; SXM parts). MFU is left out elsewhere.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device`, or None where it is not known (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def block_metrics(correct: Tensor, weights: Tensor, first: int = 1) -> dict[str, Tensor]:
    """Raw sums for per-slot accuracy and implied acceptance length, all-reducible across ranks.

    correct, weights: [nb, B]. A slot counts where its weight > 0. Per block, the implied
    acceptance length is 1 + the run of correct slots from slot `first` (the first drafted one:
    1 in DFlash's blocks), ended by the first wrong or unweighted slot. Turn the (summed) result
    into JSON-ready floats with summarize_metrics.
    """
    valid = weights > 0
    hit = correct.bool() & valid
    accept = 1 + hit[:, first:].long().cumprod(dim=1).sum(dim=1)
    return {
        "slot_correct": hit.sum(0).double(),
        "slot_count": valid.sum(0).double(),
        "accept_sum": accept.sum().double(),
        "blocks": torch.tensor(float(correct.shape[0]), dtype=torch.float64, device=correct.device),
    }


def summarize_metrics(sums: dict[str, Tensor], first: int = 1) -> dict:
    """Plain floats and lists from block_metrics sums: slot_acc[i] is the accuracy of the i-th
    drafted token, slot first + i (DFlash: slot_acc[k-1] is slot k's; 0.0 where a slot had no
    counted tokens), accept_len is the mean over blocks."""
    correct = sums["slot_correct"].tolist()[first:]
    count = sums["slot_count"].tolist()[first:]
    blocks = float(sums["blocks"])
    return {
        "slot_acc": [c / n if n > 0 else 0.0 for c, n in zip(correct, count, strict=True)],
        "slot_count": [int(n) for n in count],
        "accept_len": float(sums["accept_sum"]) / blocks if blocks > 0 else 0.0,
        "blocks": int(blocks),
    }


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum counters over ranks (a no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        for value in sums.values():
            dist.all_reduce(value)
    return sums


def sum_ranks(x: float, device: torch.device) -> float:
    """The sum of `x` over the ranks (float64: exact for counts)."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())


def clock(tokens: int) -> dict[str, float]:
    """Where the run stands in tokens (all ranks, the schedule's count) and wall time, so rates over
    any span of a run, resumed or not, follow from two lines."""
    return {"tokens": tokens, "time": time.time()}


class StepWindow:
    """What the batches since the last metrics line did. Kept on the device as they come (no host
    sync a step) and reduced over the ranks by `record`, which every rank calls at once. `flops`
    is the drafter family's useful-FLOPs count (`Family.flops(model)`)."""

    def __init__(self, flops: Callable[[int, int, int, int], float], device: torch.device, world_size: int,
                 wait: Callable[[], float]):  # fmt: skip
        self.flops, self.peak = flops, peak_flops(device)
        self.device, self.world_size = device, world_size
        self.wait = wait  # the loader's cumulative wait, in seconds
        self.first = 1  # the blocks' first drafted slot (Blocks.first_slot)
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.terms: dict[str, torch.Tensor] = {}  # name -> [numerator, denominator] sums
        self.loss, self.n, self.tokens, self.blocks, self.anchors, self.scored = 0.0, 0, 0, 0, 0, 0
        self.wait_start, self.start = self.wait(), time.perf_counter()

    def add(self, out: Output, num_tokens: int) -> None:
        """One batch's objective output (loss, named terms, which block tokens were right, the
        blocks) and its context tokens."""
        blocks = out.blocks
        self.first = blocks.first_slot
        for k, v in block_metrics(out.correct, blocks.weights, self.first).items():
            self.sums[k] = self.sums.get(k, 0) + v.detach()
        for name, (num, den) in out.terms.items():
            pair = torch.stack([num.detach().double(), den.detach().double()])
            self.terms[name] = self.terms.get(name, 0) + pair
        self.loss += out.loss.detach()  # stays on the device
        self.n += 1
        self.tokens += num_tokens
        self.blocks += blocks.layout.num_blocks
        self.anchors += self.flops.context_keys(blocks.layout)  # on the device: summed at log time
        if out.scored is not None:
            self.scored += out.scored

    def record(self, step: int, epoch: int, lr: float) -> dict[str, Any]:
        """The metrics line of the window (over all ranks); the window starts again."""
        stats = summarize_metrics(all_reduce_sums({k: v.clone() for k, v in self.sums.items()}), self.first)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        world, device = self.world_size, self.device
        loss = sum_ranks(float(self.loss) / max(1, self.n), device) / world
        useful = sum_ranks(self.flops(self.blocks, self.tokens, int(self.anchors), int(self.scored)), device)
        terms = all_reduce_sums({k: v.clone() for k, v in self.terms.items()})
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            **{name: float(num / den) if den > 0 else 0.0 for name, (num, den) in terms.items()},
            "lr": lr,
            "slot_acc": stats["slot_acc"],
            "accept_len": stats["accept_len"],
            "tokens_per_s": sum_ranks(self.tokens, device) / elapsed,  # all ranks' context tokens
            "tflops_per_gpu": useful / elapsed / world / 1e12,  # useful FLOPs only (StepFlops)
            "loader_wait_s": self.wait() - self.wait_start,
        }
        if self.peak is not None:
            record["mfu"] = useful / elapsed / world / self.peak
        self.reset()
        return record


class MetricsLog:
    """`metrics.jsonl`: one JSON object per logged step or epoch end, written by rank 0, which also
    shows each step's line on the progress bar (`on_progress`) and hands every record to `sinks`
    (experiment trackers: anything with `log(record)` and `close()`). On resume the lines past the
    checkpoint's step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: Path, resume_step: int | None, *, rank: int = 0,
                 on_progress: Callable[[dict], None] | None = None, sinks: Sequence[Any] = ()):  # fmt: skip
        self.path = Path(run_dir) / "metrics.jsonl"
        self.rank = rank
        self.on_progress = on_progress
        self.sinks = list(sinks)
        if rank != 0:
            return
        if resume_step is not None and self.path.exists():
            # a torn or damaged line (a kill mid-write, a disk error) is dropped with the lines past the checkpoint
            text = self.path.read_text(errors="replace")
            kept = [ln for _, ln in iter_lines(text) if _step(ln) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            self.path.write_text("")

    def log(self, record: dict[str, Any]) -> None:
        """Every record of the run goes through here (rank 0 keeps it; other ranks' calls do nothing)."""
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(dumps_line(record))
        for sink in self.sinks:
            sink.log(record)
        if self.on_progress is not None and "loss" in record:
            self.on_progress({"bar": {
                "completed": record["tokens"], "loss": record["loss"], "accept": record["accept_len"],
                "tok_s": record["tokens_per_s"], "wait": record["loader_wait_s"], "epoch": record["epoch"],
                "step": record["step"], "tflops": record["tflops_per_gpu"], "mfu": record.get("mfu"),
            }})  # fmt: skip

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 1 << 62


class Trace:
    """`trace/rank{r}.jsonl` (`--trace`): which samples each batch held, and a checksum of the
    weights after each step (replicas must agree). Lines past a resumed checkpoint are dropped, also
    (by rank 0) from the files of ranks a run resumed on fewer ranks no longer has. Disabled, it
    writes nothing."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "trace" / f"rank{rank}.jsonl"
        self.pending: list[str] = []
        if not enabled:
            return
        self.path.parent.mkdir(exist_ok=True)
        _trim_trace(self.path, resume_step)
        if rank == 0:
            for path in self.path.parent.glob("rank*.jsonl"):
                if path.stem[4:].isdigit() and int(path.stem[4:]) >= world_size:
                    _trim_trace(path, resume_step)

    def batch(self, epoch: int, index: int, samples: torch.Tensor) -> None:
        if self.enabled:
            self.pending.append(json.dumps({"epoch": epoch, "batch": index, "samples": samples.tolist()}))

    def step(self, step: int, model: nn.Module) -> None:
        if not self.enabled:
            return
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        self.pending.append(json.dumps({"step": step, "checksum": checksum}))
        with open(self.path, "a") as f:
            f.write("".join(x + "\n" for x in self.pending))
        self.pending = []


def _trim_trace(path: Path, resume_step: int) -> None:
    """Keep a trace's lines up to `resume_step`'s step line (none for a fresh run)."""
    lines = [ln for _, ln in iter_lines(path.read_text(errors="replace"))] if path.exists() and resume_step > 0 else []
    kept = []
    for line in lines:  # a step's batch lines are written together with its step line
        if _step(line) == 1 << 62:  # torn or damaged: what follows it is past the checkpoint too
            break
        kept.append(line)
        if _step(line) == resume_step:
            break
    path.write_text("".join(x + "\n" for x in kept))
