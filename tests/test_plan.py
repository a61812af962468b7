import numpy as np
import pytest

from dflash_cache.cache.spec import default_bucket_edges
from dflash_cache.extract.plan import make_plan


def _plan(lengths, budget=512, unit_tokens=2000, max_length=1024):
    return make_plan(np.asarray(lengths), bucket_edges=default_bucket_edges(max_length), token_budget=budget,
                     unit_tokens=unit_tokens)


def test_every_sample_once_and_units_independent_of_world_size():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1024, size=777)
    plan = _plan(lengths)
    rows = np.concatenate([u.rows for u in plan.units])
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    for u in plan.units:
        np.testing.assert_array_equal(u.lengths, lengths[u.rows])
        assert u.offsets[-1] == u.num_tokens
    for world in (1, 2, 3, 5):
        ids = sorted(u.id for r in range(world) for u in plan.units_for_rank(r, world))
        assert ids == [u.id for u in plan.units]
    assert [u.rows.tolist() for u in _plan(lengths).units] == [u.rows.tolist() for u in plan.units]


def test_batches_respect_budget_and_buckets():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 1024, size=500)
    edges = np.asarray(default_bucket_edges(1024))
    plan = _plan(lengths)
    for u in plan.units:
        covered = []
        for b in u.batches:
            ls = u.lengths[b.start : b.stop]
            assert b.max_len == ls.max()
            assert (b.stop - b.start) * b.max_len <= max(plan.token_budget, b.max_len)
            assert len(set(np.searchsorted(edges, ls).tolist())) == 1
            covered += list(range(b.start, b.stop))
        assert covered == list(range(len(u.rows)))


def test_padding_is_small_on_a_log_normal_mix():
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(6.0, 0.8, size=5000), 64, 3072).astype(int)
    plan = _plan(lengths, budget=16384, unit_tokens=200_000, max_length=3072)
    padded = sum((b.stop - b.start) * b.max_len for u in plan.units for b in u.batches)
    assert plan.padded_tokens == padded
    assert plan.padding_ratio == pytest.approx(1 - lengths.sum() / padded)
    assert plan.padding_ratio < 0.03


def test_longest_first_and_too_long_rejected():
    plan = _plan([5, 900, 30, 900])
    assert plan.units[0].lengths[0] == 900 and plan.units[0].rows[0] == 1  # ties keep dataset order
    with pytest.raises(ValueError):
        _plan([2000], max_length=1024)
