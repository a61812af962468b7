"""The batch plans (train/batching.py): pure functions of numpy arrays, checked without a cache,
threads or processes against counts computed here independently."""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_cache.train.batching import (
    SampleTable,
    deal,
    epoch_batches,
    followed_rest,
    pack_batches,
    rank_plan,
    resume_parts,
    window_batches,
)

EDGES = [64, 128, 256, 512]


def _table(n: int = 300, seed: int = 0, units: int = 30) -> SampleTable:
    """`n` samples in `units` units of equal count, packed one after another within each unit."""
    rng = np.random.default_rng(seed)
    length = rng.integers(8, 700, n).astype(np.int64)
    per = n // units
    unit = np.repeat(np.arange(units, dtype=np.int64), per)
    start = np.concatenate([np.concatenate([[0], np.cumsum(length[i : i + per])[:-1]]) for i in range(0, n, per)])
    return SampleTable(unit, start.astype(np.int64), length, np.arange(n, dtype=np.int64) + 1000)


def _units(table: SampleTable, ids) -> SampleTable:
    """The samples of the given units, in unit order (what the loader indexes for a window)."""
    return table.take(np.flatnonzero(np.isin(table.unit, list(ids))))


def test_sample_table_indexes_units_in_id_order():
    def reader(lengths, index):
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return SimpleNamespace(n_samples=len(lengths), offsets=offsets, lengths=np.asarray(lengths),
                               sample_index=np.asarray(index))  # fmt: skip

    table = SampleTable.from_units({7: reader([3, 5], [70, 71]), 2: reader([4], [20]), 4: reader([], [])})
    assert table.unit.tolist() == [2, 7, 7] and table.start.tolist() == [0, 0, 3]
    assert table.length.tolist() == [4, 3, 5] and table.sample_index.tolist() == [20, 70, 71]
    assert table.num_tokens == 12 and len(SampleTable.from_units({})) == 0
    keys = table.row_keys()
    assert (np.diff(keys) > 0).all()  # sorted and unique: what followed_rest looks samples up in
    both = SampleTable.concat([table.take(np.array([2])), table.take(np.array([0]))])
    assert both.sample_index.tolist() == [71, 20]


def test_deal_splits_leftovers_and_carries_when_not_final():
    batches = [np.array([0, 1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8])]
    per_rank, rest = deal(batches, 2, final=False)
    assert [[b.tolist() for b in r] for r in per_rank] == [[[0, 1, 2, 3]], [[4, 5]]] and rest.tolist() == [6, 7, 8]
    per_rank, rest = deal(batches, 2, final=True)  # the leftover [6, 7, 8] is split in two
    assert [[b.tolist() for b in r] for r in per_rank] == [[[0, 1, 2, 3], [6]], [[4, 5], [7, 8]]]
    assert rest.tolist() == []
    per_rank, rest = deal([np.array([0]), np.array([1])], 3, final=True)  # fewer samples than ranks
    assert per_rank == [[], [], []] and rest.tolist() == [0, 1]


def test_balanced_dealing_evens_out_each_steps_compute():
    """DDP steps wait for their slowest rank. On the benchmarks' length mix, token-budget batches
    dealt as they come cost 1.5x (2 ranks) to 1.8x (8 ranks) the mean rank's step; dealt by
    drafter cost, within 1%. The balanced deal gives out the same batches, in a step order that
    stays shuffled, and changes nothing for one rank."""
    from dflash_cache.bench.ranks import rank_balance
    from dflash_cache.bench.shapes import lognormal_lengths
    from dflash_cache.cache.spec import default_bucket_edges
    from dflash_cache.train.cost import drafter_cost

    lengths = lognormal_lengths(4000).astype(np.int64)
    figures = rank_balance(lengths, ranks=(2, 4, 8))
    for w in (2, 4, 8):
        assert figures[f"speedup_{w}_as_they_come"] < 0.8 * w
        assert figures[f"speedup_{w}_by_cost"] > 0.99 * w

    table = SampleTable(np.zeros_like(lengths), np.zeros_like(lengths), lengths, np.arange(len(lengths)))
    batches = pack_batches(table, np.random.default_rng(0), token_budget=4096, bucket_edges=default_bucket_edges(3072))
    cost = np.array([drafter_cost(lengths[b], 16, 512) for b in batches])
    for w in (2, 8):
        keep = len(batches) // w * w  # the rest is left over (carried or split), not balanced
        order = np.argsort(np.argsort(cost[:keep], kind="stable"))
        rank_of_cost = {id(b): r for r, b in zip(order, batches[:keep], strict=True)}
        plain, _ = deal(batches, w, final=False)  # (a final deal would also split the leftovers)
        balanced, _ = deal(batches, w, final=False, cost=cost)
        assert sorted(id(b) for r in balanced for b in r) == sorted(id(b) for r in plain for b in r)
        steps = np.array([[rank_of_cost[id(r[i])] for r in balanced] for i in range(len(balanced[0]))])
        assert (steps.max(1) - steps.min(1) == w - 1).all()  # each step: w neighbours in cost order
        rises = np.mean(np.diff(steps.min(1)) > 0)
        assert 0.35 < rises < 0.65  # steps not sorted by cost: about half are dearer than the last
    one, _ = deal(batches, 1, cost=cost)
    assert [id(b) for b in one[0]] == [id(b) for b in batches]


