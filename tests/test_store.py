import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_loader import build_cache

from dflash_cache.cache.audit import verify
from dflash_cache.cache.spec import StorageInfo
from dflash_cache.cache.store import PARTIAL, committed_units, sweep_partial, write_unit
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.cache.unit.read import CorruptUnit, UnitReader
from dflash_cache.cache.unit.shard import ShardRows
from dflash_cache.cache.unit.verify import verify_unit
from dflash_cache.cache.unit.write import UnitArrays

STORAGE = StorageInfo(dtype="bf16", codec={"name": "zstd", "level": 3, "checksum": True}, chunk_tokens=64)


def _arrays(rng, lengths, width=32):
    n = int(sum(lengths))
    return UnitArrays(
        hidden=rng.integers(0, 2**16, size=(n, width), dtype=np.uint16),
        input_ids=rng.integers(0, 1000, size=n).astype(np.int32),
        loss_mask=rng.integers(0, 2, size=n).astype(np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        sample_index=np.arange(len(lengths), dtype=np.int64) * 7,
    )


def test_round_trip_and_partial_reads(tmp_path):
    rng = np.random.default_rng(0)
    a = _arrays(rng, [100, 37, 250])
    assert write_unit(tmp_path, 3, a, STORAGE) > 0
    assert list(committed_units(tmp_path)) == [3]
    assert not any((tmp_path / PARTIAL).iterdir())
    r = UnitReader(committed_units(tmp_path)[3])
    assert (r.n_samples, r.n_tokens) == (3, 387)
    np.testing.assert_array_equal(r.offsets, a.offsets)
    np.testing.assert_array_equal(r.sample_index, a.sample_index)
    np.testing.assert_array_equal(r.read("hidden", 100, 137), a.hidden[100:137])
    out = np.zeros((250, 32), dtype=np.uint16)
    r.read_into("hidden", 137, 387, out)
    np.testing.assert_array_equal(out, a.hidden[137:])
    np.testing.assert_array_equal(r.read("input_ids", 0, 387), a.input_ids)
    assert verify_unit(r.path, RowFormat("bf16", 32, 1)) == []


def test_shard_reader_equals_zarr(tmp_path):
    """The loader's zarr-free reader (ShardRows) against zarr's own decode of the same arrays: every
    token-wise array, ranges inside, across and at the ends of chunks, a chunk zarr never stored
    (all zeros), fp8 bits and scales; and a flipped byte in the shard index is refused."""
    import zarr

    rng = np.random.default_rng(5)
    a = _arrays(rng, [100, 37, 250, 190])  # 577 rows, chunks of 64
    a.hidden[128:192] = 0  # one whole chunk of fill values: zarr does not store it
    a.hidden_scale = rng.random((577, 2), dtype=np.float32) + 0.5
    a.hidden = a.hidden.view(np.uint8)[:, :32]  # fp8 bits, K=2 layers of 16
    fp8 = StorageInfo(dtype="fp8", codec=STORAGE.codec, chunk_tokens=64)
    write_unit(tmp_path, 0, a, fp8)
    r = UnitReader(committed_units(tmp_path)[0])
    assert ShardRows.open(r.path / "hidden").offset[2] == (1 << 64) - 1
    for key in ("hidden", "hidden_scale", "input_ids", "loss_mask"):
        assert r._shard(key) is not None, key
        for start, stop in [(0, 577), (0, 1), (63, 65), (64, 128), (100, 300), (128, 192), (500, 577), (576, 577)]:
            want = zarr.open_array(zarr.storage.LocalStore(r.path), path=key, mode="r")[start:stop]
            got = np.full_like(want, 7)
            r.read_into(key, start, stop, got)
            np.testing.assert_array_equal(got, want, err_msg=f"{key}[{start}:{stop}]")
    shard = _shard(r.path)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01  # inside the index, before its crc32c
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptUnit, match="crc32c"):
        UnitReader(r.path).read("hidden", 0, 10)


