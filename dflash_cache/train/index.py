"""What a rank's loader reads: the cache's committed units, each opened and indexed once, and this
rank's share of each epoch's batches over them.

`open_units` opens and checks units (bad ones skipped when asked); `UnitIndex` keeps them open with
the `SampleTable` over their samples, growing while an extraction is followed; `RankPlan` plans
each epoch, or each follow window, with `batching.py` and keeps this rank's batches. The loader
(`loader.py`) streams what they plan.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_cache.cache.spec import CacheSpec, read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.manifest import manifest_samples
from dflash_cache.cache.unit.read import CorruptUnit, UnitReader
from dflash_cache.cache.unit.verify import check_unit
from dflash_cache.train.batching import (
    Planned,
    SampleTable,
    epoch_batches,
    followed_rest,
    rank_plan,
    rest_of_epoch,
    window_batches,
)
from dflash_cache.train.follow import Window, is_complete, saved_windows


def open_units(cache_dir: Path, *, skip_bad_units: bool = False, only: Iterable[int] | None = None,
               spec: CacheSpec | None = None) -> tuple[dict[int, UnitReader], list[str]]:  # fmt: skip
    """Open every committed unit (or the ids in `only`) once, checked against cache.json (`spec`,
    read here when not given).

    A unit that fails (manifest vs file sizes, offsets, array shapes) raises `CorruptUnit` naming
    it, unless `skip_bad_units`: then it is left out and described in the returned problems,
    with the number of samples lost when the manifest still says it, so the caller can report how
    much data a run trains without. `only` lets a follower open just the newly committed units.

    Opening reads each unit's manifest and checks its file sizes; the Zarr arrays open when a
    batch first reads from the unit, and their shapes are checked then, unless `skip_bad_units`,
    which checks them here so that a bad unit stays out of the epoch's plan.
    """
    cache_dir = Path(cache_dir)
    spec = spec or read_spec(cache_dir)
    wanted = None if only is None else set(only)
    readers: dict[int, UnitReader] = {}
    problems: list[str] = []
    with _gc_paused():
        for uid, path in committed_units(cache_dir).items():
            if wanted is not None and uid not in wanted:
                continue
            try:
                reader = UnitReader(path)
                check_unit(reader, spec, now=skip_bad_units)
            except CorruptUnit as e:
                if not skip_bad_units:
                    raise
                n = manifest_samples(path)
                lost = f"{n} samples dropped" if n is not None else "sample count unknown (manifest unreadable)"
                problems.append(f"{e.unit}: {e.problem} ({lost})")
                continue
            readers[uid] = reader
    return readers, problems


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while many long-lived readers are made: its full passes over
    them were about a sixth of opening 100,000 units, and the loop makes no cycles to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()



class UnitIndex:
    """The cache's committed units, each opened once (one `UnitReader` per unit), and the
    `SampleTable` over them; only those `keep` accepts, when given (validation holds some out).
    While an extraction is followed it grows: `window` opens the units of a follow window,
    `refresh` takes every unit committed since. Completeness is about every unit of the plan."""

    def __init__(self, cache_dir: Path, spec: CacheSpec, *, skip_bad_units: bool, follow: bool,
                 on_warning: Callable[[str], None] | None, keep: Callable[[int], bool] | None = None):  # fmt: skip
        self.cache_dir, self.spec, self.num_units = cache_dir, spec, spec.plan.num_units
        self.skip_bad_units, self.follow, self.on_warning, self.keep = skip_bad_units, follow, on_warning, keep
        self.readers: dict[int, UnitReader] = {}
        self.dropped: list[str] = []
        self.open(None)
        self.table = SampleTable.from_units(self.readers)
        self.complete = is_complete(cache_dir, self.num_units)

    def open(self, units: Iterable[int] | None) -> None:
        """Open the given units (all committed ones: None) that are not open yet and that `keep`
        accepts, bad ones as `skip_bad_units` says; new problems go to `on_warning`."""
        if self.keep is not None:
            units = [u for u in (committed_units(self.cache_dir) if units is None else units) if self.keep(u)]
        new = None if units is None else [u for u in units if u not in self.readers]
        readers, problems = open_units(self.cache_dir, skip_bad_units=self.skip_bad_units, only=new, spec=self.spec)
        self.readers.update(readers)
        self.dropped += problems
        if problems and self.on_warning is not None:
            self.on_warning(f"skipping bad units: {'; '.join(problems)}")

    def refresh(self) -> None:
        """Index units committed since the loader opened (after a followed epoch, all of them)."""
        if self.complete or not self.follow:
            return
        committed = committed_units(self.cache_dir)
        self.open(committed)
        self.table = SampleTable.from_units(self.readers)
        self.complete = len(committed) >= self.num_units

    def window(self, units: tuple[int, ...]) -> SampleTable:
        """Open a follow window's units (once) and index their samples, in unit order."""
        self.open(units)
        return SampleTable.from_units({u: self.readers[u] for u in units if u in self.readers})


class RankPlan:
    """This rank's share of each epoch's batches, planned by `batching.py` over the unit index: a pure
    function of the indexed samples, the packing (seed, token budget, bucket edges, and the batch
    cost that balances DDP steps) and the ranks. The last epoch's plan is kept."""

    def __init__(self, units: UnitIndex, packing: dict[str, Any], rank: int, world_size: int):
        self.units, self.packing, self.rank, self.world_size = units, packing, rank, world_size
        self._last: tuple[tuple, list[Planned]] | None = None  # ((epoch, parts), this rank's plan)

    def follows(self, epoch: int, state: dict | None = None) -> bool:
        """Whether `epoch` follows the extraction: epoch 0 of an incomplete cache, or of a
        checkpoint taken while following (`state`: its windows)."""
        return epoch == 0 and (state is not None or (self.units.follow and not self.units.complete))

    def epoch(self, epoch: int, parts: list[list[int]] = (), follow_state: dict | None = None) -> list[Planned]:
        """This rank's batches of `epoch`; with `parts` (the epoch began on other world sizes), those
        of the epoch's rest (`rest_of_epoch`), part 0 replayed from `follow_state` if it followed."""
        key = (epoch, tuple(tuple(p) for p in parts))
        if self._last is None or self._last[0] != key:
            self.units.refresh()
            table = self.units.table
            if not parts:
                per_rank = epoch_batches(table, epoch=epoch, world_size=self.world_size, **self.packing)
            else:
                left, begin = None, 0
                if self.follows(epoch, follow_state):  # the rows its windows left, as they ran
                    windows = ((self.units.window(w.units), w.final) for w in saved_windows(follow_state))
                    size, done = parts[0]
                    left = followed_rest(table, windows, batches=done, world_size=size, **self.packing)
                    begin = 1
                per_rank = rest_of_epoch(table, epoch=epoch, world_size=self.world_size, parts=list(parts),
                                         left=left, begin=begin, **self.packing)  # fmt: skip
            self._last = (key, rank_plan(table, per_rank, self.rank))
        return self._last[1]

    def window(self, index: int, w: Window, carry: SampleTable) -> tuple[list[Planned], SampleTable]:
        """This rank's batches of follow window number `index`, and the rows carried to the next."""
        table, per_rank, carry = window_batches(index, self.units.window(w.units), carry, final=w.final,
                                                world_size=self.world_size, **self.packing)  # fmt: skip
        return rank_plan(table, per_rank, self.rank), carry
