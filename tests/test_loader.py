"""The train-stage loader against real caches written with store.write_unit (CPU only)."""

import os
import random
import time

import numpy as np
import pytest
import torch

from dflash_cache.cache.spec import (
    CacheSpec,
    DataInfo,
    LayerInfo,
    PlanInfo,
    SpecError,
    StorageInfo,
    TargetInfo,
    TokenizerInfo,
    write_spec,
)
from dflash_cache.cache.store import committed_units, write_unit
from dflash_cache.cache.unit.read import CorruptUnit, UnitReader
from dflash_cache.cache.unit.write import UnitArrays
from dflash_cache.train import stream as stream_mod
from dflash_cache.train.batching import SampleTable, epoch_batches
from dflash_cache.train.index import open_units
from dflash_cache.train.loader import CacheLoader

H = 8
LAYERS = [1, 3, 5]
K = len(LAYERS)
EDGES = [64, 128, 256, 512]
CPU = torch.device("cpu")


def _spec(dtype: str, units: int, samples: int) -> CacheSpec:
    return CacheSpec(
        target=TargetInfo(
            path="tiny",
            revision=None,
            weights_fingerprint="w",
            config_digest="c",
            model_type="qwen3",
            num_layers=8,
            hidden_size=H,
            vocab_size=1000,
            compute_dtype="bfloat16",
            tied_embeddings=True,
        ),
        layers=LayerInfo(ids=list(LAYERS)),
        storage=StorageInfo(dtype=dtype, codec={"name": "zstd", "level": 3, "checksum": True}, chunk_tokens=64),
        tokenizer=TokenizerInfo(
            digest="t", chat_template_digest=None, mask_token_id=5, pad_token_id=0, eos_token_ids=[1]
        ),
        data=DataInfo(
            source="synthetic", fingerprint="f", max_length=EDGES[-1], truncate=False, num_rows=samples, num_rejected=0
        ),
        plan=PlanInfo(
            bucket_edges=list(EDGES),
            token_budget=4096,
            unit_tokens=2048,
            num_units=units,
            num_samples=samples,
            num_tokens=0,
            padded_tokens=0,
        ),
    )


def _fp8_bits(rng, shape):
    # Every float8_e4m3fn bit pattern but the two NaNs (0x7F, 0xFF).
    bits = rng.integers(0, 254, size=shape, dtype=np.uint16)
    bits[bits >= 0x7F] += 1
    return bits.astype(np.uint8)


