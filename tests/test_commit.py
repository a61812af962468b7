"""Unit writer processes (commit.py): units committed from shared buffers read back exactly, and a
writer that fails or dies is an error in the extract process, never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from dflash_cache.commit import BufferLayout, Committer, SharedBuffers
from dflash_cache.spec import StorageInfo
from dflash_cache.store import UnitReader, chunk_tokens_for, committed_units

ROWS, WIDTH = 300, 64


def _storage() -> StorageInfo:
    return StorageInfo(dtype="bf16", codec={"name": "zstd", "level": 3, "checksum": True},
                       chunk_tokens=chunk_tokens_for(WIDTH * 2))  # fmt: skip


def _commit(committer: Committer, shared: SharedBuffers, unit: int, hidden: np.ndarray) -> None:
    index = committer.take()
    shared.arrays[index][0][: len(hidden)] = hidden
    n = len(hidden)
    committer.commit(index, unit, n, np.array([0, n // 2, n]), np.array([2 * unit, 2 * unit + 1]),
                     np.arange(n, dtype=np.int32), np.ones(n, np.uint8))  # fmt: skip


def test_units_from_shared_buffers_read_back_exactly(tmp_path):
    shared = SharedBuffers(BufferLayout(count=3, rows=ROWS, width=WIDTH, layers=1, fp8=False))
    reports = []
    committer = Committer(tmp_path, _storage(), shared, 2, reports.append)
    rng = np.random.default_rng(0)
    data = {u: rng.integers(-(2**15), 2**15, size=(ROWS - u, WIDTH), dtype=np.int16) for u in range(6)}
    for u, hidden in data.items():  # six units through three buffers: every buffer is reused
        _commit(committer, shared, u, hidden)
    committer.close()
    assert sorted(committed_units(tmp_path)) == list(range(6))
    assert sum(r["units"] for r in reports) == 6 and all(r["bytes"] > 0 for r in reports)
    for u, hidden in data.items():
        reader = UnitReader(committed_units(tmp_path)[u])
        np.testing.assert_array_equal(reader.read("hidden", 0, len(hidden)), hidden.view(np.uint16))
        assert reader.sample_index.tolist() == [2 * u, 2 * u + 1]


def test_a_failing_writer_is_an_error(tmp_path):
    out = tmp_path / "out"
    out.write_text("a file where the cache directory should be")
    shared = SharedBuffers(BufferLayout(count=2, rows=ROWS, width=WIDTH, layers=1, fp8=False))
    committer = Committer(out, _storage(), shared, 1, lambda _: None)
    _commit(committer, shared, 0, np.zeros((10, WIDTH), np.int16))
    with pytest.raises(RuntimeError, match="failed in a writer process"):
        committer.close()


def test_a_dead_writer_is_an_error_not_a_hang(tmp_path: Path):
    shared = SharedBuffers(BufferLayout(count=2, rows=ROWS, width=WIDTH, layers=1, fp8=False))
    committer = Committer(tmp_path, _storage(), shared, 1, lambda _: None)
    _commit(committer, shared, 0, np.zeros((10, WIDTH), np.int16))
    committer._procs[0].kill()  # as the OOM killer would, perhaps in the middle of that unit
    committer._procs[0].join()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        for unit in range(1, 4):  # the buffers run out unless the dead writer is noticed
            _commit(committer, shared, unit, np.zeros((10, WIDTH), np.int16))
    assert time.monotonic() - t < 10
    committer.close(check=False)
