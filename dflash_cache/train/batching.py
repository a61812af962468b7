"""Which samples make up each rank's batches: pure functions of numpy arrays, no I/O, no threads.

The loader (`loader.py`) streams what these functions plan. Everything here is a function of its
arguments (the sample table, the seed, the epoch, the world size), so every DDP rank computes the
same plan without talking to the others, and a resumed run recomputes the plan it was killed in:

- `SampleTable`: one row per cached sample (unit, first row, length, source row);
- `pack_batches`: shuffle, bucket by length, pack token-budget batches, shuffle the batches;
- `deal`: equal batch counts per rank, leftovers split or carried; `cost` balances each step;
- `epoch_batches`: an epoch's plan; `rest_of_epoch`: the rest of an epoch begun on other world
  sizes (elastic resume); `window_batches` and `followed_rest`: the windows of a followed epoch
  (a cache still being extracted) and what such an epoch left;
- `rank_plan`: one rank's batches, each knowing what its step consumes over all ranks;
- `resume_parts`: a saved position's earlier parts, for a resume on another world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dflash_cache.cache.unit.read import UnitReader

BatchCost = Callable[[np.ndarray], float]  # a batch's cost (its compute) from its sample lengths
RESHARD_KEY = 0x5E5  # in the seed of a re-dealt remainder's generator, apart from (seed, epoch) and follow windows


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
    def from_units(cls, readers: Mapping[int, UnitReader]) -> SampleTable:
        """Index the samples of every given unit (ids sorted, whatever the dict order)."""
        ids = sorted(readers)
        if not ids:
            return cls.concat([])
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

    def row_keys(self) -> np.ndarray:
        """One int64 per sample, (unit, first row): sorted and unique over a `from_units` table."""
        return self.unit * (1 << 40) + self.start


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


def pack_and_deal(table: SampleTable, rng: np.random.Generator, *, token_budget: int, bucket_edges: list[int],
                  world_size: int, final: bool = True, batch_cost: BatchCost | None = None
                  ) -> tuple[list[list[np.ndarray]], np.ndarray]:  # fmt: skip
    """`pack_batches` then `deal`, balanced by `batch_cost` (a batch's cost from its sample lengths)."""
    batches = pack_batches(table, rng, token_budget=token_budget, bucket_edges=bucket_edges)
    cost = None if batch_cost is None else np.array([batch_cost(table.length[b]) for b in batches])
    return deal(batches, world_size, final=final, cost=cost)


def epoch_batches(table: SampleTable, *, epoch: int, seed: int, token_budget: int, bucket_edges: list[int],
                  world_size: int, batch_cost: BatchCost | None = None) -> list[list[np.ndarray]]:  # fmt: skip
    """Every rank's batches (arrays of table rows) for one epoch; a pure function of the inputs,
    shuffled by a generator seeded with (seed, epoch). See `pack_batches` and `deal`;
    `batch_cost` maps a batch's sample lengths to its cost, to balance the ranks' steps."""
    rng = np.random.default_rng([seed, epoch])
    return pack_and_deal(table, rng, token_budget=token_budget, bucket_edges=bucket_edges, world_size=world_size,
                         batch_cost=batch_cost)[0]  # fmt: skip


def rest_of_epoch(
    table: SampleTable,
    *,
    epoch: int,
    seed: int,
    token_budget: int,
    bucket_edges: list[int],
    world_size: int,
    parts: list[tuple[int, int]],
    batch_cost: BatchCost | None = None,
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
    (`followed_rest`) and `begin` = 1.
    """

    def plan(k: int, size: int, rows: np.ndarray) -> list[list[np.ndarray]]:
        rng = np.random.default_rng([seed, epoch] if k == 0 else [seed, epoch, RESHARD_KEY, k])
        dealt, _ = pack_and_deal(table.take(rows), rng, token_budget=token_budget, bucket_edges=bucket_edges,
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


def window_batches(number: int, units: SampleTable, carry: SampleTable, *, final: bool, seed: int,
                   token_budget: int, bucket_edges: list[int], world_size: int, batch_cost: BatchCost | None = None
                   ) -> tuple[SampleTable, list[list[np.ndarray]], SampleTable]:  # fmt: skip
    """Follow window `number` of epoch 0: its table (the rows `carry`-ed in, then the samples of its
    `units`), its batches dealt to the ranks, and the rows it carries on to the next window.

    Leftover batches that do not divide among the ranks are carried, and split in the `final`
    window; so the windows alone reproduce the followed epoch's batches, on every rank."""
    table = SampleTable.concat([carry, units])
    rng = np.random.default_rng([seed, 0, number])
    per_rank, rest = pack_and_deal(table, rng, token_budget=token_budget, bucket_edges=bucket_edges,
                                   world_size=world_size, final=final, batch_cost=batch_cost)  # fmt: skip
    return table, per_rank, table.take(rest) if not final else SampleTable.concat([])


def followed_rest(table: SampleTable, windows: Iterable[tuple[SampleTable, bool]], *, batches: int,
                  **packing) -> np.ndarray:  # fmt: skip
    """Rows of the (complete) `table` that a followed epoch 0 had not consumed after `batches`
    batches per rank over its `windows` (each: its units' samples, whether final), replayed with
    `packing` (`window_batches`' keywords, the world size it ran on included) as it ran them."""
    carry, used = SampleTable.concat([]), []
    for number, (units, final) in enumerate(windows):
        window, per_rank, carry = window_batches(number, units, carry, final=final, **packing)
        n = min(batches, len(per_rank[0]))
        used += [window.take(b) for mine in per_rank for b in mine[:n]]
        batches -= n
    if batches:
        raise ValueError(f"{batches} batches per rank past the checkpoint's follow windows")
    used_keys, keys = SampleTable.concat(used).row_keys(), table.row_keys()  # keys: sorted, unique
    at = np.searchsorted(keys, used_keys)
    if not np.array_equal(keys[np.minimum(at, len(keys) - 1)], used_keys):
        raise ValueError("a followed sample is not in the cache's table")
    return np.setdiff1d(np.arange(len(table), dtype=np.int64), at)


@dataclass(frozen=True)
class Planned:
    """One batch of one rank, and what its step consumes over all ranks."""

    samples: SampleTable
    step_tokens: int  # context tokens of the step, summed over the ranks (the schedule counts these)
    step_samples: tuple[int, ...]  # samples of the step, per rank


def rank_plan(table: SampleTable, per_rank: list[list[np.ndarray]], rank: int) -> list[Planned]:
    """One rank's batches; every rank computes the same per-rank plan, so each also knows what
    every step consumes in total."""
    return [
        Planned(table.take(rows), sum(int(table.length[other[i]].sum()) for other in per_rank),
                tuple(len(other[i]) for other in per_rank))
        for i, rows in enumerate(per_rank[rank])
    ]  # fmt: skip


def resume_parts(position: Mapping, world_size: int) -> list[list[int]]:
    """The earlier parts (see `rest_of_epoch`) of a saved position's epoch, resumed on `world_size`
    ranks, as [world size, batches per rank done at its end].

    On the position's own world size they are the saved ones (none for a run that never changed
    size: the epoch's own plan, bitwise as before). On another world size mid-epoch, the part that
    ran so far is added, and the rest of the epoch is dealt to the new ranks; at an epoch's start
    nothing ran, so the epoch is planned for the new size.
    """
    parts = [list(p) for p in position.get("parts", [])]
    saved = position.get("world_size", len(position["samples"]))  # older checkpoints: one samples entry a rank
    if saved == world_size or position["batch"] == 0:
        return parts
    return [*parts, [saved, position["batch"]]]