def test_shard_writer_writes_zarrs_own_bytes(tmp_path):
    """write_shard (chunks compressed on several cores, outside zarr) against zarr's own write of
    the same array with the same codecs: the shard files are equal byte for byte, for every dtype a
    unit holds, with a chunk of fill values that neither stores and a last chunk cut short."""
    import zarr
    from numcodecs import Zstd
    from zarr.codecs import BytesCodec, ZstdCodec

    from dflash_cache.cache.unit.shard import write_shard

    rng = np.random.default_rng(3)
    cases = [rng.integers(0, 2**16, size=(577, 24), dtype=np.uint16),  # bf16 bits
             rng.integers(0, 256, size=(577, 32), dtype=np.uint8),  # fp8 bits
             rng.random((577, 2), dtype=np.float32) + 0.5,  # fp8 scales
             rng.integers(0, 50_000, size=577).astype(np.int32), rng.integers(0, 2, size=577).astype(np.uint8),
             rng.integers(1, 9, size=(40, 3), dtype=np.uint16)]  # fmt: skip
    for i, data in enumerate(cases):
        data[128:192] = 0
        files = []
        for how in ("zarr", "write_shard"):
            group = zarr.open_group(zarr.storage.LocalStore(tmp_path / how / str(i)), mode="w-", zarr_format=3)
            arr = group.create_array("a", shape=data.shape, dtype=data.dtype, chunks=(64, *data.shape[1:]),
                                     shards=(-(-len(data) // 64) * 64, *data.shape[1:]), serializer=BytesCodec(),
                                     compressors=ZstdCodec(level=3, checksum=True), filters=())  # fmt: skip
            if how == "zarr":
                arr[...] = data
            else:
                write_shard(tmp_path / how / str(i) / "a", data, 64, arr.fill_value, Zstd(level=3, checksum=True))
            files.append(_shard(tmp_path / how / str(i), "a").read_bytes())
        assert files[0] == files[1], (i, data.dtype, data.shape)
        read = zarr.open_array(zarr.storage.LocalStore(tmp_path / "write_shard" / str(i)), path="a", mode="r")[...]
        np.testing.assert_array_equal(read, data)


def test_second_writer_of_a_unit_is_discarded(tmp_path):
    rng = np.random.default_rng(1)
    write_unit(tmp_path, 0, _arrays(rng, [10, 20]), STORAGE)
    first = UnitReader(committed_units(tmp_path)[0]).read("hidden", 0, 30)
    assert write_unit(tmp_path, 0, _arrays(rng, [10, 20]), STORAGE) == 0
    np.testing.assert_array_equal(UnitReader(committed_units(tmp_path)[0]).read("hidden", 0, 30), first)
    assert not any((tmp_path / PARTIAL).iterdir())


def _shard(unit_dir, key="hidden"):
    """A token-wise array's one shard file (`c/0` for a 1-D array, `c/0/0` for a 2-D one)."""
    array = unit_dir / key
    return next(p for p in (array / "c" / "0" / "0", array / "c" / "0") if p.is_file())


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_array", "delete_meta"])
def test_damage_is_named(tmp_path, damage):
    rng = np.random.default_rng(2)
    write_unit(tmp_path, 1, _arrays(rng, [300, 300]), STORAGE)
    unit = committed_units(tmp_path)[1]
    shard = _shard(unit)
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        for i in range(100, 120):
            data[i] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete_array":
        shutil.rmtree(unit / "hidden")
    else:
        (unit / "zarr.json").unlink()
    problems = verify_unit(unit, RowFormat("bf16", 32, 1))
    assert problems, damage
    if damage != "flip":
        with pytest.raises(CorruptUnit, match="u000001"):
            UnitReader(unit).read("hidden", 0, 600)
    else:
        with pytest.raises(CorruptUnit, match="does not decode"):
            UnitReader(unit).read("hidden", 0, 600)


def test_sweep_removes_only_dead_writers(tmp_path):
    import socket

    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / PARTIAL / f"u000001.{host}.{dead.stdout.strip()}.abc").mkdir(parents=True)
    (tmp_path / PARTIAL / f"u000002.{host}.{os.getpid()}.abc").mkdir()
    (tmp_path / PARTIAL / "u000003.otherhost.1.abc").mkdir()
    assert sweep_partial(tmp_path) == 1
    assert sorted(p.name.split(".")[0] for p in (tmp_path / PARTIAL).iterdir()) == ["u000002", "u000003"]


def test_heartbeat_is_fresh_while_it_beats_and_gone_after(tmp_path):
    """The rule a trainer applies (heartbeat.py): a fresh beat from another host, or from a live
    process of this one, means the cache is being written; a stale one, or a dead local pid, not."""
    import json
    import socket
    import time

    from dflash_cache.cache.heartbeat import HEARTBEAT, STALE, beating, live_beat

    def written() -> float:
        return json.loads((tmp_path / HEARTBEAT).read_text())["time"]

    with beating(tmp_path, interval=0.05):
        first = written()
        deadline = time.monotonic() + 60
        while (second := written()) <= first:  # rewritten, however long a loaded disk takes to sync it
            assert time.monotonic() < deadline, "the heartbeat was not rewritten"
            time.sleep(0.05)
        beat = live_beat(tmp_path)
        assert beat is not None and (beat.host, beat.pid) == (socket.gethostname(), os.getpid())
        assert 0 <= beat.age <= time.time() - second  # the age of the latest beat, not of the first
    assert not (tmp_path / HEARTBEAT).exists() and live_beat(tmp_path) is None  # an ended extract is no writer

    def write(host: str, pid: int, age: float) -> None:
        (tmp_path / HEARTBEAT).write_text(json.dumps({"host": host, "pid": pid, "time": time.time() - age}))

    write("other-node", 1, 5.0)
    assert live_beat(tmp_path).host == "other-node"  # another host's pid is not ours to check
    write("other-node", 1, STALE + 1)
    assert live_beat(tmp_path) is None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write(socket.gethostname(), int(dead.stdout), 1.0)
    assert live_beat(tmp_path) is None  # fresh, but its process on this host is gone
    (tmp_path / HEARTBEAT).write_text("{not json")
    assert live_beat(tmp_path) is None


def test_verify_fails_an_incomplete_cache_unless_asked_for_present_units(tmp_path):
    """A cache missing a planned unit would train on part of the data: `dflash verify` names the
    unit and exits 1; `--present-only` checks the committed units alone (a cache still growing)."""
    out = build_cache(tmp_path / "cache")
    shutil.rmtree(committed_units(out)[2])
    assert verify(out) == {"u000002": ["not committed (the plan has 4 units)"]}
    assert verify(out, present_only=True) == {}
    root = Path(__file__).resolve().parents[1]
    run = [sys.executable, "-m", "cli.main", "verify", str(out)]
    full = subprocess.run(run, cwd=root, capture_output=True, text=True)
    assert full.returncode == 1
    assert "u000002: not committed" in full.stderr and full.stderr.strip().splitlines()[-1].startswith("error:")
    present = subprocess.run([*run, "--present-only"], cwd=root, capture_output=True, text=True)
    assert present.returncode == 0 and "all units sound" in present.stderr
