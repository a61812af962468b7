"""A unit checked against what cache.json promises (`check_unit`, at open), and decoded in full
(`verify_unit`, for `dflash verify`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cache.cache.spec import CacheSpec
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.cache.unit.read import CorruptUnit, UnitReader


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
