"""Unit commits in writer processes, fed from shared unit buffers.

Compressing and writing a unit holds the GIL for part of every chunk. As threads of the GPU
process the writers serialised on it: on an H200 the commit path, not the disk, held extraction to
0.64-0.80x the bare forward (BENCHMARKS.md). Here each writer is a process of its own, which
compresses a unit's chunks on every core, at a lower priority than a GPU's process. The unit
buffers are one anonymous shared-memory file (memfd) that the extract process maps, and pins on
CUDA hosts, and that every writer maps too. So a unit's hidden states are never copied or pickled
between processes; only its small metadata (ids, mask, offsets) travels through a queue.

A writer dies with the process that started it (Linux parent-death signal, and a check between
jobs), so a killed extract leaves no writer behind; a unit it was writing stays in `.partial/`,
where the next run sweeps it.

This module does not import torch: a writer needs only numpy and zarr.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_cache.cache.spec import StorageInfo
from dflash_cache.cache.store import unit_name, write_unit
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.cache.unit.write import UnitArrays
from dflash_cache.core.errors import ExtractError
from dflash_cache.core.interrupts import held, ready_for_interrupts, starting_children


@dataclass(frozen=True)
class BufferLayout:
    """`count` unit buffers of `rows` tokens in the format `row`, one after another in one shared file."""

    count: int
    rows: int
    row: RowFormat

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one buffer's arrays (storage bits, scales, the final state)."""
        return self.rows * (self.row.hidden_bytes + self.row.scale_bytes + self.row.final_bytes)

    @property
    def stride(self) -> int:
        return -(-self.buffer_bytes // 4096) * 4096  # page-aligned buffers

    @property
    def total(self) -> int:
        return self.count * self.stride

    def views(self, buf) -> list[dict[str, np.ndarray]]:
        """Each buffer's arrays by name (`RowFormat.shapes`: "hidden", and "hidden_scale",
        "final_hidden", "final_scale" where the format has them), one after another in its
        stride: uint8 fp8 bits, or bf16 bits as int16 (what torch can view as bfloat16)."""
        out = []
        for i in range(self.count):
            at, arrays = i * self.stride, {}
            for key, (shape, dtype) in self.row.shapes(self.rows).items():
                n = shape[0] * shape[1]
                arrays[key] = np.frombuffer(buf, np.dtype(dtype), n, at).reshape(shape)
                at += arrays[key].nbytes
            out.append(arrays)
        return out


class SharedBuffers:
    """The unit buffers of one extract process, in an anonymous shared-memory file. The file has
    no name: it disappears with the last process that maps it, whatever way they end."""

    def __init__(self, layout: BufferLayout):
        self.layout = layout
        self.fd = os.memfd_create("dflash-unit-buffers")
        os.ftruncate(self.fd, max(layout.total, 1))
        self.map = mmap.mmap(self.fd, max(layout.total, 1))
        self.arrays = layout.views(self.map)

    @property
    def handle(self) -> tuple[int, int, BufferLayout]:
        """What a writer needs to map the same memory: (pid, fd, layout)."""
        return os.getpid(), self.fd, self.layout


def attach(handle: tuple[int, int, BufferLayout]) -> list[dict[str, np.ndarray]]:
    """Map another process's shared buffers (through its open file descriptor)."""
    pid, fd, layout = handle
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        mapped = mmap.mmap(own, max(layout.total, 1))
    finally:
        os.close(own)
    return layout.views(mapped)


@dataclass(frozen=True)
class _Job:
    index: int  # the buffer
    unit_id: int
    n_tokens: int
    offsets: np.ndarray
    sample_index: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray


class Committer:
    """Writer processes that commit units out of shared buffers, and the threads that feed them.

    `take()` hands out a free buffer, blocking while every buffer is filled or being written: the
    back-pressure that bounds host memory (`wait_s` sums that blocking). `commit()` queues a
    filled buffer; with `ready` (a CUDA event after the copy into it), a feeder thread waits for
    the event first, so the GPU process never blocks on it. `close()` waits for every commit and
    raises the first failure (a full disk is an ExtractError naming the unit; failures also
    surface in the next `take()`).

    `prepare(i)`, if given, runs once per buffer in a background thread before the buffer is
    first handed out (extract pins buffers there, a second per GiB, while the first forward runs).
    `niceness`: the writers' priority below this process's (`WRITER_NICENESS` where it feeds a GPU).
    """

    def __init__(self, out: Path, storage: StorageInfo, buffers: SharedBuffers, writers: int,
                 report: Callable[[dict], None], prepare: Callable[[int], None] | None = None,
                 niceness: int = 0):  # fmt: skip
        self.out = Path(out)
        self.report = report
        self.wait_s = 0.0
        self._free: queue.Queue[int] = queue.Queue()
        self._prepare = prepare
        self._closing = False
        self._count = buffers.layout.count
        ctx = mp.get_context("spawn")
        self._jobs = ctx.Queue()
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_writer_main, args=(buffers.handle, str(out), storage, self._jobs, self._results,
                                                   os.getpid(), niceness), daemon=True,
                        name=f"dflash-writer-{i}")  # fmt: skip
            for i in range(writers)
        ]
        with starting_children():
            for p in self._procs:
                p.start()
        self._feed: queue.Queue[tuple[Any, _Job] | None] = queue.Queue()
        self._in_flight = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._feeder, daemon=True, name="dflash-commit-feed"),
                         threading.Thread(target=self._collector, daemon=True, name="dflash-commit-done")]  # fmt: skip
        self._preparer = threading.Thread(target=self._release, daemon=True, name="dflash-commit-prepare")
        for t in (*self._threads, self._preparer):
            t.start()

    def take(self) -> int:
        start = time.perf_counter()
        try:
            while True:
                self._check()
                try:
                    return self._free.get(timeout=0.5)
                except queue.Empty:
                    continue
        finally:
            self.wait_s += time.perf_counter() - start

    def commit(self, index: int, unit_id: int, n_tokens: int, offsets: np.ndarray, sample_index: np.ndarray,
               input_ids: np.ndarray, loss_mask: np.ndarray, ready: Any = None) -> None:  # fmt: skip
        self._check()
        with self._done:
            self._in_flight += 1
        self._feed.put((ready, _Job(index, unit_id, n_tokens, offsets, sample_index, input_ids, loss_mask)))

    def close(self, check: bool = True) -> None:
        """Wait for every queued commit, stop the writers, and (with `check`) raise the first
        failure. Without `check` (the caller is already failing) queued commits still finish."""
        self._closing = True
        try:
            with self._done:
                while self._in_flight and self._error is None:
                    self._done.wait(0.5)
                    self._check_writers()
        finally:
            with held():  # a Ctrl-C now is answered once the writers and threads are stopped
                self._feed.put(None)
                for _ in self._procs:
                    self._jobs.put(None)
                for p in self._procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
                self._results.put(None)
                self._preparer.join()  # a buffer being prepared (pinned) must be done before its owner frees it
                for t in self._threads:
                    t.join(timeout=5)
        if check:
            self._check()

    # -- internals ----------------------------------------------------------------------------

    def _check(self) -> None:
        self._check_writers()
        if self._error is not None:
            raise self._error

    def _check_writers(self) -> None:
        dead = [p for p in self._procs if p.exitcode is not None and p.exitcode != 0]
        if dead and self._error is None:
            self._error = RuntimeError(f"unit writer process {dead[0].name} died (exit code {dead[0].exitcode})")

    def _release(self) -> None:
        for i in range(self._count):
            if self._closing:
                return
            if self._prepare is not None:
                try:
                    self._prepare(i)
                except BaseException as e:  # noqa: BLE001 - surfaces in take()
                    self._error = self._error or e
                    return
            self._free.put(i)

    def _feeder(self) -> None:
        while (item := self._feed.get()) is not None:
            ready, job = item
            if ready is not None:
                ready.synchronize()  # the copy into the buffer is done; releases the GIL meanwhile
            self._jobs.put(job)

    def _collector(self) -> None:
        while (result := self._results.get()) is not None:
            index, unit_id, written, failure = result
            if failure is None:
                self.report({"bytes": written, "units": 1})
            elif self._error is None:
                kind, text = failure
                if kind == "full":
                    self._error = ExtractError(
                        f"the disk is full: unit {unit_name(unit_id)} could not be written to {self.out} ({text}); "
                        "free space and rerun the same command to resume (committed units are kept)"
                    )
                else:
                    self._error = RuntimeError(f"writing unit {unit_name(unit_id)} failed in a writer process:\n{text}")
            self._free.put(index)
            with self._done:
                self._in_flight -= 1
                self._done.notify_all()


