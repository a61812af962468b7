"""A unit's manifest: its counts, storage, file sizes and sample index with a crc32, held in the
attributes of the group's own `zarr.json`. Start-up reads it as plain JSON, without zarr, and it
catches a truncated or missing file before any decode."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

MANIFEST = "zarr.json"  # the unit group's own metadata, whose attributes hold the manifest


def unit_manifest(unit_id: int, n_tokens: int, storage: str, files: dict[str, int], offsets: np.ndarray,
                  sample_index: np.ndarray) -> dict:  # fmt: skip
    """The group attributes that hold a unit's manifest (`files`: every file but the manifest's own)."""
    offsets, sample_index = (a.astype(np.int64, copy=False) for a in (offsets, sample_index))
    return {
        "dflash_unit": {
            "id": unit_id,
            "n_samples": len(sample_index),
            "n_tokens": n_tokens,
            "storage": storage,
            "files": files,
            "index": {
                "offsets": offsets.tolist(),
                "sample_index": sample_index.tolist(),
                "crc32": index_crc(offsets, sample_index),
            },
        }
    }


def index_crc(offsets: np.ndarray, sample_index: np.ndarray) -> int:
    """crc32 of the manifest's index (both arrays as little-endian int64): a flipped digit in the
    JSON fails on open, as a flipped byte in a chunk fails on decode."""
    crc = zlib.crc32(np.ascontiguousarray(offsets, dtype="<i8").tobytes())
    return zlib.crc32(np.ascontiguousarray(sample_index, dtype="<i8").tobytes(), crc)


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
