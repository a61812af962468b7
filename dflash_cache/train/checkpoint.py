"""Atomic training checkpoints: everything needed to continue exactly, nothing half-written.

A checkpoint is one file written under a temporary name and renamed; `LATEST` names the newest
and is itself replaced atomically, so a run killed at any instant resumes from a whole checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

LATEST = "LATEST"


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int = 2):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        pointer = self.dir / LATEST
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if path.is_file() else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:08d}.pt"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _atomic_write(self.dir / LATEST, path.name)
        for old in sorted(self.dir.glob("step_*.pt"))[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def load(self, path: Path | None = None, *, mmap: bool = False) -> dict[str, Any] | None:
        """The latest (or given) checkpoint, or None. `mmap` maps the tensors instead of reading
        them: cheap when only the position is wanted (an 8B-shaped drafter's is several GB)."""
        path = path or self.latest()
        if path is None:
            return None
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
