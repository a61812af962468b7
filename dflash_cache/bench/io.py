"""The cache's storage, measured before a long job: the filesystem's sequential write and cold
read bandwidth (`disk`), zstd's ratio and speed on hidden-state-shaped data with a unit's reads
through zarr and through `ShardRows` (`codec`), and unit commits by writer threads against writer
processes while the process runs Python (`commit`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dflash_cache.bench.config import CodecBenchConfig, CommitBenchConfig, DiskBenchConfig


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache, so the next read comes from the disk."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk(path: Path, size_mb: int = DiskBenchConfig.size_mb) -> dict[str, float]:
    """Sequential write (with fsync) and cold read bandwidth of the filesystem holding `path`."""
    path.mkdir(parents=True, exist_ok=True)
    f = path / f".dflash-bench-{os.getpid()}"
    block = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    n = max(1, size_mb // 64)
    try:
        t = time.perf_counter()
        with open(f, "wb") as fh:
            for _ in range(n):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        write = n * len(block) / (time.perf_counter() - t)
        drop_page_cache([f])
        t = time.perf_counter()
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
        read = n * len(block) / (time.perf_counter() - t)
    finally:
        f.unlink(missing_ok=True)
    return {"write_GBps": write / 1e9, "read_GBps": read / 1e9, "bytes": n * len(block)}


def codec(hidden: torch.Tensor | None = None, level: int = CodecBenchConfig.level, rows: int = 4096,
          width: int = 5 * 4096, threads: int = 4) -> dict:
    """zstd on bf16 hidden-state bits: ratio, single-thread encode/decode GB/s, and a unit's reads
    through zarr and through `ShardRows` (`unit_reads`)."""
    from numcodecs import Zstd

    if hidden is None:  # activations are heavy-tailed: a Student-t stands in for real ones
        torch.manual_seed(0)
        hidden = (torch.distributions.StudentT(4.0).sample((rows, width)) * 0.5).to(torch.bfloat16)
    raw = hidden.contiguous().view(torch.int16).cpu().numpy().tobytes()
    z = Zstd(level=level)
    t = time.perf_counter()
    enc = z.encode(raw)
    t_enc = time.perf_counter() - t
    t = time.perf_counter()
    z.decode(enc)
    t_dec = time.perf_counter() - t
    bits = hidden.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return {"ratio": len(raw) / len(enc), "encode_GBps": len(raw) / t_enc / 1e9, "decode_GBps": len(raw) / t_dec / 1e9,
            "level": level, **unit_reads(bits, level=level, threads=threads)}  # fmt: skip


def unit_reads(bits: np.ndarray, *, level: int = 3, threads: int = 4, repeats: int = 3) -> dict:
    """A unit's hidden rows written through zarr and through `write_shard` (its chunks on every
    core), and the loader's reads of them, in pieces of 8 chunks over `threads` threads, through
    zarr and through the zarr-free `ShardRows`, side by side on the same files (in the page
    cache): GB/s of each, best of `repeats`."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_cache.cache.spec import StorageInfo
    from dflash_cache.cache.unit.layout import chunk_tokens_for
    from dflash_cache.cache.unit.read import UnitReader
    from dflash_cache.cache.unit.write import UnitArrays, write_group

    n = bits.shape[0]
    chunk = chunk_tokens_for(bits.shape[1] * 2)
    storage = StorageInfo(dtype="bf16", codec={"name": "zstd", "level": level, "checksum": True}, chunk_tokens=chunk)
    arrays = UnitArrays(hidden=bits, input_ids=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                        offsets=np.array([0, n]), sample_index=np.array([0]))  # fmt: skip
    out = np.empty_like(bits)
    pieces = [(a, min(n, a + 8 * chunk)) for a in range(0, n, 8 * chunk)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(threads) as pool:
        writes = {}
        for name, direct in (("zarr", False), ("direct", True)) * repeats:
            shutil.rmtree(Path(tmp) / "u", ignore_errors=True)
            t = time.perf_counter()
            write_group(Path(tmp) / "u", 0, arrays, storage, direct=direct)
            writes[name] = min(writes.get(name, 1e9), time.perf_counter() - t)
        readers = {"zarr": UnitReader(Path(tmp) / "u", direct=False), "direct": UnitReader(Path(tmp) / "u")}
        best = {}
        for _ in range(repeats):
            for name, reader in readers.items():
                t = time.perf_counter()
                list(pool.map(lambda p, r=reader: r.read_into("hidden", p[0], p[1], out[p[0] : p[1]]), pieces))
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
        assert np.array_equal(out, bits)
    return {"read_threads": threads, "zarr_read_GBps": bits.nbytes / best["zarr"] / 1e9,
            "direct_read_GBps": bits.nbytes / best["direct"] / 1e9, "direct_over_zarr": best["zarr"] / best["direct"],
            "zarr_write_GBps": bits.nbytes / writes["zarr"] / 1e9,
            "direct_write_GBps": bits.nbytes / writes["direct"] / 1e9,
            "write_direct_over_zarr": writes["zarr"] / writes["direct"]}  # fmt: skip


@contextmanager
def _python_load():
    """A thread that runs Python (holding the GIL) until the block ends, as a launch loop does."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def commit(out: Path, *, units: int = CommitBenchConfig.units, rows: int = 3200, width: int = 5 * 4096,
           writers: int = CommitBenchConfig.writers) -> dict:  # fmt: skip
    """Unit commits while another thread of the process runs Python, as extraction's forward loop
    does: writer threads in the process (the design before commit.py) against writer processes.
    Both write the same bf16-shaped units; the figures are raw MB/s committed."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_cache.cache.spec import StorageInfo
    from dflash_cache.cache.store import write_unit
    from dflash_cache.cache.unit.layout import RowFormat, chunk_tokens_for
    from dflash_cache.cache.unit.write import UnitArrays
    from dflash_cache.extract.commit import BufferLayout, Committer, SharedBuffers

    out = Path(out) / f".dflash-bench-commit-{os.getpid()}"  # only this is written, and removed
    torch.manual_seed(0)
    bits = (torch.distributions.StudentT(4.0).sample((rows, width)) * 0.5).to(torch.bfloat16).view(torch.int16).numpy()
    meta = {"input_ids": np.zeros(rows, np.int32), "loss_mask": np.ones(rows, np.uint8),
            "offsets": np.array([0, rows]), "sample_index": np.array([0])}  # fmt: skip
    storage = StorageInfo(dtype="bf16", codec={"name": "zstd", "level": 3, "checksum": True},
                          chunk_tokens=chunk_tokens_for(width * 2))  # fmt: skip
    times = {}
    with _python_load(), ThreadPoolExecutor(writers) as pool:
        t = time.perf_counter()
        arrays = UnitArrays(hidden=bits.view(np.uint16), **meta)
        for f in [pool.submit(write_unit, out / "threads", u, arrays, storage) for u in range(units)]:
            f.result()
        times["threads"] = time.perf_counter() - t
    shared = SharedBuffers(BufferLayout(count=writers + 1, rows=rows, row=RowFormat("bf16", width, 1)))
    for arrays in shared.arrays:
        arrays["hidden"][:] = bits
    committed = threading.Semaphore(0)
    committer = Committer(out / "processes", storage, shared, writers, lambda _: committed.release())

    def commit_units(ids: range) -> None:
        for u in ids:
            committer.commit(committer.take(), u, rows, meta["offsets"], meta["sample_index"], meta["input_ids"],
                             meta["loss_mask"])  # fmt: skip
        for _ in ids:
            committed.acquire()

    commit_units(range(units, units + writers))  # warm-up: the writer processes start and import
    with _python_load():
        t = time.perf_counter()
        commit_units(range(units))
        times["processes"] = time.perf_counter() - t
    committer.close()
    shutil.rmtree(out, ignore_errors=True)
    raw = units * bits.nbytes / 1e6
    return {"units": units, "unit_MB": bits.nbytes / 1e6, "writers": writers, "threads_MBps": raw / times["threads"],
            "processes_MBps": raw / times["processes"], "ratio": times["threads"] / times["processes"]}  # fmt: skip
