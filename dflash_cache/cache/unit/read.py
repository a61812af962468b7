"""Random access to a committed unit's samples (`UnitReader`), and the error that names a unit
that cannot be trusted (`CorruptUnit`)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import numpy as np
import zarr
from zarr.core.buffer.cpu import NDBuffer

from dflash_cache.cache.unit.layout import TOKEN_ARRAYS, Expect
from dflash_cache.cache.unit.manifest import index_crc, read_manifest
from dflash_cache.cache.unit.shard import ShardRows
from dflash_cache.core.errors import UserError


class CorruptUnit(UserError, RuntimeError):
    """A committed unit that cannot be trusted; the message names the unit and the problem."""

    def __init__(self, unit: str, problem: str):
        super().__init__(f"{unit}: {problem}")
        self.unit = unit
        self.problem = problem


class UnitReader:
    """Random access to one committed unit's samples.

    Opening reads the manifest (plain JSON, no Zarr) and checks it against the files on disk, so a
    truncated or deleted array is named here, before anything is decoded. The offsets and
    sample_index come from the manifest's `index` (checked by its crc32); a unit written before
    the index existed decodes them from its arrays instead. The Zarr arrays themselves are opened
    on first use (`arrays`, `read_into`), once, and checked against `expect` then, still before
    any decode: at 76,000 units, opening every array up front cost minutes on every start. Every
    decode checks the chunks' zstd checksums and the shard index's crc32c.
    """

    def __init__(self, path: Path, expect: Expect | None = None, *, direct: bool = True):
        self.path = path if isinstance(path, Path) else Path(path)
        self.name = self.path.name
        self.expect = expect
        self._arrays: dict[str, zarr.Array] | None = None
        self._lock = threading.Lock()
        self._shards: dict[str, ShardRows | None] = {}
        self._direct = direct  # False: every read through zarr (benchmarks compare the two)
        manifest, manifest_bytes = self._read_manifest()
        self.files: dict[str, int] = manifest["files"]
        self.nbytes = self._check_sizes() + manifest_bytes  # the unit's bytes on disk
        self.n_samples = int(manifest["n_samples"])
        self.n_tokens = int(manifest["n_tokens"])
        self.storage = manifest["storage"]
        self.indexed = "index" in manifest  # False: a unit written before the manifest held its index
        if self.indexed:
            self.offsets, self.sample_index = self._manifest_index(manifest["index"])
        else:
            self.offsets = self.read_all("offsets")
            self.sample_index = self.read_all("sample_index")
        if len(self.offsets) != self.n_samples + 1 or self.offsets[0] != 0 or self.offsets[-1] != self.n_tokens:
            raise CorruptUnit(self.name, "offsets do not match the manifest's sample and token counts")
        if np.any(np.diff(self.offsets) <= 0):
            raise CorruptUnit(self.name, "offsets are not strictly increasing")
        if len(self.sample_index) != self.n_samples:
            raise CorruptUnit(self.name, "sample_index length does not match n_samples")

    def _read_manifest(self) -> tuple[dict, int]:
        try:
            return read_manifest(self.path)
        except Exception as e:  # noqa: BLE001 - any failure to open means an unusable unit
            raise CorruptUnit(self.name, f"cannot open unit metadata ({type(e).__name__}: {e})") from None

    def _check_sizes(self) -> int:
        """Every file the manifest lists exists with its size; returns their total bytes."""
        root, total = f"{self.path}/", 0
        for rel, size in self.files.items():
            try:
                st = os.stat(root + rel)
            except OSError:
                raise CorruptUnit(self.name, f"missing file {rel}") from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptUnit(self.name, f"missing file {rel}")
            if st.st_size != size:
                raise CorruptUnit(self.name, f"{rel} has {st.st_size} bytes, manifest says {size}")
            total += size
        return total

    def _manifest_index(self, index: dict) -> tuple[np.ndarray, np.ndarray]:
        try:
            offsets = np.asarray(index["offsets"], dtype=np.int64)
            sample_index = np.asarray(index["sample_index"], dtype=np.int64)
            crc = int(index["crc32"])
        except Exception as e:  # noqa: BLE001
            raise CorruptUnit(self.name, f"manifest index is unreadable ({type(e).__name__}: {e})") from None
        if offsets.ndim != 1 or sample_index.ndim != 1 or index_crc(offsets, sample_index) != crc:
            raise CorruptUnit(self.name, "manifest index does not match its crc32")
        return offsets, sample_index

    @property
    def arrays(self) -> dict[str, zarr.Array]:
        """The unit's Zarr arrays by name, opened (and checked against `expect`) on first use."""
        if self._arrays is None:
            with self._lock:  # reader threads may ask at once: open once
                if self._arrays is None:
                    arrays = self._open_arrays(self._array_names())
                    self._check_expected(arrays)
                    self._arrays = arrays
        return self._arrays

    def _array_names(self) -> list[str]:
        return sorted({rel.split("/", 1)[0] for rel in self.files if "/" in rel})

    def _open_arrays(self, names: list[str]) -> dict[str, zarr.Array]:
        try:
            store = zarr.storage.LocalStore(self.path, read_only=True)
            return {k: zarr.open_array(store, path=k, mode="r", zarr_format=3) for k in names}
        except Exception as e:  # noqa: BLE001
            raise CorruptUnit(self.name, f"cannot open arrays ({type(e).__name__}: {e})") from None

    def _check_expected(self, arrays: dict[str, zarr.Array]) -> None:
        for key, (dtype, shape) in (self.expect or {}).items():
            arr = arrays.get(key)
            if arr is None:
                raise CorruptUnit(self.name, f"array {key} is missing")
            if np.dtype(arr.dtype) != np.dtype(dtype) or tuple(arr.shape) != tuple(shape):
                got, want = f"{np.dtype(arr.dtype)}{tuple(arr.shape)}", f"{np.dtype(dtype)}{tuple(shape)}"
                raise CorruptUnit(self.name, f"{key} is {got}, expected {want}")

    def require(self, expect: Expect) -> None:
        """Set what the arrays must be; checked now if they are open, else when they first open."""
        self.expect = expect
        if self._arrays is not None:
            self._check_expected(self._arrays)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def read_all(self, key: str) -> np.ndarray:
        """Decode a whole array (meant for the small ones: offsets, sample_index). Opens only that
        array if the others are not open yet (a unit without the manifest index, at open)."""
        if key not in self._array_names():
            raise CorruptUnit(self.name, f"array {key} is missing")
        arr = self._arrays[key] if self._arrays is not None else self._open_arrays([key])[key]
        try:
            return arr[...]
        except Exception as e:  # noqa: BLE001
            raise CorruptUnit(self.name, f"{key} does not decode ({type(e).__name__}: {e})") from None

    def read_into(self, key: str, start: int, stop: int, out: np.ndarray) -> None:
        """Decode token rows `start:stop` of one array straight into `out` (e.g. a pinned buffer).

        A token-wise array in the layout `write_group` writes is read by `ShardRows`, without zarr;
        anything else (an older layout, say) through zarr."""
        if key not in self.arrays:
            raise CorruptUnit(self.name, f"array {key} is missing")
        try:
            shard = self._shard(key)
            if shard is not None:
                shard.read_into(start, stop, out)
            else:
                self.arrays[key].get_basic_selection(slice(start, stop), out=NDBuffer.from_numpy_array(out))
        except Exception as e:  # noqa: BLE001
            raise CorruptUnit(self.name, f"{key}[{start}:{stop}] does not decode ({type(e).__name__}: {e})") from None

    def _shard(self, key: str) -> ShardRows | None:
        if key not in self._shards:
            with self._lock:
                if key not in self._shards:
                    direct = self._direct and key in TOKEN_ARRAYS
                    self._shards[key] = ShardRows.open(self.path / key) if direct else None
        return self._shards[key]

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        arr = self.arrays.get(key)
        if arr is None:
            raise CorruptUnit(self.name, f"array {key} is missing")
        out = np.empty((stop - start, *arr.shape[1:]), dtype=arr.dtype)
        self.read_into(key, start, stop, out)
        return out