def _die_with(parent: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), and check it is alive."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


# Where the extract process feeds a GPU, its writers, which compress on every core (shard.write_shard),
# yield the cores to it: its kernel launches must never wait for one. On a CPU the extract process
# computes the forward itself, and writers starved by it (or by other jobs) would hold up its end.
WRITER_NICENESS = 10


def _writer_main(handle, out: str, storage: StorageInfo, jobs, results, parent: int, niceness: int) -> None:
    _die_with(parent)
    # Ctrl-C reaches the whole process group: the extract process answers it, and a writer ends
    # with it (above) instead of printing a traceback of its own.
    ready_for_interrupts(False)
    os.nice(niceness)
    buffers = attach(handle)
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # where there is no parent-death signal
                return
            continue
        if job is None:
            return
        buf, n = buffers[job.index], job.n_tokens
        bits = {key: a[:n] if a.dtype != np.int16 else a[:n].view(np.uint16) for key, a in buf.items()}
        arrays = UnitArrays(
            hidden=bits["hidden"],
            hidden_scale=bits.get("hidden_scale"),
            final_hidden=bits.get("final_hidden"),
            final_scale=bits.get("final_scale"),
            input_ids=job.input_ids,
            loss_mask=job.loss_mask,
            offsets=job.offsets,
            sample_index=job.sample_index,
        )
        failure = None
        try:
            written = write_unit(Path(out), job.unit_id, arrays, storage)
        except OSError as e:  # a full disk is the user's to fix; anything else is a bug
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            written, failure = 0, ("full", e.strerror) if full else ("error", traceback.format_exc())
        except Exception:  # noqa: BLE001 - reported to the extract process, which raises it
            written, failure = 0, ("error", traceback.format_exc())
        results.put((job.index, job.unit_id, written, failure))
