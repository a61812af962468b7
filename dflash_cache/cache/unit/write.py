"""A unit's Zarr group written: its arrays, token-wise ones as one shard of zstd chunks each
(`shard.write_shard`, beside zarr's metadata), and its manifest."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
from numcodecs import Zstd
from zarr.codecs import BytesCodec, ZstdCodec

from dflash_cache.cache.spec import StorageInfo
from dflash_cache.cache.unit.layout import TOKEN_ARRAYS
from dflash_cache.cache.unit.manifest import unit_manifest
from dflash_cache.cache.unit.shard import write_shard


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


def write_group(tmp: Path, unit_id: int, arrays: UnitArrays, storage: StorageInfo, *,
                direct: bool = True) -> dict[str, int]:  # fmt: skip
    """The unit's Zarr group at `tmp`, manifest included (not yet fsynced); returns the manifest's
    file sizes. `direct` False: the shards through zarr's own write, the same bytes (benchmarks
    compare the two)."""
    n_tokens = len(arrays.input_ids)
    chunk = storage.chunk_tokens
    shard = -(-n_tokens // chunk) * chunk
    codecs = _codecs(storage)
    zstd = Zstd(level=codecs["compressors"].level, checksum=codecs["compressors"].checksum)
    group = zarr.open_group(zarr.storage.LocalStore(tmp), mode="w-", zarr_format=3)
    for key, data in _named(arrays):
        assert data.shape[0] == (n_tokens if key in TOKEN_ARRAYS else data.shape[0])
        if key in TOKEN_ARRAYS:
            arr = group.create_array(key, shape=data.shape, dtype=data.dtype, chunks=(chunk, *data.shape[1:]),
                                     shards=(shard, *data.shape[1:]), **codecs)  # fmt: skip
            if direct:
                write_shard(tmp / key, data, chunk, arr.fill_value, zstd)
            else:
                arr[...] = data
        else:
            group.create_array(key, shape=data.shape, dtype=data.dtype, chunks=data.shape, **codecs)[...] = data
    # Every file but the group's own zarr.json, which holds this manifest.
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    files.pop("zarr.json", None)
    group.attrs.update(unit_manifest(unit_id, n_tokens, storage.dtype, files, arrays.offsets,
                                     arrays.sample_index))  # fmt: skip
    return files


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