def test_rank_plan_knows_what_each_step_consumes_on_all_ranks():
    table = _table()
    per_rank = epoch_batches(table, epoch=1, seed=4, token_budget=600, bucket_edges=EDGES, world_size=3)
    plans = [rank_plan(table, per_rank, r) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    for i in range(len(plans[0])):
        mine = [p[i].samples for p in plans]
        assert [len(s) for s in mine] == list(plans[0][i].step_samples)
        assert plans[0][i].step_tokens == sum(int(s.length.sum()) for s in mine)
        assert all(p[i].step_tokens == plans[0][i].step_tokens and p[i].step_samples == plans[0][i].step_samples
                   for p in plans)  # fmt: skip
    for r in range(3):  # each rank's samples are its own rows of the table, in the plan's order
        got = np.concatenate([p.samples.sample_index for p in plans[r]])
        assert got.tolist() == table.sample_index[np.concatenate(per_rank[r])].tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_follow_windows_deal_each_sample_once_and_carry_leftovers(world_size):
    """Windows of units as they commit: every window's batches are dealt evenly, batches that do not
    divide among the ranks are carried, and the final window splits them, so the followed epoch
    trains every sample once (all but at most W - 1)."""
    table = _table()
    windows = [(range(0, 4), False), (range(4, 5), False), (range(5, 17), False), (range(17, 30), True)]
    pack = {"seed": 3, "token_budget": 600, "bucket_edges": EDGES, "world_size": world_size}
    carry, trained = SampleTable.concat([]), []
    for number, (units, final) in enumerate(windows):
        new = _units(table, units)
        window, per_rank, next_carry = window_batches(number, new, carry, final=final, **pack)
        assert window.sample_index.tolist() == carry.sample_index.tolist() + new.sample_index.tolist()
        assert len({len(mine) for mine in per_rank}) == 1
        dealt = [int(s) for mine in per_rank for b in mine for s in window.sample_index[b]]
        if final:
            assert len(next_carry) == 0
        else:
            assert sorted(dealt + next_carry.sample_index.tolist()) == sorted(window.sample_index.tolist())
            assert world_size > 1 or len(next_carry) == 0  # one rank takes every batch: nothing to carry
        trained += dealt
        carry = next_carry
    assert max(Counter(trained).values()) == 1
    assert len(table) - len(trained) <= world_size - 1
    again = window_batches(0, _units(table, range(0, 4)), SampleTable.concat([]), final=False, **pack)[1]
    first = window_batches(0, _units(table, range(0, 4)), SampleTable.concat([]), final=False, **pack)[1]
    assert [b.tolist() for m in again for b in m] == [b.tolist() for m in first for b in m]  # a pure function


def test_followed_rest_is_what_the_windows_left():
    table = _table()
    windows = [(_units(table, range(0, 6)), False), (_units(table, range(6, 9)), False),
               (_units(table, range(9, 30)), True)]  # fmt: skip
    pack = {"seed": 8, "token_budget": 600, "bucket_edges": EDGES, "world_size": 2}
    # the followed epoch as it ran: window after window, each rank's batches in order
    ran, carry = [], SampleTable.concat([])
    for number, (units, final) in enumerate(windows):
        window, per_rank, carry = window_batches(number, units, carry, final=final, **pack)
        ran += [[window.take(b) for b in mine] for mine in zip(*per_rank, strict=True)]  # step by step
    for batches in (0, 1, 5, len(ran) - 1, len(ran)):
        consumed = {int(s) for step in ran[:batches] for b in step for s in b.sample_index}
        left = followed_rest(table, windows, batches=batches, **pack)
        assert table.sample_index[left].tolist() == [s for s in table.sample_index.tolist() if s not in consumed]
    with pytest.raises(ValueError, match="past the checkpoint's follow windows"):
        followed_rest(table, windows, batches=len(ran) + 1, **pack)
    with pytest.raises(ValueError, match="not in the cache's table"):
        followed_rest(_units(table, range(0, 6)), windows, batches=len(ran), **pack)


def test_resume_parts_from_a_saved_position():
    position = {"epoch": 1, "batch": 6, "samples": [40, 41], "world_size": 2, "parts": [[3, 2]]}
    assert resume_parts(position, 2) == [[3, 2]]  # the same world size: the saved parts
    assert resume_parts(position, 4) == [[3, 2], [2, 6]]  # another: the part that ran so far is added
    assert resume_parts({**position, "batch": 0, "parts": []}, 4) == []  # nothing ran yet
    older = {"epoch": 1, "batch": 6, "samples": [40, 41, 40]}  # before world_size was saved: one entry a rank
    assert resume_parts(older, 3) == [] and resume_parts(older, 1) == [[3, 6]]
