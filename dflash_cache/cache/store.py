"""The cache directory: atomic unit writer, unit reader, listing, verification.

A unit is a Zarr v3 group written under `.partial/` and renamed into `units/` once complete, so a
reader never sees a torn unit. Each token-wise array is one shard whose inner chunks are a few
MiB, zstd-compressed with a content checksum, so a reader can fetch one sample without decoding
the unit and a flipped byte fails loudly. The group's attributes carry a manifest (counts and file
sizes) that catches truncated or missing files before any decode.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zarr
from zarr.codecs import BytesCodec, ZstdCodec
from zarr.core.buffer.cpu import NDBuffer

from dflash_cache.cache.spec import StorageInfo
from dflash_cache.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: unit writer processes never load it
    import torch

UNITS = "units"
PARTIAL = ".partial"
FROZEN = "frozen.safetensors"
REJECTED = "rejected.jsonl"
LOCK = ".lock"
MANIFEST = "zarr.json"  # the unit group's own metadata, whose attributes hold the manifest
_UNIT_RE = re.compile(r"^u(\d{6,})$")
TOKEN_ARRAYS = ("hidden", "hidden_scale", "input_ids", "loss_mask")


class CacheBusy(UserError, RuntimeError):
    """Another extract holds the cache's lock."""


class CorruptUnit(UserError, RuntimeError):
    """A committed unit that cannot be trusted; the message names the unit and the problem."""

    def __init__(self, unit: str, problem: str):
        super().__init__(f"{unit}: {problem}")
        self.unit = unit
        self.problem = problem


def unit_name(unit_id: int) -> str:
    return f"u{unit_id:06d}"


