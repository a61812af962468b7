"""A token-wise array's shard file written, and its rows read, straight, without zarr."""

from __future__ import annotations

import functools
import json
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numpy as np
from numcodecs import Zstd

_NO_CHUNK = (1 << 64) - 1  # a shard index entry for a chunk that was never written (all fill value)
_scratch = threading.local()  # per reader thread: the compressed bytes of a read


def _scratch_bytes(name: str, nbytes: int) -> np.ndarray:
    buf = getattr(_scratch, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_scratch, name, buf)
    return buf[:nbytes]


class ShardRows:
    """Row ranges of one token-wise array, read from its shard file without zarr.

    Zarr passes every chunk of a read through its one event loop and copies it twice on the way
    into `out`; at long context that, not the disk, bounded the loader when the cache sat in the
    page cache (BENCHMARKS.md, "Long-context loader"). This reads the shard index once (its crc32c checked),
    then per read one `preadv` of the chunks' compressed bytes and a zstd decode of each chunk
    straight into the caller's rows, the chunks on several cores (zstd checks each chunk's
    content checksum). It serves only
    the exact layout `write_group` writes (`open` returns None for any other), and `verify_unit`
    still decodes through zarr, so the two readers check each other.
    """

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int, fill: int | float):
        self.rows, self.row_bytes = shape[0], int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.chunk_rows, self.fill = chunk_rows, fill
        self.chunk_bytes = chunk_rows * self.row_bytes
        self.path = path / "c" / "/".join(["0"] * len(shape))
        self._zstd = Zstd()
        with open(self.path, "rb") as f:
            n = -(-self.rows // chunk_rows)
            f.seek(-(16 * n + 4), os.SEEK_END)
            raw = f.read(16 * n + 4)
        if google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise ValueError("the shard index does not match its crc32c")
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(n, 2)
        self.offset, self.nbytes = index[:, 0], index[:, 1]

    @classmethod
    def open(cls, array_dir: Path) -> ShardRows | None:
        """The reader for an array in `write_group`'s layout, or None for any other layout."""
        meta = json.loads((array_dir / "zarr.json").read_text())
        shape = tuple(meta["shape"])
        try:
            (sharding,) = meta["codecs"]
            conf = sharding["configuration"]
            chunk, shard = conf["chunk_shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
            layout = (
                sharding["name"] == "sharding_indexed" and conf["index_location"] == "end"
                and [c["name"] for c in conf["codecs"]] == ["bytes", "zstd"]
                and conf["codecs"][0].get("configuration", {}).get("endian", "little") == "little"
                and [c["name"] for c in conf["index_codecs"]] == ["bytes", "crc32c"]
                and meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "/"}}
                and list(chunk[1:]) == list(shape[1:]) and list(shard[1:]) == list(shape[1:])
                and shape[0] > 0 and shard[0] >= shape[0] and shard[0] % chunk[0] == 0
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None
        if not layout:
            return None
        return cls(array_dir, shape, np.dtype(meta["data_type"]), int(chunk[0]), meta["fill_value"])

    def read_into(self, start: int, stop: int, out: np.ndarray) -> None:
        if not 0 <= start < stop <= self.rows or out.nbytes != (stop - start) * self.row_bytes:
            raise ValueError(f"rows {start}:{stop} of {self.rows} into {out.nbytes} bytes")
        flat = out.reshape(-1).view(np.uint8)
        c0, c1 = start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1
        stored = [c for c in range(c0, c1) if self.offset[c] != _NO_CHUNK]
        if stored:
            lo = int(min(self.offset[c] for c in stored))
            hi = int(max(self.offset[c] + self.nbytes[c] for c in stored))
            packed = _scratch_bytes("packed", hi - lo)
            with open(self.path, "rb", buffering=0) as f:
                if os.preadv(f.fileno(), [packed], lo) != hi - lo:
                    raise ValueError("the shard file is shorter than its index says")
        jobs = []
        for c in range(c0, c1):
            r0 = c * self.chunk_rows
            a, b = max(start, r0), min(stop, r0 + self.chunk_rows)
            if self.offset[c] == _NO_CHUNK:
                out[a - start : b - start] = self.fill
                continue
            src = packed[int(self.offset[c]) - lo : int(self.offset[c] + self.nbytes[c]) - lo]
            dst = flat[(a - start) * self.row_bytes : (b - start) * self.row_bytes]
            jobs.append((src, dst, (a - r0) * self.row_bytes))
        if len(jobs) == 1:
            self._decode(*jobs[0])
        else:  # zstd releases the GIL: a piece's chunks decode on several cores, as in zarr
            for done in [_pool().submit(self._decode, *job) for job in jobs]:
                done.result()

    def _decode(self, src: np.ndarray, dst: np.ndarray, skip: int) -> None:
        """One chunk into `dst`, in place when `dst` is the whole chunk; `skip` bytes of it first."""
        if skip == 0 and dst.nbytes == self.chunk_bytes:
            self._zstd.decode(src, out=dst)
        else:
            chunk = self._zstd.decode(src, out=np.empty(self.chunk_bytes, dtype=np.uint8))
            dst[:] = chunk[skip : skip + dst.nbytes]


def write_shard(array_dir: Path, data: np.ndarray, chunk_rows: int, fill: int | float, zstd: Zstd) -> None:
    """The one shard of an array whose zarr.json is written, in the layout `ShardRows` reads and
    zarr's sharding codec writes (inner chunks of `chunk_rows` rows, the last one padded with
    `fill`; then the index of (offset, nbytes) and its crc32c), its chunks compressed on several
    cores as they stream to the file. zarr's own write of a shard runs on one core, below zstd's
    own rate there (BENCHMARKS.md, "Disk and codec"); a unit of a 256K-token sample is 10 GiB."""
    rows = data.shape[0]
    little = data.astype(data.dtype.newbyteorder("<"), copy=False)

    def encode(c: int) -> bytes | None:
        part = little[c * chunk_rows : (c + 1) * chunk_rows]
        if not np.any(part != fill):  # a chunk of fill values only is not stored, as zarr skips it
            return None
        if part.shape[0] < chunk_rows:
            part = np.concatenate([part, np.full((chunk_rows - part.shape[0], *part.shape[1:]), fill, part.dtype)])
        return zstd.encode(np.ascontiguousarray(part))

    n = -(-rows // chunk_rows)
    index = np.empty((n, 2), dtype="<u8")
    path = array_dir / "c" / "/".join(["0"] * data.ndim)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        offset = 0
        for c, blob in enumerate(_in_order(encode, range(n))):
            if blob is None:
                index[c] = _NO_CHUNK, _NO_CHUNK
                continue
            f.write(blob)
            index[c] = offset, len(blob)
            offset += len(blob)
        raw = index.tobytes()
        f.write(raw + google_crc32c.value(raw).to_bytes(4, "little"))


def _in_order(fn: Callable[[int], bytes | None], items: Iterable[int]) -> Iterator[bytes | None]:
    """`fn` over `items` on the pool's threads, results in order, a bounded number ahead."""
    ahead = 2 * _THREADS
    pending: deque = deque()
    for item in items:
        pending.append(_pool().submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


_THREADS = os.cpu_count() or 4


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """zstd's threads (it releases the GIL), shared by every read and write of the process."""
    return ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="dflash-zstd")
