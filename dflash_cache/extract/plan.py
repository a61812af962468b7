"""The extraction plan: length buckets, token-budget batches, work units, rank assignment.

The plan is a pure function of the sample lengths and three numbers, so every process, node and
rerun derives the same units, whatever the number of GPUs. A unit's id is its place in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ForwardBatch:
    """Samples `start:stop` of a unit, run through the target padded to `max_len`."""

    start: int
    stop: int
    max_len: int


@dataclass(frozen=True)
class Unit:
    """One committed group of samples: rows of the tokenized dataset, in plan order."""

    id: int
    rows: np.ndarray  # int64 positions in the tokenized dataset
    lengths: np.ndarray  # int64 token counts, aligned with rows
    batches: tuple[ForwardBatch, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def offsets(self) -> np.ndarray:
        """Row offsets of each sample in the unit's packed arrays."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)


@dataclass(frozen=True)
class Plan:
    units: tuple[Unit, ...]
    bucket_edges: tuple[int, ...]
    token_budget: int
    unit_tokens: int

    @property
    def num_samples(self) -> int:
        return sum(len(u.rows) for u in self.units)

    @property
    def num_tokens(self) -> int:
        return sum(u.num_tokens for u in self.units)

    @property
    def padded_tokens(self) -> int:
        """Tokens the target computes, padding included."""
        return sum((b.stop - b.start) * b.max_len for u in self.units for b in u.batches)

    @property
    def padding_ratio(self) -> float:
        padded = self.padded_tokens
        return 1.0 - self.num_tokens / padded if padded else 0.0

    def units_for_rank(self, rank: int, world_size: int) -> list[Unit]:
        """Rank r of W takes the units whose id mod W is r."""
        return [u for u in self.units if u.id % world_size == rank]


def make_plan(
    lengths: np.ndarray,
    *,
    bucket_edges: list[int],
    token_budget: int,
    unit_tokens: int,
) -> Plan:
    """Cut samples into units of about `unit_tokens` tokens made of token-budget batches.

    Samples are sorted longest first (so a batch that does not fit in memory fails at once, not
    hours in), batches never cross a bucket edge, and a batch holds at most `token_budget`
    padded tokens (a single longer sample gets a batch of its own). Ties keep dataset order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.min() < 1:
        raise ValueError("every sample needs at least one token")
    if len(lengths) and lengths.max() > bucket_edges[-1]:
        raise ValueError(f"a sample of {lengths.max()} tokens exceeds the last bucket edge {bucket_edges[-1]}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    sorted_len = lengths[order]
    bucket = np.searchsorted(np.asarray(bucket_edges), sorted_len, side="left")

    batches: list[tuple[int, int, int]] = []  # (start, stop, max_len) over `order`
    start = 0
    while start < len(order):
        max_len = int(sorted_len[start])
        cap = max(1, token_budget // max_len)
        stop = start + 1
        while stop < len(order) and stop - start < cap and bucket[stop] == bucket[start]:
            stop += 1
        batches.append((start, stop, max_len))
        start = stop

    units, group = [], []
    group_tokens = 0
    for b in batches:
        group.append(b)
        group_tokens += int(sorted_len[b[0] : b[1]].sum())
        if group_tokens >= unit_tokens:
            units.append(_unit(len(units), group, order, sorted_len))
            group, group_tokens = [], 0
    if group:
        units.append(_unit(len(units), group, order, sorted_len))
    return Plan(tuple(units), tuple(bucket_edges), token_budget, unit_tokens)


def _unit(uid: int, group: list[tuple[int, int, int]], order: np.ndarray, sorted_len: np.ndarray) -> Unit:
    first = group[0][0]
    last = group[-1][1]
    batches = tuple(ForwardBatch(s - first, e - first, m) for s, e, m in group)
    return Unit(uid, order[first:last].astype(np.int64), sorted_len[first:last].copy(), batches)
