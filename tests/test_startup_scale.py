"""Start-up that does not grow with Zarr work per unit: units open from their manifests alone.

Every Zarr read goes through `LocalStore`; counting its reads shows what opening a cache costs
without timing anything. Independent truth comes from decoding the arrays with zarr directly.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from test_loader import H, K, Truth, _hidden_shard, _loader, build_cache, check_batch
from zarr.storage import LocalStore

from dflash_cache.cache.audit import info, verify
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.cache.unit.manifest import index_crc
from dflash_cache.cache.unit.read import CorruptUnit, UnitReader
from dflash_cache.cache.unit.verify import verify_unit
from dflash_cache.train.batching import SampleTable
from dflash_cache.train.index import open_units

UNITS, PER_UNIT = 12, 6


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return build_cache(tmp_path_factory.mktemp("scale") / "cache", units=UNITS, per_unit=PER_UNIT, seed=5, max_len=120)


@pytest.fixture
def zarr_reads(monkeypatch):
    """Every key zarr reads from a unit, as (unit name, key), in order."""
    reads: list[tuple[str, str]] = []
    get, partial = LocalStore.get, LocalStore.get_partial_values

    async def counted_get(self, key, *args, **kwargs):
        reads.append((Path(self.root).name, key))
        return await get(self, key, *args, **kwargs)

    async def counted_partial(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        reads.extend((Path(self.root).name, k) for k, _ in key_ranges)
        return await partial(self, prototype, key_ranges)

    monkeypatch.setattr(LocalStore, "get", counted_get)
    monkeypatch.setattr(LocalStore, "get_partial_values", counted_partial)
    return reads


def _decoded(unit: Path, key: str) -> np.ndarray:
    """An array of a unit, decoded by zarr itself (not through UnitReader)."""
    return zarr.open_array(LocalStore(unit, read_only=True), path=key, mode="r")[...]


def _where(cache: Path) -> dict[int, tuple[int, int, int]]:
    """sample -> (unit, first row, length), from each unit's arrays decoded by zarr."""
    where = {}
    for u, path in committed_units(cache).items():
        offsets, rows = _decoded(path, "offsets"), _decoded(path, "sample_index")
        where.update({int(s): (u, int(offsets[i]), int(offsets[i + 1] - offsets[i])) for i, s in enumerate(rows)})
    return where


def _opened(reads: list[tuple[str, str]]) -> list[int]:
    """Units whose arrays zarr opened, once per opening."""
    return [int(name[1:]) for name, key in reads if key == "hidden/zarr.json"]


def _manifest(unit: Path) -> dict:
    return json.loads((unit / "zarr.json").read_text())


def _rewrite(unit: Path, edit) -> None:
    meta = _manifest(unit)
    edit(meta["attributes"]["dflash_unit"])
    (unit / "zarr.json").write_text(json.dumps(meta, indent=2))


def _copy(cache, tmp_path) -> Path:
    return Path(shutil.copytree(cache, tmp_path / "copy"))


def test_opening_reads_no_zarr_until_a_batch_needs_a_unit(cache, zarr_reads):
    with _loader(cache, token_budget=200, prefetch=0, readers=3) as loader:
        facts = info(cache)
        assert zarr_reads == []  # loader, table and info: manifests only
        assert facts["samples"] == len(loader.table) == UNITS * PER_UNIT
        assert facts["bytes_on_disk"] == sum(f.stat().st_size for f in (cache / "units").rglob("*") if f.is_file())
        # The table is the arrays' own offsets and sample_index, decoded independently.
        where = _where(cache)
        zarr_reads.clear()
        t = loader.table
        got = {int(t.sample_index[i]): (int(t.unit[i]), int(t.start[i]), int(t.length[i])) for i in range(len(t))}
        assert got == where

        batches = list(loader.epoch(0))
        opened = _opened(zarr_reads)
        assert sorted(opened) == list(range(UNITS))  # each unit's arrays opened once, 3 readers racing
        seen = [s for b in batches for s in b.sample_index.tolist()]
        assert sorted(seen) == sorted(where)  # every sample once in the epoch


