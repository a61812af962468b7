"""The unit format: the one module that knows what a committed unit holds and how it is encoded.

A unit is a Zarr v3 group. Each token-wise array (`TOKEN_ARRAYS`) is one shard whose inner chunks
are a few MiB, zstd-compressed with a content checksum, so a reader can fetch one sample without
decoding the unit and a flipped byte fails loudly. The group's own `zarr.json` carries a manifest
(counts, file sizes, and the sample index with its crc32) that catches truncated or missing files
before any decode, and that start-up reads as plain JSON.

Hidden states are stored per token as the K tapped layers side by side (`RowFormat`): bf16 bits,
or float8_e4m3fn bits with one float32 scale per token and layer (amax / 448). A cache extracted
with `--final-hidden` also holds the target's last hidden state after its final norm (the LM
head's input) in arrays of its own, `final_hidden` and (fp8) `final_scale`, in the same storage,
so a drafter that does not need it never reads it. `encode_hidden` and `decode_hidden` are the
only code that converts between the storages, and this is the only module that imports zarr.
Where each rule lives: docs/architecture.md.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import google_crc32c
import numpy as np
import zarr
from numcodecs import Zstd
from zarr.codecs import BytesCodec, ZstdCodec
from zarr.core.buffer.cpu import NDBuffer

from dflash_cache.cache.spec import CacheSpec, ProjectionInfo, StorageInfo
from dflash_cache.core.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: unit writer processes never load it
    import torch

MANIFEST = "zarr.json"  # the unit group's own metadata, whose attributes hold the manifest
TOKEN_ARRAYS = ("hidden", "hidden_scale", "final_hidden", "final_scale", "input_ids", "loss_mask")
FINAL_ARRAYS = ("final_hidden", "final_scale")  # the final hidden state of a `--final-hidden` cache
STORAGES = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ID_MASK_BYTES = 4 + 1  # input_ids (int32) and loss_mask (uint8) of one token


@dataclass(frozen=True)
class RowFormat:
    """One cached token: `layers` (K) tapped layers of `width // layers` values each, in `storage`,
    and with `final` > 0 the target's final hidden state of `final` (H) values. Under a projection
    the "layers" are its groups of projected values (`CacheSpec.groups`): one for a joint basis."""

    storage: str
    width: int  # K*H stored values per token
    layers: int  # K
    final: int = 0  # H when the final hidden state is cached, else 0

    @classmethod
    def of(cls, spec: CacheSpec) -> RowFormat:
        return cls.planned(spec.storage.dtype, len(spec.layers.ids), spec.target.hidden_size, spec.projection,
                           final=spec.layers.final_hidden)  # fmt: skip

    @classmethod
    def planned(cls, storage: str, num_layers: int, hidden_size: int, projection: ProjectionInfo | None = None,
                final: bool = False) -> RowFormat:  # fmt: skip
        """The row of K = `num_layers` taps of H = `hidden_size`, as they are or under `projection`:
        what a plan sizes its units by before the cache's spec exists."""
        if projection is None:
            return cls(storage, num_layers * hidden_size, num_layers, hidden_size if final else 0)
        groups = len(projection.groups(num_layers))
        return cls(storage, projection.rank, groups, hidden_size if final else 0)

    @property
    def fp8(self) -> bool:
        return self.storage == "fp8"

    @property
    def hidden_dtype(self) -> np.dtype:
        """The hidden array's dtype on disk: fp8 bits, or bf16 bits (numpy has no bfloat16)."""
        return np.dtype(np.uint8 if self.fp8 else np.uint16)

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one token's hidden states (all K layers)."""
        return self.width * self.hidden_dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        return 4 * self.layers if self.fp8 else 0

    @property
    def final_bytes(self) -> int:
        """Bytes of one token's final hidden state with its fp8 scale (0 when it is not cached):
        H * 2 in bf16, H + 4 in fp8."""
        return self.final * self.hidden_dtype.itemsize + (4 if self.fp8 and self.final else 0)

    @property
    def row_bytes(self) -> int:
        """Uncompressed bytes of one cached token, every array included."""
        return self.hidden_bytes + self.scale_bytes + self.final_bytes + ID_MASK_BYTES

    def expected(self, n_tokens: int) -> Expect:
        """The token-wise arrays a unit of `n_tokens` tokens must hold."""
        expect: Expect = {
            "hidden": (self.hidden_dtype, (n_tokens, self.width)),
            "input_ids": (np.dtype(np.int32), (n_tokens,)),
            "loss_mask": (np.dtype(np.uint8), (n_tokens,)),
        }
        if self.fp8:
            expect["hidden_scale"] = (np.dtype(np.float32), (n_tokens, self.layers))
        if self.final:
            expect["final_hidden"] = (self.hidden_dtype, (n_tokens, self.final))
            if self.fp8:
                expect["final_scale"] = (np.dtype(np.float32), (n_tokens, 1))
        return expect

    def shapes(self, rows: int) -> dict[str, tuple[tuple[int, int], str]]:
        """The hidden-state arrays of `rows` tokens as (shape, torch dtype name): what extract's
        unit buffers and the loader's host slots hold. bf16 bits live in int16, which torch can view
        as bfloat16 (it has no full uint16 support)."""
        bits = "uint8" if self.fp8 else "int16"
        out = {"hidden": ((rows, self.width), bits)}
        if self.fp8:
            out["hidden_scale"] = ((rows, self.layers), "float32")
        if self.final:
            out["final_hidden"] = ((rows, self.final), bits)
            if self.fp8:
                out["final_scale"] = ((rows, 1), "float32")
        return out


