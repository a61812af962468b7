"""Atomic training checkpoints: everything needed to continue exactly, nothing half-written.

A checkpoint is one file written under a temporary name and renamed; `LATEST` names the newest
and is itself replaced atomically, so a run killed at any instant resumes from a whole checkpoint.

The checkpointer decides when to save (every `every` steps) and gathers the state itself from the
components that own it (anything with `state_dict()` / `load_state_dict()`): the model, the
optimizer and the RNG under their names, and the small counters of the loader's position and the
schedule at the file's top level (epoch, batch, samples, step, tokens, ...), where checkpoints
have always kept them, so older run directories still resume.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.damage import DamagedFile, torch_load

LATEST = "LATEST"
_FIX = "delete it to resume from the checkpoint before it, or train into a new --out"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CpuRng:
    """torch's default CPU generator, as a checkpoint entry."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])


class Checkpointer:
    """The checkpoints of one run directory: `keep` newest kept, one saved every `every` steps.

    `states` are saved under their names; the state dicts of `top` are merged into the file's top
    level (they must not share keys). Under DDP every rank calls `maybe_save`/`save` (rank 0 writes,
    all wait for it), since replicas are identical and a rank must not run ahead of a checkpoint.
    """

    def __init__(self, run_dir: Path, keep: int = 2, *, every: int = 0, states: Mapping[str, Stateful] | None = None,
                 top: Sequence[Stateful] = ()):  # fmt: skip
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.every = every
        self.states = dict(states or {})
        self.top = list(top)
        self.loaded: Path | None = None  # the checkpoint `load` or `restore` last loaded

    def latest(self) -> Path | None:
        """The checkpoint `LATEST` names, if it exists (whether it loads is `load`'s question)."""
        pointer = self.dir / LATEST
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if path.is_file() else None

    def candidates(self) -> list[Path]:
        """The checkpoints a resume may start from, newest first: `LATEST`'s, then the others by step."""
        latest = self.latest()
        older = sorted(self.dir.glob("step_*.pt"), reverse=True)
        return ([latest] if latest else []) + [p for p in older if p != latest]

    def load(self, path: Path | None = None, *, mmap: bool = False,
             on_damaged: Callable[[Path, DamagedFile], None] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """The given checkpoint, else the newest one that loads, or None for a fresh run. `mmap`
        maps the tensors instead of reading them: cheap when only the position is wanted (an
        8B-shaped drafter's is several GB).

        A checkpoint that does not load (cut short by a full disk, damaged by a copy) is skipped
        for the one before it, which is why a run keeps two: `on_damaged(path, error)` hears of
        each skipped once one loads. If none loads, `DamagedFile` says how to start afresh.
        Nothing is deleted either way. `self.loaded` is the path that was loaded."""
        self.loaded = None
        if path is not None:
            state = torch_load(path, _FIX, map_location="cpu", weights_only=False, mmap=mmap)
            self.loaded = path
            return state
        failed: list[tuple[Path, DamagedFile]] = []
        for candidate in self.candidates():
            try:
                state = torch_load(candidate, _FIX, map_location="cpu", weights_only=False, mmap=mmap)
            except DamagedFile as e:
                failed.append((candidate, e))
                continue
            except FileNotFoundError:  # pruned by the run writing this directory while we looked
                continue
            for bad, e in failed if on_damaged is not None else ():
                on_damaged(bad, e)
            self.loaded = candidate
            return state
        if failed:
            names = ", ".join(p.name for p, _ in failed)
            raise DamagedFile(f"no checkpoint in {self.dir} loads ({names}: truncated or corrupt; "
                              f"{failed[0][1].problem}); nothing was deleted. To start the run afresh, move "
                              f"{self.dir} aside, or train into a new --out")  # fmt: skip
        return None

    def restore(self, on_damaged: Callable[[Path, DamagedFile], None] | None = None) -> dict[str, Any] | None:
        """Load the newest checkpoint that loads into the components; returns it, or None for a
        fresh run. The counters go first: they refuse a checkpoint they cannot continue before any
        weights load. A named component the checkpoint lacks (one added since it was written)
        keeps its state."""
        state = self.load(on_damaged=on_damaged)
        if state is not None:
            for part in self.top:
                part.load_state_dict(state)
            for name, part in self.states.items():
                if name in state:
                    part.load_state_dict(state[name])
        return state

    def maybe_save(self, step: int) -> Path | None:
        """Save when `step` is a multiple of `every` (never when `every` is 0)."""
        return self.save(step) if self.every and step % self.every == 0 else None

    def save(self, step: int) -> Path | None:
        """Gather every component's state and write it as step `step`'s checkpoint (on rank 0)."""
        distributed = dist.is_available() and dist.is_initialized()
        path = None
        if not distributed or dist.get_rank() == 0:
            state: dict[str, Any] = {name: part.state_dict() for name, part in self.states.items()}
            for part in self.top:
                state |= part.state_dict()
            path = self.write(step, state)
        if distributed:
            dist.barrier()
        return path

    def write(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` atomically as step `step`'s checkpoint; drop all but the newest `keep`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:08d}.pt"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        write_atomic(self.dir / LATEST, path.name)
        # the newest `keep` up to this step stay; a later step's file (a damaged one that a resume
        # went back past) is left alone: this step's rewrite replaces it when the run gets there
        kept = sorted(p for p in self.dir.glob("step_*.pt") if p.name <= path.name)
        for old in kept[: -self.keep]:
            old.unlink(missing_ok=True)
        return path