def test_first_batch_opens_only_its_units(cache, zarr_reads):
    with _loader(cache, token_budget=120, prefetch=0, readers=2) as loader:
        it = loader.epoch(0)
        first = next(it)
        opened = set(_opened(zarr_reads))
        second = next(it)
        it.close()
    where = _where(cache)
    owners = [{where[int(s)][0] for s in b.sample_index} for b in (first, second)]
    # prefetch 0: the second batch's reads may start once the first is copied out of the one slot
    assert owners[0] <= opened <= owners[0] | owners[1] and len(opened) < UNITS
    check_batch(first, Truth(cache))


def test_truncated_unit_is_named_before_any_decode(cache, tmp_path, zarr_reads):
    copy = _copy(cache, tmp_path)
    shard = _hidden_shard(committed_units(copy)[7])
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(CorruptUnit, match="u000007: hidden/c/0/0 has"):
        _loader(copy)
    assert info(copy)["unreadable_units"] == [f"u000007: hidden/c/0/0 has {shard.stat().st_size} bytes, manifest "
                                              f"says {shard.stat().st_size + 1}"]  # fmt: skip
    assert zarr_reads == []  # named from the manifest and a stat, nothing decoded
    with _loader(copy, skip_bad_units=True) as loader:
        assert len(loader.dropped) == 1 and f"{PER_UNIT} samples dropped" in loader.dropped[0]
        assert 7 not in set(loader.table.unit.tolist()) and len(loader.table) == (UNITS - 1) * PER_UNIT


def test_array_shapes_are_checked_when_a_unit_first_opens(cache, tmp_path, zarr_reads):
    """A unit whose hidden array disagrees with cache.json (its metadata the same size, so the
    manifest cannot tell) is refused when its arrays open, before any of its chunks is read."""
    copy = _copy(cache, tmp_path)
    meta = copy / "units" / "u000004" / "hidden" / "zarr.json"
    text = meta.read_text()
    assert '"data_type": "uint16"' in text
    meta.write_text(text.replace('"data_type": "uint16"', '"data_type":  "int16"'))
    with _loader(copy) as loader:
        with pytest.raises(CorruptUnit, match=r"u000004: hidden is int16\(\d+, 24\), expected uint16"):
            for _ in loader.epoch(0):
                pass
    assert not [k for n, k in zarr_reads if n == "u000004" and "/c/" in k]  # no chunk of it was read
    with _loader(copy, skip_bad_units=True) as loader:  # skipping checks the shapes up front
        assert len(loader.dropped) == 1 and "u000004: hidden is int16" in loader.dropped[0]
        assert len(list(loader.epoch(0))) > 0


def test_manifest_index_is_checked(cache, tmp_path):
    copy = _copy(cache, tmp_path)
    units = committed_units(copy)

    def flip(m):
        m["index"]["sample_index"][2] += 1

    _rewrite(units[3], flip)  # a changed digit: the crc32 no longer matches
    with pytest.raises(CorruptUnit, match="u000003: manifest index does not match its crc32"):
        UnitReader(units[3])

    def forge(m):  # an index that passes its crc32 but is not the arrays' own
        m["index"]["sample_index"] = m["index"]["sample_index"][::-1]
        m["index"]["crc32"] = index_crc(np.array(m["index"]["offsets"]), np.array(m["index"]["sample_index"]))

    _rewrite(units[5], forge)
    assert verify_unit(units[5], RowFormat("bf16", K * H, K)) == ["sample_index differs from the manifest's index"]
    assert set(verify(copy)) == {"u000003", "u000005"}


def test_units_without_the_index_still_load(cache, tmp_path):
    """Units written before manifests held the index (and a cache mixing both) give the same table."""
    copy = _copy(cache, tmp_path)
    for u, path in committed_units(copy).items():
        if u % 2:
            _rewrite(path, lambda m: m.pop("index"))
    readers, problems = open_units(copy)
    assert problems == [] and [r.indexed for r in readers.values()] == [u % 2 == 0 for u in range(UNITS)]
    new, old = SampleTable.from_units(open_units(cache)[0]), SampleTable.from_units(readers)
    for key in ("unit", "start", "length", "sample_index"):
        np.testing.assert_array_equal(getattr(new, key), getattr(old, key))
    truth = Truth(copy)
    with _loader(copy, token_budget=300) as loader:
        batches = list(loader.epoch(0))
    for b in batches:
        check_batch(b, truth)
    assert sorted(s for b in batches for s in b.sample_index.tolist()) == sorted(truth.where)