def host_rows(rows: int, row: RowFormat, pin: bool = False) -> dict[str, torch.Tensor]:
    """Host tensors for `rows` tokens of every hidden-state array of `row` (storage bits, fp8
    scales, the final state), by array name; pinned for async copies."""
    import torch

    return {key: torch.empty(shape, dtype=getattr(torch, dtype), pin_memory=pin)
            for key, (shape, dtype) in row.shapes(rows).items()}  # fmt: skip


def encode_hidden(taps: list[torch.Tensor], index: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gather the real (unpadded) rows of every tapped layer into [n, K*H] storage bits.

    bf16: the bf16 bits as int16. fp8: float8_e4m3fn bits as uint8 with a float32 scale per
    token and layer (amax / 448), computed on the device so the host copy is halved too.
    """
    import torch

    rows = [t.reshape(-1, t.shape[-1]).index_select(0, index) for t in taps]
    if not fp8:
        return torch.cat(rows, dim=1).to(torch.bfloat16).view(torch.int16), None
    h = torch.stack(rows, dim=1).float()  # [n, K, H]
    scale = h.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (h / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.reshape(q.shape[0], -1), scale


def encode_rows(outputs: list[torch.Tensor], index: torch.Tensor, row: RowFormat) -> dict[str, torch.Tensor]:
    """A target forward's outputs (the K tapped layers, then the final hidden state when `row`
    caches it), unpadded by `index`, as storage arrays by name (the keys of `row.shapes`)."""
    taps = outputs[: row.layers]
    bits, scale = encode_hidden(taps, index, row.fp8)
    out = {"hidden": bits} if scale is None else {"hidden": bits, "hidden_scale": scale}
    if row.final:
        if len(outputs) != row.layers + 1:
            raise ValueError(f"the target gave {len(outputs)} outputs; {row.layers} taps and the final state expected")
        bits, scale = encode_hidden(outputs[row.layers :], index, row.fp8)
        out["final_hidden"] = bits
        if scale is not None:
            out["final_scale"] = scale
    return out


def decode_hidden(bits: torch.Tensor, scale: torch.Tensor | None, num_layers: int,
                  layer_index: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `encode_hidden`: storage bits -> [n, K'*H], bf16 (bf16 storage) or float32
    (fp8), keeping only the layers in `layer_index` (all when None)."""
    import torch

    n = bits.shape[0]
    if scale is None:
        bf16 = bits.view(torch.bfloat16)
        if layer_index is None:
            return bf16
        return bf16.view(n, num_layers, -1).index_select(1, layer_index).reshape(n, -1)
    q = bits.view(torch.float8_e4m3fn).view(n, num_layers, -1)
    if layer_index is not None:
        q, scale = q.index_select(1, layer_index), scale.index_select(1, layer_index)
    return (q.float() * scale.unsqueeze(-1)).reshape(n, -1)


class CorruptUnit(UserError, RuntimeError):
    """A committed unit that cannot be trusted; the message names the unit and the problem."""

    def __init__(self, unit: str, problem: str):
        super().__init__(f"{unit}: {problem}")
        self.unit = unit
        self.problem = problem


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
    final_hidden: np.ndarray | None = None  # [n_tokens, H] like hidden: the target's final hidden state
    final_scale: np.ndarray | None = None  # [n_tokens, 1] float32, fp8 only


