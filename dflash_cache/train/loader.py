"""The train stage's loader: committed units -> token-budget batches on the drafter's device.

The drafter GPU must never wait and host memory must not grow with the dataset, so:

- every committed unit is indexed once into a `SampleTable` (one row per sample; one cached
  `UnitReader` per unit);
- each epoch, `epoch_batches` shuffles the samples with a seeded generator, packs token-budget
  batches inside length buckets and shuffles the batches, then deals them to the DDP ranks so
  every rank gets the same number;
- reader threads decode each sample of a batch (long ones in pieces) straight into one of `prefetch + 1` host buffers
  ("slots", pinned on CUDA hosts) that are allocated once and reused: a slot is only handed to the
  readers when it is free, so host memory is bounded by the slot count, not by the dataset;
- the host-to-device copy runs on a side CUDA stream behind an event; the consumer's stream waits
  on that event (the host does not), and the slot goes back to the pool once the event has
  completed. Layer selection and fp8 dequantisation run on the device after the copy. The loader
  holds at most two batches on the device: the one it last yielded and the next one.

On a CPU device the same code runs without streams or events (the "copy" is a plain copy, so a
batch never aliases a slot that readers will overwrite).
"""

from __future__ import annotations

import gc
import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflash_cache.cache.spec import CacheSpec, SpecError, check_drafter_fits, default_bucket_edges, read_spec
from dflash_cache.cache.store import CorruptUnit, UnitReader, committed_units, expected_arrays
from dflash_cache.train.follow import UnitFeed, Window, is_complete

PIECE_CHUNKS = 8  # chunks per reader task: about 32 MiB of hidden states


@dataclass
class SampleTable:
    """One row per cached sample over the committed units.

    Rows are ordered by unit id, then by the sample's place in its unit, so the table (and every
    epoch's batches) is a pure function of the set of committed units. `from_units` may be called
    again on a larger dict of readers when a cache is still growing (follow mode).
    """

    unit: np.ndarray  # int64 unit id per sample
    start: np.ndarray  # int64 first token row of the sample within its unit
    length: np.ndarray  # int64 tokens
    sample_index: np.ndarray  # int64 source row (from the unit's sample_index)

    @classmethod
    def from_units(cls, readers: dict[int, UnitReader]) -> SampleTable:
        """Index the samples of every given unit (ids sorted, whatever the dict order)."""
        ids = sorted(readers)
        if not ids:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty.copy(), empty.copy(), empty.copy())
        counts = np.array([readers[u].n_samples for u in ids], dtype=np.int64)
        unit = np.repeat(np.asarray(ids, dtype=np.int64), counts)
        start = np.concatenate([readers[u].offsets[:-1] for u in ids]).astype(np.int64)
        length = np.concatenate([readers[u].lengths for u in ids]).astype(np.int64)
        sample_index = np.concatenate([readers[u].sample_index for u in ids]).astype(np.int64)
        return cls(unit, start, length, sample_index)

    def take(self, rows: np.ndarray) -> SampleTable:
        """The given rows, in the given order."""
        return SampleTable(self.unit[rows], self.start[rows], self.length[rows], self.sample_index[rows])

    @classmethod
    def concat(cls, tables: list[SampleTable]) -> SampleTable:
        keys = ("unit", "start", "length", "sample_index")
        return cls(*(np.concatenate([np.zeros(0, np.int64)] + [getattr(t, k) for t in tables]) for k in keys))

    def __len__(self) -> int:
        return len(self.unit)

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())


def _manifest_samples(path: Path) -> int | None:
    """The unit manifest's sample count, read without zarr, or None when unreadable."""
    try:
        meta = json.loads((path / "zarr.json").read_text())
        return int(meta["attributes"]["dflash_unit"]["n_samples"])
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        return None


def _check_against_spec(reader: UnitReader, spec: CacheSpec, *, now: bool = False) -> None:
    """Refuse a unit whose arrays do not have the shapes and dtypes that cache.json promises.

    The storage dtype is checked at once, from the manifest. The arrays' shapes are checked when
    the reader first opens its arrays, before its first decode (opening them all at start-up is
    what made start-up grow by milliseconds a unit), or at once with `now`.
    """
    if reader.storage != spec.storage.dtype:
        raise CorruptUnit(reader.name, f"stored as {reader.storage}, cache.json says {spec.storage.dtype}")
    reader.require(expected_arrays(reader.n_tokens, spec.row_width, len(spec.layers.ids), spec.storage.dtype))
    if now:
        reader.arrays  # noqa: B018 - opens and checks the arrays


