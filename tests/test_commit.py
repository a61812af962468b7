"""Unit writer processes (commit.py): units committed from shared buffers read back exactly, and a
writer that fails or dies is an error in the extract process, never a hang."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_cache.cache.spec import StorageInfo
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.layout import RowFormat, chunk_tokens_for
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.extract.commit import WRITER_NICENESS, BufferLayout, Committer, SharedBuffers

ROWS, WIDTH = 300, 64


def _storage() -> StorageInfo:
    return StorageInfo(dtype="bf16", codec={"name": "zstd", "level": 3, "checksum": True},
                       chunk_tokens=chunk_tokens_for(WIDTH * 2))  # fmt: skip


def _commit(committer: Committer, shared: SharedBuffers, unit: int, hidden: np.ndarray) -> None:
    index = committer.take()
    shared.arrays[index]["hidden"][: len(hidden)] = hidden
    n = len(hidden)
    committer.commit(index, unit, n, np.array([0, n // 2, n]), np.array([2 * unit, 2 * unit + 1]),
                     np.arange(n, dtype=np.int32), np.ones(n, np.uint8))  # fmt: skip


def test_units_from_shared_buffers_read_back_exactly(tmp_path):
    shared = SharedBuffers(BufferLayout(count=3, rows=ROWS, row=RowFormat("bf16", WIDTH, 1)))
    reports = []
    committer = Committer(tmp_path, _storage(), shared, 2, reports.append, niceness=WRITER_NICENESS)
    # the writers yield the cores to this process (as to one that feeds a GPU), once started
    niceness, deadline = {min(19, os.nice(0) + WRITER_NICENESS)}, time.monotonic() + 60
    while {os.getpriority(os.PRIO_PROCESS, p.pid) for p in committer._procs} != niceness:
        assert time.monotonic() < deadline, "the writers kept the extract process's priority"
        time.sleep(0.05)
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
    shared = SharedBuffers(BufferLayout(count=2, rows=ROWS, row=RowFormat("bf16", WIDTH, 1)))
    committer = Committer(out, _storage(), shared, 1, lambda _: None)
    _commit(committer, shared, 0, np.zeros((10, WIDTH), np.int16))
    with pytest.raises(RuntimeError, match="failed in a writer process"):
        committer.close()


def test_a_dead_writer_is_an_error_not_a_hang(tmp_path: Path):
    shared = SharedBuffers(BufferLayout(count=2, rows=ROWS, row=RowFormat("bf16", WIDTH, 1)))
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


def test_buffers_are_prepared_once_each_before_use(tmp_path):
    """extract pins buffers in `prepare`, in the background: a buffer is never handed out before
    its turn has finished, each is prepared once, and the wait for it is counted."""
    shared = SharedBuffers(BufferLayout(count=3, rows=ROWS, row=RowFormat("bf16", WIDTH, 1)))
    prepared: list[int] = []

    def prepare(i: int) -> None:
        time.sleep(0.3)
        prepared.append(i)

    committer = Committer(tmp_path, _storage(), shared, 1, lambda _: None, prepare=prepare)
    seen = []
    for unit in range(5):
        index = committer.take()
        assert index in prepared, "a buffer handed out before it was prepared"
        seen.append(index)
        shared.arrays[index]["hidden"][:4] = unit
        committer.commit(index, unit, 4, np.array([0, 4]), np.array([unit]), np.zeros(4, np.int32),
                         np.ones(4, np.uint8))  # fmt: skip
    committer.close()
    # in order, once each; a buffer whose turn had not come when the run ended is never prepared
    assert prepared == list(range(len(prepared))) and set(seen) <= set(prepared)
    assert committer.wait_s >= 0.25  # at least the first buffer's preparation
    assert sorted(committed_units(tmp_path)) == list(range(5))


def test_a_failing_prepare_is_an_error(tmp_path):
    shared = SharedBuffers(BufferLayout(count=2, rows=ROWS, row=RowFormat("bf16", WIDTH, 1)))

    def prepare(i: int) -> None:
        raise OSError("cannot lock memory")

    committer = Committer(tmp_path, _storage(), shared, 1, lambda _: None, prepare=prepare)
    t = time.monotonic()
    with pytest.raises(OSError, match="cannot lock memory"):
        committer.take()  # not a wait for a buffer that never comes
    assert time.monotonic() - t < 5
    committer.close(check=False)