def _codecs(storage: StorageInfo) -> dict:
    codec = storage.codec
    if codec.get("name") != "zstd":
        raise ValueError(f"storage.codec: unsupported codec {codec.get('name')!r}")
    return {
        "serializer": BytesCodec(),
        "compressors": ZstdCodec(level=int(codec.get("level", 3)), checksum=bool(codec.get("checksum", True))),
        "filters": (),
    }


def write_group(tmp: Path, unit_id: int, arrays: UnitArrays, storage: StorageInfo) -> dict[str, int]:
    """The unit's Zarr group at `tmp`, manifest included (not yet fsynced); returns the manifest's file sizes."""
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
    if arrays.final_hidden is not None:
        yield "final_hidden", arrays.final_hidden
    if arrays.final_scale is not None:
        yield "final_scale", arrays.final_scale
    yield "input_ids", arrays.input_ids.astype(np.int32, copy=False)
    yield "loss_mask", arrays.loss_mask.astype(np.uint8, copy=False)
    yield "offsets", arrays.offsets.astype(np.int64, copy=False)
    yield "sample_index", arrays.sample_index.astype(np.int64, copy=False)


def read_manifest(path: Path) -> tuple[dict, int]:
    """A unit's manifest, read as plain JSON (no Zarr), and the size of the file that holds it."""
    with open(os.path.join(path, MANIFEST), "rb") as f:
        raw = f.read()
    meta = json.loads(raw)
    if meta.get("node_type") != "group":
        raise ValueError(f"{MANIFEST} is not a group's")
    manifest = meta["attributes"]["dflash_unit"]
    missing = [k for k in ("n_samples", "n_tokens", "storage", "files") if k not in manifest]
    if missing or not isinstance(manifest["files"], dict):
        raise ValueError(f"the manifest lacks {missing or 'files'}")
    return manifest, len(raw)


def manifest_samples(path: Path) -> int | None:
    """A unit's sample count from its manifest, or None when it is unreadable."""
    try:
        return int(read_manifest(path)[0]["n_samples"])
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        return None


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

        A token-wise array in the layout this module writes is read by `ShardRows`, without zarr;
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
            for done in [_decoders().submit(self._decode, *job) for job in jobs]:
                done.result()

    def _decode(self, src: np.ndarray, dst: np.ndarray, skip: int) -> None:
        """One chunk into `dst`, in place when `dst` is the whole chunk; `skip` bytes of it first."""
        if skip == 0 and dst.nbytes == self.chunk_bytes:
            self._zstd.decode(src, out=dst)
        else:
            chunk = self._zstd.decode(src, out=np.empty(self.chunk_bytes, dtype=np.uint8))
            dst[:] = chunk[skip : skip + dst.nbytes]


@functools.cache
def _decoders() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 4, thread_name_prefix="dflash-zstd")


def check_unit(reader: UnitReader, spec: CacheSpec, *, now: bool = False) -> None:
    """Refuse a unit whose arrays do not have the shapes and dtypes that cache.json promises.

    The storage dtype is checked at once, from the manifest. The arrays' shapes are checked when
    the reader first opens its arrays, before its first decode (opening them all at start-up is
    what made start-up grow by milliseconds a unit), or at once with `now`.
    """
    if reader.storage != spec.storage.dtype:
        raise CorruptUnit(reader.name, f"stored as {reader.storage}, cache.json says {spec.storage.dtype}")
    reader.require(RowFormat.of(spec).expected(reader.n_tokens))
    if now:
        reader.arrays  # noqa: B018 - opens and checks the arrays


def verify_unit(path: Path, row: RowFormat) -> list[str]:
    """Problems found in a committed unit after decoding every byte; empty if it is sound."""
    try:
        reader = UnitReader(path)
        arrays = reader.arrays
    except CorruptUnit as e:
        return [e.problem]
    problems = []
    if reader.storage != row.storage:
        problems.append(f"stored as {reader.storage}, cache says {row.storage}")
    if reader.indexed:  # the manifest's copy of the index must be the arrays' own
        for key in ("offsets", "sample_index"):
            try:
                same = np.array_equal(reader.read_all(key), getattr(reader, key))
            except CorruptUnit as e:
                problems.append(e.problem)
                continue
            if not same:
                problems.append(f"{key} differs from the manifest's index")
    for key, (dtype, shape) in row.expected(reader.n_tokens).items():
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
            if key in ("hidden_scale", "final_scale") and not np.all(np.isfinite(block) & (block > 0)):
                problems.append(f"{key} has non-finite or non-positive values")
                break
    return problems


