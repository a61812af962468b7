"""Training metrics: summed across DDP ranks, appended to a JSONL file in the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum counters over ranks (a no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        for value in sums.values():
            dist.all_reduce(value)
    return sums


class MetricsLog:
    """`metrics.jsonl`: one JSON object per logged step. On resume the lines past the checkpoint's
    step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and _step(ln) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 1 << 62