def open_units(
    cache_dir: Path, *, skip_bad_units: bool = False, only: Iterable[int] | None = None
) -> tuple[dict[int, UnitReader], list[str]]:
    """Open every committed unit (or the ids in `only`) once, checked against cache.json.

    A unit that fails (manifest vs file sizes, offsets, array shapes) raises `CorruptUnit` naming
    it, unless `skip_bad_units`: then it is left out and described in the returned problems,
    with the number of samples lost when the manifest still says it, so the caller can report how
    much data a run trains without. `only` lets a follower open just the newly committed units.

    Opening reads each unit's manifest and checks its file sizes; the Zarr arrays open when a
    batch first reads from the unit, and their shapes are checked then, unless `skip_bad_units`,
    which checks them here so that a bad unit stays out of the epoch's plan.
    """
    cache_dir = Path(cache_dir)
    spec = read_spec(cache_dir)
    wanted = None if only is None else set(only)
    readers: dict[int, UnitReader] = {}
    problems: list[str] = []
    with _gc_paused():
        for uid, path in committed_units(cache_dir).items():
            if wanted is not None and uid not in wanted:
                continue
            try:
                reader = UnitReader(path)
                _check_against_spec(reader, spec, now=skip_bad_units)
            except CorruptUnit as e:
                if not skip_bad_units:
                    raise
                n = _manifest_samples(path)
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


def pack_batches(
    table: SampleTable, rng: np.random.Generator, *, token_budget: int, bucket_edges: list[int]
) -> list[np.ndarray]:
    """Token-budget batches (arrays of table rows) over all of `table`, in shuffled order.

    Samples are shuffled, split into length buckets (`bucket_edges`, upper edges; longer samples
    form one more bucket) and packed, in shuffled order, into batches of at most `token_budget`
    tokens. Tokens are packed, not padded, so the budget counts real tokens; a sample longer than
    the budget gets a batch of its own. The batch list is then shuffled, so lengths mix across
    batches and not within them.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    perm = rng.permutation(len(table)).astype(np.int64)
    lengths = table.length[perm]
    bucket = np.searchsorted(np.asarray(bucket_edges, dtype=np.int64), lengths, side="left")
    batches: list[np.ndarray] = []
    for b in np.unique(bucket):
        rows = perm[bucket == b]  # still in shuffled order
        cum = np.concatenate([[0], np.cumsum(table.length[rows])])
        s = 0
        while s < len(rows):
            # Longest prefix from s whose tokens fit the budget; at least one sample.
            e = int(np.searchsorted(cum, cum[s] + token_budget, side="right")) - 1
            e = max(e, s + 1)
            batches.append(rows[s:e])
            s = e
    return [batches[i] for i in rng.permutation(len(batches))]


def deal(
    batches: list[np.ndarray], world_size: int, *, final: bool = True, cost: np.ndarray | None = None
) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """Deal batches to ranks so that every rank gets the same number (DDP would hang otherwise).

    Rank r gets batches r, r + W, r + 2W, ... The fewer than W batches left over are returned as
    rows to carry into the next window when not `final`. When `final`, the leftover batches are
    split (the one with most samples in two, again and again; parts stay within the budget) into
    exactly W batches, one more per rank; only when they hold fewer than W samples are those
    samples returned unused. So at most W - 1 samples per epoch go untrained, none with W = 1.

    With `cost` (a figure per batch, such as its compute), the W batches of each step are ones
    of similar cost; see `_balance`. With W = 1 the order is unchanged.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    keep = len(batches) // world_size * world_size
    dealt, left = list(batches[:keep]), list(batches[keep:])
    if cost is not None and world_size > 1:
        dealt = _balance(dealt, np.asarray(cost[:keep], dtype=np.float64), world_size)
    if left and final:
        while len(left) < world_size and max(len(b) for b in left) > 1:
            i = max(range(len(left)), key=lambda j: len(left[j]))
            half = len(left[i]) // 2
            left[i : i + 1] = [left[i][:half], left[i][half:]]
        if len(left) == world_size:
            dealt, left = dealt + left, []
    rest = np.concatenate(left) if left else np.zeros(0, dtype=np.int64)
    return [dealt[r::world_size] for r in range(world_size)], rest


