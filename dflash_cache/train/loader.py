"""The train stage's loader: committed units -> token-budget batches on the drafter's device.

The drafter GPU must never wait and host memory must not grow with the dataset, so:

- every committed unit is opened and indexed once into a `SampleTable` (one row per sample; one
  cached `UnitReader` per unit), and each epoch's batches for this rank are planned over it
  (`index.py`, with `batching.py`: seeded shuffles, token-budget batches inside length buckets, the
  same number for every DDP rank), a pure function of the table and the seed;
- `stream.BatchStream` moves them through reused host slots and a side-stream copy, so host
  memory is bounded by the slot count and the device holds at most two batches;
- the target's final hidden state (a `--final-hidden` cache) is read only by a loader asked for it
  (`final_hidden=True`: DSpark drafters), so a DFlash run on such a cache reads what it always did.

`CacheLoader` owns its position (epoch, batch, the epoch's earlier parts on other world sizes, a
followed epoch's windows): `state_dict()` / `load_state_dict()` are what a checkpoint keeps of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_cache.cache.spec import CacheSpec, SpecError, check_drafter_fits, default_bucket_edges, read_spec
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.train.batching import BatchCost, resume_parts
from dflash_cache.train.follow import FollowedEpoch, UnitFeed, saved_windows
from dflash_cache.train.index import RankPlan, UnitIndex
from dflash_cache.train.stream import BatchStream, ListSource, PackedBatch, Source

PIECE_CHUNKS = 8  # chunks per reader task: about 32 MiB of hidden states



@dataclass
class Position:
    """Where a loader stands; what a checkpoint keeps of it (see `CacheLoader.state_dict`)."""

    epoch: int = 0
    batch: int = 0  # batches per rank done in the epoch: the same on every rank
    samples: list[int] = field(default_factory=list)  # samples each rank consumed in the epoch
    parts: list[list[int]] = field(default_factory=list)  # the epoch's earlier parts on other world sizes
    follow: dict | None = None  # a checkpointed followed epoch's windows, replayed on resume


class CacheLoader:
    """Streams a cache's batches to one rank's device with bounded host and device memory.

    Iterating the loader gives this rank's batches from its `position` to the end of that epoch;
    `end_epoch()` moves on to the next. `epoch()` streams any epoch from any batch, position aside.
    Attributes the trainer reads: `wait_seconds` (cumulative time the consumer was blocked waiting
    for data: the loader wait it reports), `dropped` (problems of bad units skipped with
    `skip_bad_units`; each new one also goes to `on_warning`), `host_slots` and `peak_slots_in_use`
    (see `BatchStream`).

    Follow mode: when epoch 0 starts on a cache that is still being extracted (not every unit of
    the plan committed), it consumes units window by window as they commit (see `follow.py`),
    shuffling within each window and waiting, without spinning, when it has consumed everything
    committed so far; it ends once the extraction is complete. The windows taken are part of the
    position; later epochs shuffle over the whole cache. While it waits and no unit commits,
    `on_wait` hears every `report_every` seconds what it waits for.

    `final_hidden`: also hand over the target's final hidden state (`PackedBatch.final`); the cache must
    hold it (`dflash extract --final-hidden`). `spec`: the cache's cache.json, when the caller has
    read it already.
    """

    def __init__(self, cache_dir: Path, *, layer_ids: list[int] | None = None, token_budget: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, device: torch.device, prefetch: int = 2, readers: int = 4,
                 skip_bad_units: bool = False, follow: bool = True, control_group: dist.ProcessGroup | None = None,
                 on_status: Callable[[dict], None] | None = None, on_warning: Callable[[str], None] | None = None,
                 batch_cost: BatchCost | None = None, units: Callable[[int], bool] | None = None,
                 final_hidden: bool = False, spec: CacheSpec | None = None,
                 on_wait: Callable[[str], None] | None = None, report_every: float = 60.0):  # fmt: skip
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if prefetch < 0 or readers < 1 or token_budget < 1:
            raise ValueError("prefetch must be >= 0, readers >= 1 and token_budget >= 1")
        self.cache_dir = Path(cache_dir)
        self.spec = spec or read_spec(self.cache_dir)
        self.layer_ids = list(self.spec.layers.ids) if layer_ids is None else list(layer_ids)
        positions = self.spec.group_positions(self.layer_ids)
        check_drafter_fits(self.spec, layer_ids=self.layer_ids, final_hidden=final_hidden)
        self.final_hidden = final_hidden
        row = RowFormat.of(self.spec)
        row = row if final_hidden else dataclasses.replace(row, final=0)
        self.rank, self.world_size = rank, world_size
        self.device = _full_device(device)
        bucket_edges = list(self.spec.plan.bucket_edges) or default_bucket_edges(self.spec.data.max_length)
        self.units = UnitIndex(self.cache_dir, self.spec, skip_bad_units=skip_bad_units, follow=follow,
                               on_warning=on_warning, keep=units)  # fmt: skip
        # how batches are planned (batching.py): a batch's compute from its sample lengths balances DDP steps
        self.plan = RankPlan(self.units, {"seed": seed, "token_budget": token_budget, "bucket_edges": bucket_edges,
                                          "batch_cost": batch_cost}, rank, world_size)  # fmt: skip
        self.control_group = control_group
        self.on_status = on_status
        self.on_wait, self.report_every = on_wait, report_every  # what a followed epoch waits for, how often
        self.position = Position(samples=[0] * world_size)
        self._follow: FollowedEpoch | None = None

        # prefetch + 1 host slots, allocated (and pinned) once. The largest batch is the token
        # budget, or one sample longer than it (in units not committed yet, up to max_length).
        longest = int(self.table.length.max()) if len(self.table) else 0
        if not self.complete:
            longest = max(longest, self.spec.data.max_length)
        self.slot_rows = max(token_budget, longest)
        self.stream = BatchStream(self.units.readers, row=row, slot_rows=self.slot_rows,
                                  device=self.device, layer_index=positions, prefetch=prefetch, threads=readers,
                                  piece_rows=self.spec.storage.chunk_tokens * PIECE_CHUNKS)  # fmt: skip
        self._active: Iterator[PackedBatch] | None = None

    table = property(lambda self: self.units.table)
    complete = property(lambda self: self.units.complete)
    dropped = property(lambda self: self.units.dropped)
    token_budget = property(lambda self: self.plan.packing["token_budget"])
    wait_seconds = property(lambda self: self.stream.wait_seconds)
    host_slots = property(lambda self: self.stream.host_slots)
    peak_slots_in_use = property(lambda self: self.stream.peak_slots_in_use)

    @property
    def host_bytes(self) -> int:
        """Host memory held by the slots: fixed at construction, whatever the dataset size."""
        return sum(s.nbytes for s in self.host_slots)

    # -- position -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        """This rank's batches from the position to the end of its epoch. The position moves past
        each batch as it is handed out, so a checkpoint taken after training on it resumes after it."""
        p = self.position
        for batch in self.epoch(p.epoch, p.batch, p.follow, p.parts):
            p.batch += 1
            p.samples = [a + b for a, b in zip(p.samples, batch.step_samples, strict=True)]
            yield batch

    def end_epoch(self) -> dict[str, Any]:
        """Move to the start of the next epoch; returns what the ended one consumed: samples (all
        ranks) and, had it followed an extraction, its windows and the loader's wait so far."""
        summary: dict[str, Any] = {"samples": sum(self.position.samples)}
        if self._follow is not None:
            summary |= {"followed_windows": len(self._follow.windows), "loader_wait_s": self.wait_seconds}
        self.position = Position(epoch=self.position.epoch + 1, samples=[0] * self.world_size)
        return summary

    @property
    def epoch_tokens(self) -> int:
        """Tokens of the position's epoch: from cache.json when it follows an extraction (known
        before the cache is complete), else the table's."""
        p = self.position
        return self.spec.plan.num_tokens if self.follows(p.epoch, p.follow) else self.table.num_tokens

    def state_dict(self) -> dict[str, Any]:
        """The position, as checkpoints keep it: epoch, batches done (per rank), samples done per
        rank, a followed epoch's windows, and, to continue on another number of ranks, the world
        size and the epoch's earlier parts. The same on every rank, so no rank need send it."""
        p = self.position
        follow = None
        if p.batch:  # the windows taken so far; the loaded ones until they are replayed (or re-dealt)
            follow = self._follow.state() if self._follow is not None else p.follow
        return {"epoch": p.epoch, "batch": p.batch, "samples": list(p.samples), "follow": follow,
                "world_size": self.world_size, "parts": [list(x) for x in p.parts],
                "token_budget": self.token_budget}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's position, also one saved on another number of ranks: the
        rest of its epoch is then dealt to these (`batching.resume_parts`), and rank 0 carries the
        samples the old ranks consumed."""
        budget = state.get("token_budget", self.token_budget)  # older checkpoints: not recorded
        if budget != self.token_budget:  # the default follows the GPU's memory (cost.py)
            raise SpecError(f"token_budget: the checkpoint's batches hold {budget} tokens, this run's "
                            f"{self.token_budget} (another GPU?); resume with --token-budget {budget}")
        saved = list(state["samples"])
        samples = saved if len(saved) == self.world_size else [sum(saved)] + [0] * (self.world_size - 1)
        self.position = Position(state["epoch"], state["batch"], samples, resume_parts(state, self.world_size),
                                 state.get("follow"))  # fmt: skip

    def follows(self, epoch: int, state: dict | None = None) -> bool:
        """Whether `epoch` follows the extraction (`RankPlan.follows`)."""
        return self.plan.follows(epoch, state)

    # -- planning -----------------------------------------------------------------------------

    def num_batches(self, epoch: int) -> int:
        """Batches this rank gets in `epoch` of a complete cache: the same on every rank."""
        return len(self.plan.epoch(epoch))

    # -- streaming ----------------------------------------------------------------------------

    def epoch(self, epoch: int, start_batch: int = 0, follow_state: dict | None = None,
              parts: list[list[int]] = ()) -> Iterator[PackedBatch]:  # fmt: skip
        """This rank's batches of `epoch`, from `start_batch` on (a resumed run passes the number
        of batches it already trained, and gets exactly the rest: none repeated or skipped).
        A followed epoch resumes from the checkpoint's `follow_state` as well. `parts`: the
        epoch's earlier parts on other world sizes (see `rest_of_epoch`); `start_batch` still
        counts from the epoch's start, and the rest is planned over the complete cache.

        Starting a new epoch closes the previous iterator, as both would share the host slots.
        """
        if self._active is not None:
            self._active.close()
        if self.follows(epoch, follow_state) and not parts:
            feed = partial(UnitFeed, self.cache_dir, self.spec.plan.num_units, rank=self.rank,
                           world_size=self.world_size, group=self.control_group, on_wait=self.on_wait,
                           report_every=self.report_every)  # fmt: skip
            self._follow = FollowedEpoch(saved_windows(follow_state), start_batch, plan=self.plan.window, feed=feed,
                                         on_status=self._report if self.on_status is not None else None)  # fmt: skip
            source: Source = self._follow
        else:
            self._follow = None
            batches = self.plan.epoch(epoch, parts, follow_state)
            begin = parts[-1][1] if parts else 0
            if not begin <= start_batch <= begin + len(batches):
                raise ValueError(f"start_batch {start_batch} is outside {begin}..{begin + len(batches)} "
                                 f"for epoch {epoch}")  # fmt: skip
            source = ListSource(batches[start_batch - begin :])
        self._active = self.stream.run(source, epoch, start_batch)
        return self._active

    def _report(self, status: dict) -> None:
        """A followed epoch's status, with the loader's wait so far, to `on_status`."""
        self.on_status({**status, "wait_s": self.wait_seconds})

    def close(self) -> None:
        """Stop the current epoch's reads (and following) and the reader threads."""
        if self._active is not None:
            self._active.close()
            self._active = None
        self.stream.close()

    def __enter__(self) -> CacheLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _full_device(device: torch.device | str) -> torch.device:
    """`device` with its index: a bare "cuda" is the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