def build_cache(root, *, dtype="bf16", units=4, per_unit=15, seed=0, max_len=300):
    """A cache of `units` units of random samples (1..max_len tokens); sample_index is unique."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    write_spec(root, _spec(dtype, units, units * per_unit))
    storage = _spec(dtype, units, 0).storage
    rows = rng.permutation(units * per_unit * 3)[: units * per_unit]
    for u in range(units):
        lengths = rng.integers(1, max_len + 1, size=per_unit)
        if u == 0:
            lengths[0] = max_len  # the longest sample is always max_len: slot sizes are comparable
        n = int(lengths.sum())
        fp8 = dtype == "fp8"
        write_unit(
            root,
            u,
            UnitArrays(
                hidden=_fp8_bits(rng, (n, K * H)) if fp8 else rng.integers(0, 2**16, size=(n, K * H), dtype=np.uint16),
                hidden_scale=rng.uniform(0.01, 4.0, size=(n, K)).astype(np.float32) if fp8 else None,
                input_ids=rng.integers(0, 1000, size=n).astype(np.int32),
                loss_mask=rng.integers(0, 2, size=n).astype(np.uint8),
                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                sample_index=rows[u * per_unit : (u + 1) * per_unit].astype(np.int64),
            ),
            storage,
        )
    return root


def fp8_to_f32(bits):
    """Independent float8_e4m3fn decoding: 1 sign, 4 exponent (bias 7), 3 mantissa bits."""
    b = bits.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return (sign * mag).astype(np.float32)


class Truth:
    """Reference values read directly with fresh UnitReaders, keyed by sample_index."""

    def __init__(self, cache):
        self.where = {}
        self.readers = {u: UnitReader(p) for u, p in committed_units(cache).items()}
        for u, r in self.readers.items():
            for i, s in enumerate(r.sample_index):
                self.where[int(s)] = (u, int(r.offsets[i]), int(r.offsets[i + 1]))

    def read(self, sample, key):
        u, a, b = self.where[sample]
        return self.readers[u].read(key, a, b)

    def context(self, samples, layers, fp8):
        cols = [LAYERS.index(layer) for layer in layers]
        parts = []
        for s in samples:
            bits = self.read(s, "hidden").reshape(-1, K, H)[:, cols]
            if fp8:
                scale = self.read(s, "hidden_scale")[:, cols]
                parts.append((fp8_to_f32(bits) * scale[:, :, None]).reshape(len(bits), -1))
            else:
                parts.append(bits.reshape(len(bits), -1))
        return np.concatenate(parts)


def check_batch(batch, truth, layers=LAYERS, fp8=False):
    samples = batch.sample_index.tolist()
    lengths = [truth.where[s][2] - truth.where[s][1] for s in samples]
    np.testing.assert_array_equal(batch.offsets.numpy(), np.concatenate([[0], np.cumsum(lengths)]))
    assert batch.num_tokens == sum(lengths) == batch.context.shape[0]
    assert batch.context.shape[1] == len(layers) * H
    if fp8:
        assert batch.context.dtype == torch.float32
        got = batch.context.numpy()
    else:
        assert batch.context.dtype == torch.bfloat16
        got = batch.context.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, truth.context(samples, layers, fp8))
    ids = np.concatenate([truth.read(s, "input_ids") for s in samples])
    mask = np.concatenate([truth.read(s, "loss_mask") for s in samples])
    assert batch.input_ids.dtype == torch.int64
    np.testing.assert_array_equal(batch.input_ids.numpy(), ids)
    np.testing.assert_array_equal(batch.loss_mask.numpy().astype(np.uint8), mask)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return build_cache(tmp_path_factory.mktemp("bf16") / "cache")


@pytest.fixture(scope="module")
def truth(cache):
    return Truth(cache)


def _loader(cache, **kw):
    kw.setdefault("token_budget", 600)
    kw.setdefault("device", CPU)
    return CacheLoader(cache, **kw)


def test_sample_table_and_open_units(cache, truth):
    readers, problems = open_units(cache)
    assert problems == [] and sorted(readers) == [0, 1, 2, 3]
    table = SampleTable.from_units(readers)
    assert len(table) == 60 == len(truth.where)
    for i in range(len(table)):
        u, a, b = truth.where[int(table.sample_index[i])]
        assert (table.unit[i], table.start[i], table.length[i]) == (u, a, b - a)
    # A follower can open only new units and rebuild the table over the larger dict.
    some, _ = open_units(cache, only=[0, 2])
    assert sorted(some) == [0, 2]
    assert len(SampleTable.from_units({**some, **{3: readers[3]}})) == 45


def test_one_epoch_yields_every_sample_once_with_the_right_values(cache, truth):
    with _loader(cache, seed=3) as loader:
        batches = list(loader.epoch(0))
        assert len(batches) == loader.num_batches(0) > 10
        seen = np.concatenate([b.sample_index.numpy() for b in batches])
        assert sorted(seen.tolist()) == sorted(truth.where)
        for b in batches:
            check_batch(b, truth)
        assert loader.wait_seconds > 0
        assert loader.dropped == []


def test_a_unit_filter_keeps_units_out(cache, truth):
    """Validation holds units out of training: a filtered loader opens, indexes and streams only the
    units it keeps, also in a follow window (one of held-out units only is empty)."""
    with _loader(cache, seed=3, units=lambda u: u != 2) as loader:
        assert sorted(loader.units.readers) == [0, 1, 3]
        seen = sorted(int(s) for b in loader.epoch(0) for s in b.sample_index)
        assert seen == sorted(s for s, (u, _, _) in truth.where.items() if u != 2)
        assert len(loader.units.window((2,))) == 0 and 2 not in loader.units.readers
        assert loader.complete  # completeness is about the whole plan


def test_long_samples_are_read_in_pieces_by_several_readers(cache, truth):
    """A sample is cut along chunk multiples into reader tasks, and the pieces put together equal
    the sample: the batches are those of an uncut read."""
    for start, stop, piece in ((0, 1, 4), (3, 40, 8), (8, 16, 8), (5, 6, 64), (0, 300, 64)):
        pieces = stream_mod._pieces(start, stop, piece)
        assert pieces[0][0] == start and pieces[-1][1] == stop
        assert all(a < b and b == c for (a, b), (c, _) in zip(pieces, pieces[1:], strict=False))
        assert all(b % piece == 0 for _, b in pieces[:-1])  # never a chunk split between two tasks
    with _loader(cache, seed=3, readers=3) as loader:
        loader.stream.piece_rows = 7
        tasks = []
        submit = loader.stream._pool.submit
        loader.stream._pool.submit = lambda fn, *a: tasks.append(a) or submit(fn, *a)
        for b in loader.epoch(0):
            check_batch(b, truth)
        assert len(tasks) > 2 * len(truth.where)  # samples up to 300 tokens, 7 rows a task


def test_layer_subset_selects_the_right_columns(cache, truth):
    with _loader(cache, layer_ids=[1, 5]) as loader:
        for b in loader.epoch(1):
            check_batch(b, truth, layers=[1, 5])
    with _loader(cache, layer_ids=[3]) as loader:
        check_batch(next(iter(loader.epoch(0))), truth, layers=[3])
    with pytest.raises(SpecError, match="layers"):
        _loader(cache, layer_ids=[5, 1])
    with pytest.raises(SpecError, match="layers"):
        _loader(cache, layer_ids=[2])


def test_fp8_batches_are_dequantised(tmp_path):
    cache = build_cache(tmp_path / "fp8", dtype="fp8", units=2, per_unit=8, seed=5)
    truth = Truth(cache)
    for layers in (LAYERS, [3, 5]):
        with _loader(cache, layer_ids=layers, token_budget=500) as loader:
            batches = list(loader.epoch(0))
            assert sorted(int(s) for b in batches for s in b.sample_index) == sorted(truth.where)
            for b in batches:
                check_batch(b, truth, layers=layers, fp8=True)


def test_budget_buckets_and_determinism(cache):
    table = SampleTable.from_units(open_units(cache)[0])
    kw = dict(seed=7, token_budget=600, bucket_edges=EDGES, world_size=1)
    e0 = epoch_batches(table, epoch=0, **kw)[0]
    for b in e0:
        lengths = table.length[b]
        assert lengths.sum() <= 600 or len(b) == 1
        assert len(set(np.searchsorted(EDGES, lengths, side="left").tolist())) == 1
    assert sorted(np.concatenate(e0).tolist()) == list(range(len(table)))
    again = epoch_batches(table, epoch=0, **kw)[0]
    assert all(np.array_equal(a, b) for a, b in zip(e0, again, strict=True))
    e1 = epoch_batches(table, epoch=1, **kw)[0]
    assert [a.tolist() for a in e0] != [b.tolist() for b in e1]
    other_seed = epoch_batches(table, epoch=0, **{**kw, "seed": 8})[0]
    assert [a.tolist() for a in e0] != [b.tolist() for b in other_seed]
    # Lengths mix across batches: consecutive batches do not walk the buckets in order.
    firsts = [int(np.searchsorted(EDGES, table.length[b[0]])) for b in e0]
    assert firsts != sorted(firsts)
    # A sample longer than the budget gets a batch of its own.
    small = epoch_batches(table, epoch=0, seed=7, token_budget=50, bucket_edges=EDGES, world_size=1)[0]
    for b in small:
        assert len(b) == 1 or table.length[b].sum() <= 50
    assert any(len(b) == 1 and table.length[b[0]] > 50 for b in small)
    # The loader follows the same plan, batch for batch.
    with _loader(cache, seed=7) as loader:
        got = [b.sample_index.tolist() for b in loader.epoch(0)]
        assert got == [table.sample_index[b].tolist() for b in e0]
        assert [b.sample_index.tolist() for b in loader.epoch(0)] == got
        assert [b.sample_index.tolist() for b in loader.epoch(1)] != got


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_equal_counts_of_disjoint_samples(cache, truth, world_size):
    table = SampleTable.from_units(open_units(cache)[0])
    everyone = epoch_batches(table, epoch=2, seed=1, token_budget=600, bucket_edges=EDGES, world_size=1)[0]
    per_rank = []
    for rank in range(world_size):
        with _loader(cache, seed=1, rank=rank, world_size=world_size) as loader:
            batches = list(loader.epoch(2))
            assert len(batches) == loader.num_batches(2)
            for b in batches[:3]:
                check_batch(b, truth)
                assert b.num_tokens <= 600 or len(b.sample_index) == 1
            per_rank.append([s for b in batches for s in b.sample_index.tolist()])
            counts = len(batches)
        assert counts == -(-len(everyone) // world_size)  # leftover batches are split, not dropped
    flat = [s for r in per_rank for s in r]
    assert sorted(flat) == sorted(truth.where)  # every sample once, across the ranks
    # Over many epochs: equal counts, budgets kept, and never more than W - 1 samples unused.
    for epoch in range(100):
        plan = epoch_batches(table, epoch=epoch, seed=1, token_budget=600, bucket_edges=EDGES, world_size=world_size)
        assert len({len(r) for r in plan}) == 1
        used = [int(i) for r in plan for b in r for i in b]
        assert len(used) == len(set(used)) >= len(table) - (world_size - 1)
        assert all(table.length[b].sum() <= 600 or len(b) == 1 for r in plan for b in r)


def test_start_batch_resumes_exactly(cache):
    with _loader(cache, seed=2) as loader:
        full = [(b.sample_index.tolist(), b.context.clone()) for b in loader.epoch(4)]
        k = 5
        tail = list(loader.epoch(4, start_batch=k))
        assert len(tail) == len(full) - k
        for (samples, ctx), b in zip(full[k:], tail, strict=True):
            assert b.sample_index.tolist() == samples
            assert torch.equal(b.context.view(torch.int16), ctx.view(torch.int16))
        assert list(loader.epoch(4, start_batch=len(full))) == []
        with pytest.raises(ValueError):
            loader.epoch(4, start_batch=len(full) + 1)


def test_order_is_kept_when_readers_finish_out_of_order(cache, truth, monkeypatch):
    with _loader(cache, seed=9) as loader:
        expected = [b.sample_index.tolist() for b in loader.epoch(0)]
    original = UnitReader.read_into
    rng = random.Random(0)

    def slow_read_into(self, key, start, stop, out):
        time.sleep(rng.random() * 0.003)
        original(self, key, start, stop, out)

    monkeypatch.setattr(UnitReader, "read_into", slow_read_into)
    with _loader(cache, seed=9, readers=6, prefetch=3) as loader:
        got = list(loader.epoch(0))
    assert [b.sample_index.tolist() for b in got] == expected
    for b in got:
        check_batch(b, truth)


def _hidden_shard(unit_dir):
    return unit_dir / "hidden" / "c" / "0" / "0"


def test_corrupt_chunk_raises_naming_the_unit(tmp_path):
    cache = build_cache(tmp_path / "c", units=3, per_unit=10, seed=11)
    shard = _hidden_shard(committed_units(cache)[1])
    data = bytearray(shard.read_bytes())
    for i in range(100, 140):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    with _loader(cache) as loader:  # sizes still match the manifest: only a decode can tell
        with pytest.raises(CorruptUnit, match="u000001"):
            for _ in loader.epoch(0):
                pass


def test_truncated_unit_refused_or_skipped(tmp_path):
    cache = build_cache(tmp_path / "t", units=3, per_unit=10, seed=12)
    shard = _hidden_shard(committed_units(cache)[2])
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(CorruptUnit, match="u000002"):
        _loader(cache)
    with pytest.raises(CorruptUnit, match="u000002"):
        open_units(cache)
    with _loader(cache, skip_bad_units=True) as loader:
        assert len(loader.dropped) == 1
        assert "u000002" in loader.dropped[0] and "10 samples dropped" in loader.dropped[0]
        seen = [s for b in loader.epoch(0) for s in b.sample_index.tolist()]
    kept = {int(s) for u in (0, 1) for s in UnitReader(committed_units(cache)[u]).sample_index}
    assert sorted(seen) == sorted(kept)


def test_host_memory_is_bounded_by_the_slots(tmp_path, truth, cache):
    with _loader(cache, token_budget=200, prefetch=2, readers=3) as loader:
        # Watch the slots: one is never handed to the readers again before its batch was copied out.
        owned, handed = set(), []
        submit, copy = loader.stream._submit_reads, loader.stream._copy_to_device

        def watched_submit(rows, slot):
            assert slot.index not in owned
            owned.add(slot.index)
            handed.append(slot.index)
            return submit(rows, slot)

        def watched_copy(job):
            staged = copy(job)
            owned.remove(job.slot.index)
            return staged

        loader.stream._submit_reads, loader.stream._copy_to_device = watched_submit, watched_copy
        n = 0
        for b in loader.epoch(0):
            check_batch(b, truth)
            n += 1
        assert n >= 30 and len(handed) == n
        assert len(loader.host_slots) == 3 and set(handed) == {0, 1, 2}
        assert 2 <= loader.peak_slots_in_use <= 3
    with _loader(cache, token_budget=600, prefetch=2) as small:
        small_bytes = small.host_bytes
    # A cache ten times larger (same longest sample) holds the same host memory over a whole epoch.
    big = build_cache(tmp_path / "big", units=4, per_unit=150, seed=13, max_len=300)
    with _loader(big, token_budget=600, prefetch=2, readers=3) as loader:
        assert loader.slot_rows == 600 and loader.host_bytes == small_bytes
        assert loader.num_batches(0) >= 100
        assert sum(1 for _ in loader.epoch(0)) == loader.num_batches(0)
        assert len(loader.host_slots) == 3 and loader.peak_slots_in_use <= 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_path_matches_cpu_with_bounded_device_memory(tmp_path, dtype):
    """The GPU check: pinned slots, side-stream copies behind events, a busy consumer stream."""
    cache = build_cache(tmp_path / dtype, dtype=dtype, units=4, per_unit=40, seed=21)
    cuda = torch.device("cuda", torch.cuda.current_device())
    with _loader(cache, seed=4, token_budget=600) as cpu_loader:
        expected = [(b.sample_index.tolist(), b.context.float()) for b in cpu_loader.epoch(0)]
    busy = torch.randn(512, 512, device=cuda)
    busy = torch.tanh(busy @ busy)  # cuBLAS workspace allocated before the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(cuda)  # busy included
    with _loader(cache, seed=4, token_budget=600, device=cuda, layer_ids=LAYERS) as loader:
        assert all(s.hidden.is_pinned() for s in loader.host_slots)
        row_bytes = K * H * 10 + 4 * K + 32  # every device tensor of a batch, temporaries included
        peak, got = 0, []
        for b in loader.epoch(0):
            for _ in range(20):  # keep the consumer's stream busy while the next copy runs
                busy = torch.tanh(busy @ busy)
            assert b.context.device == cuda and b.input_ids.device == cuda
            got.append((b.sample_index.tolist(), b.context.float().cpu()))
            peak = max(peak, torch.cuda.memory_allocated(cuda) - base)
        # The loader's two batches, the consumer's previous one still bound to `b`, and slack;
        # a batch leaked per step would blow this within the epoch.
        assert peak <= 4 * loader.slot_rows * row_bytes
        assert len(got) == len(expected) > 10
        for (s_exp, c_exp), (s_got, c_got) in zip(expected, got, strict=True):
            assert s_exp == s_got
            assert torch.equal(c_exp.view(torch.int16), c_got.view(torch.int16))  # random bits hold NaNs