def _balance(batches: list[np.ndarray], cost: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Reorder batches so each run of W (one step of W ranks) holds batches of similar cost.

    A DDP step waits for its slowest rank. Token-budget batches differ several-fold in drafter
    compute (a batch of short samples has many more anchors than one long sample), and dealt at
    random two ranks lose about a quarter of each step to waiting, eight almost half (BENCHMARKS.md).
    Sorting by cost and cutting into runs of W removes that; the steps then go in the order of
    their earliest batch in the shuffled input, so the order of steps stays random.
    """
    steps = np.argsort(cost, kind="stable").reshape(-1, world_size)
    steps = steps[np.argsort(steps.min(axis=1), kind="stable")]
    return [batches[i] for i in steps.ravel()]


def _pack_and_deal(table: SampleTable, rng: np.random.Generator, *, token_budget: int, bucket_edges: list[int],
                   world_size: int, final: bool = True, batch_cost: Callable[[np.ndarray], float] | None = None
                   ) -> tuple[list[list[np.ndarray]], np.ndarray]:  # fmt: skip
    """`pack_batches` then `deal`, balanced by `batch_cost` (a batch's cost from its sample lengths)."""
    batches = pack_batches(table, rng, token_budget=token_budget, bucket_edges=bucket_edges)
    cost = None if batch_cost is None else np.array([batch_cost(table.length[b]) for b in batches])
    return deal(batches, world_size, final=final, cost=cost)


def epoch_batches(
    table: SampleTable,
    *,
    epoch: int,
    seed: int,
    token_budget: int,
    bucket_edges: list[int],
    world_size: int,
    batch_cost: Callable[[np.ndarray], float] | None = None,
) -> list[list[np.ndarray]]:
    """Every rank's batches (arrays of table rows) for one epoch; a pure function of the inputs,
    shuffled by a generator seeded with (seed, epoch). See `pack_batches` and `deal`;
    `batch_cost` maps a batch's sample lengths to its cost, to balance the ranks' steps."""
    rng = np.random.default_rng([seed, epoch])
    return _pack_and_deal(table, rng, token_budget=token_budget, bucket_edges=bucket_edges, world_size=world_size,
                          batch_cost=batch_cost)[0]  # fmt: skip


RESHARD_KEY = 0x5E5  # in the seed of a re-dealt remainder's generator, apart from (seed, epoch) and follow windows


def rest_of_epoch(
    table: SampleTable,
    *,
    epoch: int,
    seed: int,
    token_budget: int,
    bucket_edges: list[int],
    world_size: int,
    parts: list[tuple[int, int]],
    batch_cost: Callable[[np.ndarray], float] | None = None,
    left: np.ndarray | None = None,
    begin: int = 0,
) -> list[list[np.ndarray]]:
    """Every rank's batches (arrays of `table` rows) for the rest of an epoch that ran its first
    batches on other world sizes (a run resumed on another number of processes).

    `parts` are the epoch's earlier parts, each (world size, batches per rank done when it ended,
    counted from the epoch's start). Part 0 ran the epoch's own plan (`epoch_batches`); each later
    part, and the rest, is a plan of the samples that no earlier part consumed, packed and dealt the
    same way with a generator seeded by (seed, epoch, RESHARD_KEY, part). So no sample of the epoch
    is trained twice, and the few a deal leaves out (fewer than W) get another chance. A followed
    first part has no such plan (its windows made it): the caller then passes the rows it `left`
    and `begin` = 1.
    """

    def plan(k: int, size: int, rows: np.ndarray) -> list[list[np.ndarray]]:
        rng = np.random.default_rng([seed, epoch] if k == 0 else [seed, epoch, RESHARD_KEY, k])
        dealt, _ = _pack_and_deal(table.take(rows), rng, token_budget=token_budget, bucket_edges=bucket_edges,
                                  world_size=size, batch_cost=batch_cost)  # fmt: skip
        return [[rows[b] for b in mine] for mine in dealt]  # back to rows of `table`

    left = np.arange(len(table), dtype=np.int64) if left is None else np.asarray(left, dtype=np.int64)
    done = parts[begin - 1][1] if begin else 0
    for k in range(begin, len(parts)):
        per_rank = plan(k, parts[k][0], left)
        n = parts[k][1] - done
        if not 0 <= n <= len(per_rank[0]):
            raise ValueError(f"part {k} of epoch {epoch} ends at batch {parts[k][1]}: outside its plan")
        used = [b for mine in per_rank for b in mine[:n]]
        left = np.setdiff1d(left, np.concatenate([np.zeros(0, np.int64), *used]))  # sorted: the table's order
        done = parts[k][1]
    return plan(len(parts), world_size, left)


def _windows(follow_state: dict | None) -> list[Window]:
    """The follow windows a checkpoint's `follow_state` records."""
    return [Window(tuple(u), bool(f)) for u, f in (follow_state or {}).get("windows", [])]


def _row_keys(table: SampleTable) -> np.ndarray:
    """One int64 per sample, (unit, first row): sorted and unique over a `SampleTable.from_units` table."""
    return table.unit * (1 << 40) + table.start


@dataclass(frozen=True)
class _Planned:
    """A batch's samples, and the context tokens of its step summed over all ranks."""

    samples: SampleTable
    step_tokens: int


def _rank_plan(table: SampleTable, per_rank: list[list[np.ndarray]], rank: int) -> list[_Planned]:
    """One rank's batches; every rank computes the same per-rank plan, so each also knows what
    every step consumes in total."""
    return [
        _Planned(table.take(rows), sum(int(table.length[other[i]].sum()) for other in per_rank))
        for i, rows in enumerate(per_rank[rank])
    ]


@dataclass
class Batch:
    """One packed batch, already on the target device (sample_index stays on the CPU)."""

    context: torch.Tensor  # [N, K'*H] bf16 (bf16 storage) or float32 dequantised (fp8 storage)
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    offsets: torch.Tensor  # [S+1] int64 packed sequence boundaries
    sample_index: torch.Tensor  # [S] int64 source rows, on the CPU
    num_tokens: int
    step_tokens: int  # context tokens of this step summed over all ranks (for a token-based schedule)
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # CPU copies of (input_ids, loss_mask, offsets)


class _Slot:
    """One reusable host buffer, big enough for the largest batch; pinned when the device is CUDA."""

    def __init__(self, index: int, rows: int, width: int, layers: int, fp8: bool, pin: bool):
        self.index = index
        # bf16 bits live in int16 (torch has no full uint16 support); numpy views them as uint16.
        self.hidden = torch.empty((rows, width), dtype=torch.uint8 if fp8 else torch.int16, pin_memory=pin)
        self.scale = torch.empty((rows, layers), dtype=torch.float32, pin_memory=pin) if fp8 else None
        self.input_ids = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        self.loss_mask = torch.empty(rows, dtype=torch.uint8, pin_memory=pin)
        self.offsets = torch.empty(rows + 1, dtype=torch.int64, pin_memory=pin)
        # numpy views over the same memory: what UnitReader.read_into decodes into.
        self.np = {
            "hidden": self.hidden.numpy() if fp8 else self.hidden.numpy().view(np.uint16),
            "input_ids": self.input_ids.numpy(),
            "loss_mask": self.loss_mask.numpy(),
        }
        if self.scale is not None:
            self.np["hidden_scale"] = self.scale.numpy()

    @property
    def nbytes(self) -> int:
        tensors = [self.hidden, self.scale, self.input_ids, self.loss_mask, self.offsets]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class _Pending:
    """A batch whose samples the readers are decoding into `slot`, one future per sample."""

    batch: SampleTable
    slot: _Slot
    futures: list[Future]
    num_tokens: int
    step_tokens: int


@dataclass
class _Staged:
    """A batch whose copy to the device has been issued; `event` marks the copy's end on CUDA."""

    batch: Batch
    slot: _Slot
    event: torch.cuda.Event | None


def _pieces(start: int, stop: int, piece: int) -> list[tuple[int, int]]:
    """[start, stop) cut at the multiples of `piece` (whole chunks when piece is a multiple of the
    chunk size, so no chunk is decoded by two readers)."""
    cuts = [start, *range((start // piece + 1) * piece, stop, piece), stop]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class CacheLoader:
    """Streams a cache's batches to one rank's device with bounded host and device memory.

    Attributes the trainer reads: `wait_seconds` (cumulative time the consumer was blocked waiting
    for data: the loader wait it reports), `dropped` (problems of bad units skipped with
    `skip_bad_units`), `host_slots` (the reused host buffers, `prefetch + 1` of them, allocated
    once) and `peak_slots_in_use` (instrumentation: never above `len(host_slots)`).

    Follow mode: when epoch 0 starts on a cache that is still being extracted (not every unit of
    the plan committed), it consumes units window by window as they commit (see `follow.py`),
    shuffling within each window and waiting, without spinning, when it has consumed everything
    committed so far; it ends once the extraction is complete. `follow_state()` is what a
    checkpoint must keep to resume such an epoch; later epochs shuffle over the whole cache.
    """

    def __init__(
        self,
        cache_dir: Path,
        *,
        layer_ids: list[int] | None = None,
        token_budget: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device,
        prefetch: int = 2,
        readers: int = 4,
        skip_bad_units: bool = False,
        follow: bool = True,
        control_group: dist.ProcessGroup | None = None,
        on_status: Callable[[dict], None] | None = None,
        batch_cost: Callable[[np.ndarray], float] | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if prefetch < 0 or readers < 1 or token_budget < 1:
            raise ValueError("prefetch must be >= 0, readers >= 1 and token_budget >= 1")
        self.cache_dir = Path(cache_dir)
        self.spec = read_spec(self.cache_dir)
        cached = list(self.spec.layers.ids)
        self.layer_ids = cached if layer_ids is None else list(layer_ids)
        check_drafter_fits(self.spec, layer_ids=self.layer_ids)
        positions = [cached.index(i) for i in self.layer_ids]
        if len(set(positions)) != len(positions) or positions != sorted(positions):
            raise SpecError(f"layers: {self.layer_ids} must be distinct and in the cache's order {cached}")
        self.token_budget = token_budget
        self.batch_cost = batch_cost  # a batch's compute from its sample lengths: balances DDP steps
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fp8 = self.spec.storage.dtype == "fp8"
        self.bucket_edges = list(self.spec.plan.bucket_edges) or default_bucket_edges(self.spec.data.max_length)

        # One reader per unit, opened once; the table indexes their samples.
        self.skip_bad_units = skip_bad_units
        self.readers, self.dropped = open_units(self.cache_dir, skip_bad_units=skip_bad_units)
        self.table = SampleTable.from_units(self.readers)
        self.complete = is_complete(self.cache_dir, self.spec.plan.num_units)
        self.follow = follow
        self.control_group = control_group
        self.on_status = on_status
        self._follow: _FollowSource | None = None

        self._cuda = self.device.type == "cuda"
        self._num_layers = len(cached)
        self._hidden_size = self.spec.target.hidden_size
        self._all_layers = positions == list(range(len(cached)))
        self._layer_index = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        if self._stream is not None:  # the side stream uses _layer_index, made on the current stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

        # prefetch + 1 host slots, allocated (and pinned) once. The largest batch is the token
        # budget, or one sample longer than it (in units not committed yet, up to max_length).
        longest = int(self.table.length.max()) if len(self.table) else 0
        if not self.complete:
            longest = max(longest, self.spec.data.max_length)
        self.slot_rows = max(token_budget, longest)
        self.host_slots = [
            _Slot(i, self.slot_rows, self.spec.row_width, self._num_layers, self.fp8, self._cuda)
            for i in range(prefetch + 1)
        ]
        self.peak_slots_in_use = 0
        self.wait_seconds = 0.0
        # a reader task decodes at most this many rows: a few of the cache's chunks (several MiB)
        self.piece_rows = self.spec.storage.chunk_tokens * PIECE_CHUNKS
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="dflash-reader")
        self._batches: tuple[tuple, list[_Planned]] | None = None  # ((epoch, parts), this rank's plan)
        self._active: Iterator[Batch] | None = None

    # -- planning -----------------------------------------------------------------------------

    def _rank_batches(self, epoch: int, parts: list[tuple[int, int]] = (), follow_state: dict | None = None
                      ) -> list[_Planned]:  # fmt: skip
        """This rank's batches of `epoch`; with `parts` (the epoch began on other world sizes), those
        of the epoch's rest (`rest_of_epoch`), part 0 replayed from `follow_state` if it followed."""
        key = (epoch, tuple(tuple(p) for p in parts))
        if self._batches is None or self._batches[0] != key:
            self._refresh()
            pack = {"token_budget": self.token_budget, "bucket_edges": self.bucket_edges,
                    "world_size": self.world_size, "batch_cost": self.batch_cost}  # fmt: skip
            if not parts:
                per_rank = epoch_batches(self.table, epoch=epoch, seed=self.seed, **pack)
            else:
                left, begin = None, 0
                if self.follows(epoch, follow_state):
                    left, begin = self._followed_left(_windows(follow_state), *parts[0]), 1
                per_rank = rest_of_epoch(self.table, epoch=epoch, seed=self.seed, parts=list(parts), left=left,
                                         begin=begin, **pack)  # fmt: skip
            self._batches = (key, _rank_plan(self.table, per_rank, self.rank))
        return self._batches[1]

    def _window_plan(self, number: int, window: Window, carry: SampleTable, world_size: int
                     ) -> tuple[SampleTable, list[list[np.ndarray]], SampleTable]:  # fmt: skip
        """Follow window `number`'s table (the rows carried in, then its units), its batches dealt to
        `world_size` ranks, and the rows it carries on: a pure function of its arguments."""
        table = SampleTable.concat([carry, self.open_window(window.units)])
        rng = np.random.default_rng([self.seed, 0, number])
        per_rank, rest = _pack_and_deal(table, rng, token_budget=self.token_budget, bucket_edges=self.bucket_edges,
                                        world_size=world_size, final=window.final,
                                        batch_cost=self.batch_cost)  # fmt: skip
        return table, per_rank, table.take(rest) if not window.final else SampleTable.concat([])

    def _followed_left(self, windows: list[Window], world_size: int, batches: int) -> np.ndarray:
        """Rows of the (complete) table that a followed epoch 0 had not consumed after `batches`
        batches per rank on `world_size` ranks over `windows`: its windows replayed as it ran them."""
        carry, used = SampleTable.concat([]), []
        for number, window in enumerate(windows):
            table, per_rank, carry = self._window_plan(number, window, carry, world_size)
            n = min(batches, len(per_rank[0]))
            used += [table.take(b) for mine in per_rank for b in mine[:n]]
            batches -= n
        if batches:
            raise ValueError(f"{batches} batches per rank past the checkpoint's follow windows")
        used_keys, keys = _row_keys(SampleTable.concat(used)), _row_keys(self.table)  # keys: sorted, unique
        at = np.searchsorted(keys, used_keys)
        if not np.array_equal(keys[np.minimum(at, len(keys) - 1)], used_keys):
            raise ValueError("a followed sample is not in the cache's table")
        return np.setdiff1d(np.arange(len(self.table), dtype=np.int64), at)

    def _open(self, units: Iterable[int]) -> None:
        """Open the given units that are not open yet (bad ones as `skip_bad_units` says)."""
        new = [u for u in units if u not in self.readers]
        readers, problems = open_units(self.cache_dir, skip_bad_units=self.skip_bad_units, only=new)
        self.readers.update(readers)
        self.dropped += problems

    def _refresh(self) -> None:
        """Index units committed since the loader opened (after a followed epoch, all of them)."""
        if self.complete or not self.follow:
            return
        committed = committed_units(self.cache_dir)
        self._open(committed)
        self.table = SampleTable.from_units(self.readers)
        self.complete = len(committed) >= self.spec.plan.num_units

    def open_window(self, units: tuple[int, ...]) -> SampleTable:
        """Open a follow window's units (once) and index their samples, in unit order."""
        self._open(units)
        return SampleTable.from_units({u: self.readers[u] for u in units if u in self.readers})

    def num_batches(self, epoch: int) -> int:
        """Batches this rank gets in `epoch` of a complete cache: the same on every rank."""
        return len(self._rank_batches(epoch))

    def follows(self, epoch: int, state: dict | None = None) -> bool:
        """Whether `epoch` follows the extraction: epoch 0 of an incomplete cache, or of a
        checkpoint taken while following (`state`, from `follow_state`)."""
        return epoch == 0 and (state is not None or (self.follow and not self.complete))

    def follow_state(self) -> dict | None:
        """The windows the current followed epoch has taken so far (all ranks agree), or None."""
        if self._follow is None:
            return None
        return {"windows": [[list(w.units), w.final] for w in self._follow.windows]}

    @property
    def host_bytes(self) -> int:
        """Host memory held by the slots: fixed at construction, whatever the dataset size."""
        return sum(s.nbytes for s in self.host_slots)

    # -- streaming ----------------------------------------------------------------------------

    def epoch(self, epoch: int, start_batch: int = 0, follow_state: dict | None = None,
              parts: list[tuple[int, int]] = ()) -> Iterator[Batch]:  # fmt: skip
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
            self._follow = _FollowSource(self, _windows(follow_state), start_batch)
            source: _Source = self._follow
        else:
            self._follow = None
            batches = self._rank_batches(epoch, parts, follow_state)
            begin = parts[-1][1] if parts else 0
            if not begin <= start_batch <= begin + len(batches):
                raise ValueError(f"start_batch {start_batch} is outside {begin}..{begin + len(batches)} "
                                 f"for epoch {epoch}")  # fmt: skip
            source = _ListSource(batches[start_batch - begin :])
        self._active = self._stream_batches(source)
        return self._active

    def _stream_batches(self, source: _Source) -> Iterator[Batch]:
        free: list[_Slot] = list(self.host_slots)
        pending: deque[_Pending] = deque()  # reads submitted, in batch order
        copying: deque[tuple[_Slot, torch.cuda.Event | None]] = deque()  # copies whose slot is not free yet
        held: list[_Planned] = []  # the next batch, taken from the source, waiting for a slot

        def reclaim(block: bool) -> None:
            # A slot is free again once the copy out of it has completed (event query). When
            # nothing else can make progress, wait for the oldest copy (event synchronize).
            while copying and (copying[0][1] is None or copying[0][1].query()):
                free.append(copying.popleft()[0])
            if block and not free and copying:
                t0 = time.perf_counter()
                copying[0][1].synchronize()
                self.wait_seconds += time.perf_counter() - t0
                free.append(copying.popleft()[0])

        def submit(block: bool = False) -> None:
            # Hand free slots to the readers, one batch per slot, in batch order. Only when
            # nothing is being read (the consumer would have nothing to take) does it wait for
            # the source (a followed extraction) or for a slot.
            while True:
                if not held:
                    t0 = time.perf_counter()
                    batch = source.next(block=block and not pending)
                    self.wait_seconds += time.perf_counter() - t0
                    if batch is None:
                        return
                    held.append(batch)
                reclaim(block=not pending)
                if not free:
                    return
                slot = free.pop()
                self.peak_slots_in_use = max(self.peak_slots_in_use, len(self.host_slots) - len(free))
                pending.append(self._submit_reads(held.pop(), slot))

        def stage(block: bool) -> _Staged | None:
            # Issue the device copy of the next batch in order, once all its samples are decoded
            # (futures in batch order: whichever reader finishes first, batch i stays batch i).
            if not pending:
                return None
            job = pending[0]
            if not block and not all(f.done() and f.exception() is None for f in job.futures):
                return None  # not ready, or failed: the blocking path raises it in its turn
            t0 = time.perf_counter()
            try:
                for f in job.futures:
                    f.result()  # a CorruptUnit raised by a reader propagates here, naming the unit
            finally:
                self.wait_seconds += time.perf_counter() - t0
            pending.popleft()
            staged = self._copy_to_device(job)
            copying.append((job.slot, staged.event))
            return staged

        try:
            submit(block=True)
            nxt = stage(block=True)
            while nxt is not None:
                current, nxt = nxt, None
                submit()
                # Copy batch i+1 while the trainer works on batch i, if its reads are done;
                # otherwise yield batch i now and stage i+1 when the trainer asks for it.
                nxt = stage(block=False)
                submit()
                yield self._hand_over(current)
                current = None  # the loader's reference: at most this batch and the next on the device
                if nxt is None:
                    submit(block=True)
                    nxt = stage(block=True)
        finally:
            source.close()
            for job in pending:
                for f in job.futures:
                    f.cancel()
            wait_futures([f for job in pending for f in job.futures])  # readers must leave the slots
            for _, event in copying:
                if event is not None:
                    event.synchronize()

    def _submit_reads(self, planned: _Planned, slot: _Slot) -> _Pending:
        """Reader tasks that decode the batch into the slot: one per sample, and a long sample cut
        into pieces along the cache's chunks, so that the readers share it (one 24K-token sample
        is about 1 GB of hidden states: one thread decoding it alone starved the GPU)."""
        batch = planned.samples
        lengths = batch.length
        offsets = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = int(offsets[-1])
        if n > self.slot_rows:
            raise RuntimeError(f"batch of {n} tokens exceeds the host slot of {self.slot_rows} rows")
        slot.offsets.numpy()[: len(offsets)] = offsets
        futures = []
        for i in range(len(batch)):
            unit, start, length, dst = int(batch.unit[i]), int(batch.start[i]), int(batch.length[i]), int(offsets[i])
            for lo, hi in _pieces(start, start + length, self.piece_rows):
                futures.append(self._pool.submit(self._read_rows, slot, unit, lo, hi, dst + lo - start))
        return _Pending(batch, slot, futures, n, planned.step_tokens)

    def _read_rows(self, slot: _Slot, unit: int, start: int, stop: int, dst: int) -> None:
        reader = self.readers[unit]
        for key in slot.np:  # hidden, input_ids, loss_mask (+ hidden_scale for fp8)
            reader.read_into(key, start, stop, out=slot.np[key][dst : dst + stop - start])

    def _copy_to_device(self, job: _Pending) -> _Staged:
        """Copy a decoded slot to the device (side stream on CUDA), then select layers and
        dequantise there; the event recorded after it tells both the consumer and the slot pool."""
        n, s, slot = job.num_tokens, len(job.batch), job.slot

        def up(t: torch.Tensor) -> torch.Tensor:
            # An explicit copy, also on the CPU, where .to() would alias the reused slot.
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            out.copy_(t, non_blocking=self._cuda)
            return out

        with torch.cuda.stream(self._stream) if self._cuda else nullcontext():
            hidden = up(slot.hidden[:n])
            scale = up(slot.scale[:n]) if slot.scale is not None else None
            input_ids = up(slot.input_ids[:n]).long()
            loss_mask = up(slot.loss_mask[:n]).bool()
            offsets = up(slot.offsets[: s + 1])
            context = self._context(hidden, scale, n)
            event = None
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
        batch = Batch(
            context=context,
            input_ids=input_ids,
            loss_mask=loss_mask,
            offsets=offsets,
            sample_index=torch.from_numpy(job.batch.sample_index.copy()),
            num_tokens=n,
            step_tokens=job.step_tokens,
            # block building needs these on the host; reading them back from the device would
            # make the host wait for the GPU every step
            host=(slot.input_ids[:n].clone(), slot.loss_mask[:n].clone(), slot.offsets[: s + 1].clone()),
        )
        return _Staged(batch, slot, event)

    def _context(self, hidden: torch.Tensor, scale: torch.Tensor | None, n: int) -> torch.Tensor:
        """Storage bits on the device -> [n, K'*H] of the selected layers."""
        k, h = self._num_layers, self._hidden_size
        if scale is None:
            bf16 = hidden.view(torch.bfloat16)
            if self._all_layers:
                return bf16
            return bf16.view(n, k, h).index_select(1, self._layer_index).reshape(n, -1)
        q = hidden.view(torch.float8_e4m3fn).view(n, k, h)
        if not self._all_layers:
            q, scale = q.index_select(1, self._layer_index), scale.index_select(1, self._layer_index)
        return (q.float() * scale.unsqueeze(-1)).reshape(n, -1)

    def _hand_over(self, staged: _Staged) -> Batch:
        """Make the consumer's stream (not the host) wait for the copy, and tell the caching
        allocator that the consumer's stream uses tensors allocated on the side stream."""
        batch = staged.batch
        if staged.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(staged.event)
            for t in (batch.context, batch.input_ids, batch.loss_mask, batch.offsets):
                t.record_stream(stream)
        return batch

    def close(self) -> None:
        """Stop the current epoch's reads (and following) and the reader threads."""
        if self._active is not None:
            self._active.close()
            self._active = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> CacheLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Source:
    """Where `_stream_batches` takes this rank's batches from, in order."""

    def next(self, block: bool) -> _Planned | None:
        """The next batch; None when there is none yet (only if not `block`) or none left."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ListSource(_Source):
    """An epoch whose batches are all known (a complete cache)."""

    def __init__(self, batches: list[_Planned]):
        self.todo = deque(batches)

    def next(self, block: bool) -> _Planned | None:
        return self.todo.popleft() if self.todo else None


class _FollowSource(_Source):
    """A followed epoch: this rank's batches, window by window, as units commit.

    Each window's batches are a pure function of (seed, window number, the window's units, the
    rows carried from the window before): leftover batches that do not divide among the ranks
    are carried into the next window, and split in the final one. So the windows alone (kept in
    checkpoints) reproduce the epoch's batch sequence, on every rank.
    """

    def __init__(self, loader: CacheLoader, windows: list[Window], start_batch: int):
        self.loader = loader
        self.windows: list[Window] = []
        self.carry = SampleTable.concat([])
        self.todo: deque[tuple[_Planned, int]] = deque()  # (batch, window number)
        self.final = False
        self.units_read = 0
        for w in windows:  # replay what a resumed run had taken
            self._add(w)
        for _ in range(start_batch):
            if not self.todo:
                raise ValueError(f"start_batch {start_batch} is past the checkpoint's follow windows")
            self._pop()
        self.feed = None
        if not self.final:
            self.feed = UnitFeed(loader.cache_dir, loader.spec.plan.num_units, known=self.windows, rank=loader.rank,
                                 world_size=loader.world_size, group=loader.control_group,
                                 on_status=self._status if loader.on_status is not None else None)  # fmt: skip

    def _add(self, w: Window) -> None:
        ld = self.loader
        table, per_rank, self.carry = ld._window_plan(len(self.windows), w, self.carry, ld.world_size)
        mine = _rank_plan(table, per_rank, ld.rank)
        self.todo.extend((planned, len(self.windows)) for planned in mine)
        self.windows.append(w)
        self.final = w.final
        if not mine:
            self.units_read += len(w.units)  # nothing of this window for this rank to read

    def _pop(self) -> _Planned:
        batch, window = self.todo.popleft()
        if not self.todo or self.todo[0][1] != window:
            self.units_read += len(self.windows[window].units)
        return batch

    def next(self, block: bool) -> _Planned | None:
        while not self.todo:
            if self.final:
                return None
            self.feed.request()
            window = self.feed.get(block)
            if window is None:
                return None
            self._add(window)
        return self._pop()

    def _status(self, status: dict) -> None:
        self.loader.on_status({**status, "read": self.units_read, "wait_s": self.loader.wait_seconds})

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