def chunk_tokens_for(row_bytes: int, target_bytes: int = 4 << 20) -> int:
    """Tokens per inner chunk so that a chunk of hidden states is about `target_bytes`."""
    return max(16, target_bytes // max(1, row_bytes))


@dataclass
class UnitArrays:
    """One unit's packed arrays, ready to write."""

    hidden: np.ndarray  # [n_tokens, K*H] uint16 (bf16 bits) or uint8 (fp8 bits)
    input_ids: np.ndarray  # [n_tokens] int32
    loss_mask: np.ndarray  # [n_tokens] uint8
    offsets: np.ndarray  # [n_samples + 1] int64
    sample_index: np.ndarray  # [n_samples] int64
    hidden_scale: np.ndarray | None = None  # [n_tokens, K] float32, fp8 only


def _codecs(storage: StorageInfo) -> dict:
    codec = storage.codec
    if codec.get("name") != "zstd":
        raise ValueError(f"storage.codec: unsupported codec {codec.get('name')!r}")
    return {
        "serializer": BytesCodec(),
        "compressors": ZstdCodec(level=int(codec.get("level", 3)), checksum=bool(codec.get("checksum", True))),
        "filters": (),
    }


def write_unit(cache_dir: Path, unit_id: int, arrays: UnitArrays, storage: StorageInfo) -> int:
    """Write a unit under `.partial/`, fsync it and rename it into `units/`; returns bytes written.

    If the unit is already committed (another writer got there first), the new copy is
    discarded and 0 is returned: a unit id always names the same samples. If writing fails (a full
    disk, say), the partial copy is removed before the error propagates.
    """
    cache_dir = Path(cache_dir)
    name = unit_name(unit_id)
    tmp = cache_dir / PARTIAL / f"{name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        files = _write_partial(tmp, unit_id, arrays, storage)
    except BaseException:
        _remove_failed(tmp)
        raise
    target = cache_dir / UNITS / name
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    _fsync_dir(target.parent)
    return sum(files.values())


def _remove_failed(tmp: Path, settle: float = 0.05, limit: float = 2.0) -> None:
    """Remove a partial unit whose write failed. zarr writes some metadata files concurrently and a
    failed gather does not wait for the others, so a straggler can recreate the directory just
    after it was removed: remove it until it has stayed gone for `settle` seconds."""
    deadline = time.monotonic() + limit
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(settle)
        if not tmp.exists() or time.monotonic() > deadline:
            return


def _write_partial(tmp: Path, unit_id: int, arrays: UnitArrays, storage: StorageInfo) -> dict[str, int]:
    """The unit's Zarr group at `tmp`, manifest included, fsynced; returns the manifest's file sizes."""
    n_tokens = len(arrays.input_ids)
    chunk = storage.chunk_tokens
    shard = -(-n_tokens // chunk) * chunk
    codecs = _codecs(storage)
    group = zarr.open_group(zarr.storage.LocalStore(tmp), mode="w-", zarr_format=3)
    for key, data in _named(arrays):
        assert data.shape[0] == (n_tokens if key in TOKEN_ARRAYS else data.shape[0])
        if key in TOKEN_ARRAYS:
            chunks, shards = (chunk, *data.shape[1:]), (shard, *data.shape[1:])
        else:
            chunks, shards = data.shape, None
        arr = group.create_array(key, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards, **codecs)
        arr[...] = data
    # Every file but the group's own zarr.json, which holds this manifest.
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    files.pop("zarr.json", None)
    offsets, sample_index = (a.astype(np.int64, copy=False) for a in (arrays.offsets, arrays.sample_index))
    group.attrs.update(
        {
            "dflash_unit": {
                "id": unit_id,
                "n_samples": len(arrays.sample_index),
                "n_tokens": n_tokens,
                "storage": storage.dtype,
                "files": files,
                "index": {
                    "offsets": offsets.tolist(),
                    "sample_index": sample_index.tolist(),
                    "crc32": index_crc(offsets, sample_index),
                },
            }
        }
    )
    _fsync_tree(tmp)
    return files


def index_crc(offsets: np.ndarray, sample_index: np.ndarray) -> int:
    """crc32 of the manifest's index (both arrays as little-endian int64): a flipped digit in the
    JSON fails on open, as a flipped byte in a chunk fails on decode."""
    crc = zlib.crc32(np.ascontiguousarray(offsets, dtype="<i8").tobytes())
    return zlib.crc32(np.ascontiguousarray(sample_index, dtype="<i8").tobytes(), crc)


def _named(arrays: UnitArrays) -> Iterable[tuple[str, np.ndarray]]:
    yield "hidden", arrays.hidden
    if arrays.hidden_scale is not None:
        yield "hidden_scale", arrays.hidden_scale
    yield "input_ids", arrays.input_ids.astype(np.int32, copy=False)
    yield "loss_mask", arrays.loss_mask.astype(np.uint8, copy=False)
    yield "offsets", arrays.offsets.astype(np.int64, copy=False)
    yield "sample_index", arrays.sample_index.astype(np.int64, copy=False)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


@contextmanager
def cache_lock(cache_dir: Path) -> Iterator[None]:
    """One extract per cache on a host: a second is refused. The OS frees the lock when its holder
    dies, so a crashed run never blocks the rerun."""
    path = Path(cache_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise CacheBusy(f"another dflash extract is writing {cache_dir} (pid {holder}); wait for it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def extract_running(cache_dir: Path) -> bool:
    """Whether an extract on this host holds the cache's lock right now (for status lines)."""
    path = Path(cache_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def committed_units(cache_dir: Path) -> dict[int, Path]:
    """Committed units by id. Only `units/` is looked at: `.partial/` is never read."""
    root = Path(cache_dir) / UNITS
    if not root.is_dir():
        return {}
    out = {}
    for entry in os.scandir(root):
        m = _UNIT_RE.match(entry.name)
        if m and entry.is_dir():
            out[int(m.group(1))] = Path(entry.path)
    return dict(sorted(out.items()))


def sweep_partial(cache_dir: Path) -> int:
    """Remove partial units left by dead writers on this host; returns how many were removed.

    A partial unit of a live process (another extract on the same cache) is left alone, and so is
    one from another host, which this host cannot judge.
    """
    root = Path(cache_dir) / PARTIAL
    if not root.is_dir():
        return 0
    host, removed = socket.gethostname(), 0
    for entry in root.iterdir():
        parts = entry.name.split(".")
        if len(parts) >= 4 and parts[-3] == host and parts[-2].isdigit() and _alive(int(parts[-2])):
            continue
        if len(parts) >= 4 and parts[-3] != host:
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


Expect = dict[str, tuple[np.dtype, tuple[int, ...]]]  # array name -> (dtype, shape) a reader requires


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

    def __init__(self, path: Path, expect: Expect | None = None):
        self.path = path if isinstance(path, Path) else Path(path)
        self.name = self.path.name
        self.expect = expect
        self._arrays: dict[str, zarr.Array] | None = None
        self._lock = threading.Lock()
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
        """The manifest, read as plain JSON (no Zarr), and the size of the file that holds it."""
        try:
            with open(os.path.join(self.path, MANIFEST), "rb") as f:
                raw = f.read()
            meta = json.loads(raw)
            if meta.get("node_type") != "group":
                raise ValueError(f"{MANIFEST} is not a group's")
            manifest = meta["attributes"]["dflash_unit"]
            missing = [k for k in ("n_samples", "n_tokens", "storage", "files") if k not in manifest]
            if missing or not isinstance(manifest["files"], dict):
                raise ValueError(f"the manifest lacks {missing or 'files'}")
        except Exception as e:  # noqa: BLE001 - any failure to open means an unusable unit
            raise CorruptUnit(self.name, f"cannot open unit metadata ({type(e).__name__}: {e})") from None
        return manifest, len(raw)

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
        """Decode token rows `start:stop` of one array straight into `out` (e.g. a pinned buffer)."""
        if key not in self.arrays:
            raise CorruptUnit(self.name, f"array {key} is missing")
        try:
            self.arrays[key].get_basic_selection(slice(start, stop), out=NDBuffer.from_numpy_array(out))
        except Exception as e:  # noqa: BLE001
            raise CorruptUnit(self.name, f"{key}[{start}:{stop}] does not decode ({type(e).__name__}: {e})") from None

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        arr = self.arrays.get(key)
        if arr is None:
            raise CorruptUnit(self.name, f"array {key} is missing")
        out = np.empty((stop - start, *arr.shape[1:]), dtype=arr.dtype)
        self.read_into(key, start, stop, out)
        return out


def expected_arrays(n_tokens: int, row_width: int, num_layers: int, storage: str) -> Expect:
    """The token-wise arrays a unit of `n_tokens` tokens must hold, by cache.json's geometry."""
    expect: Expect = {
        "hidden": (np.dtype(np.uint8 if storage == "fp8" else np.uint16), (n_tokens, row_width)),
        "input_ids": (np.dtype(np.int32), (n_tokens,)),
        "loss_mask": (np.dtype(np.uint8), (n_tokens,)),
    }
    if storage == "fp8":
        expect["hidden_scale"] = (np.dtype(np.float32), (n_tokens, num_layers))
    return expect


def verify_unit(path: Path, row_width: int, num_layers: int, storage: str) -> list[str]:
    """Problems found in a committed unit after decoding every byte; empty if it is sound."""
    try:
        reader = UnitReader(path)
        arrays = reader.arrays
    except CorruptUnit as e:
        return [e.problem]
    problems = []
    if reader.storage != storage:
        problems.append(f"stored as {reader.storage}, cache says {storage}")
    if reader.indexed:  # the manifest's copy of the index must be the arrays' own
        for key in ("offsets", "sample_index"):
            try:
                same = np.array_equal(reader.read_all(key), getattr(reader, key))
            except CorruptUnit as e:
                problems.append(e.problem)
                continue
            if not same:
                problems.append(f"{key} differs from the manifest's index")
    for key, (dtype, shape) in expected_arrays(reader.n_tokens, row_width, num_layers, storage).items():
        arr = arrays.get(key)
        if arr is None:
            problems.append(f"array {key} is missing")
            continue
        if arr.dtype != dtype or tuple(arr.shape) != shape:
            problems.append(f"{key} is {arr.dtype}{tuple(arr.shape)}, expected {dtype}{shape}")
            continue
        step = max(1, (64 << 20) // max(1, arr.nbytes // max(1, shape[0])))
        for start in range(0, shape[0], step):
            try:
                block = reader.read(key, start, min(shape[0], start + step))
            except CorruptUnit as e:
                problems.append(e.problem)
                break
            if key == "hidden_scale" and not np.all(np.isfinite(block) & (block > 0)):
                problems.append("hidden_scale has non-finite or non-positive values")
                break
    return problems


def write_frozen(cache_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
    """Save the target's token embedding and LM head (omitted when tied) atomically."""
    from safetensors.torch import save_file

    path = Path(cache_dir) / FROZEN
    tensors = {"embed_tokens.weight": embed.detach().contiguous().cpu()}
    if lm_head is not None:
        tensors["lm_head.weight"] = lm_head.detach().contiguous().cpu()
    tmp = path.with_name(f".{FROZEN}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"tied": str(lm_head is None).lower()})
    os.replace(tmp, path)


def read_frozen(cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen (embedding, LM head) pair; the same tensor twice when the target ties them."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(cache_dir) / FROZEN))
    embed = tensors["embed_tokens.weight"]
    return embed, tensors.get("lm_head.weight", embed)


def write_rejected(cache_dir: Path, rejected: list[tuple[int, str]]) -> None:
    """Record the source rows that were not cached, and why (one JSON object per line)."""
    path = Path(cache_dir) / REJECTED
    tmp = path.with_name(f".{REJECTED}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        for row, reason in rejected:
            f.write(json.dumps({"row": row, "reason": reason}) + "\n")
    os.replace(tmp, path)
