"""Rows from a data source: a JSON Lines, JSON or Parquet file, a dataset directory, or a hub dataset.

JSON text is kept raw here (each row's bytes and line number) and parsed one row at a time by
:func:`source_row`, so that one bad line becomes one rejected row instead of a failed load.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets

from dflash_cache.rows.chat import DataError, DataWarning, RowRejected, error_text
from dflash_cache.rows.digest import ENCODER_VERSION, sha256_json, source_fingerprint
from dflash_cache.rows.hub import JSONL_SUFFIXES, check_source, load_split
from dflash_cache.rows.json_array import read_json_array

__all__ = ["LINE", "RAW", "check_max_samples", "cut_warning", "json_type", "read_rows", "source_row"]

# Private columns of rows read from JSON text: the raw bytes of each row and its line number.
RAW = "__dflash_raw_json__"
LINE = "__dflash_line__"
_RAW_FEATURES = datasets.Features({RAW: datasets.Value("binary"), LINE: datasets.Value("int64")})


def read_rows(
    path: str | Path,
    cache_dir: str | Path | None = None,
    split: str | None = None,
    max_samples: int | None = None,
) -> datasets.Dataset:
    """Read a local JSON Lines, JSON or Parquet file, a dataset directory, or a hub dataset.

    JSON text is not parsed here: each row becomes its raw bytes (and line number), parsed one by
    one when it is encoded, so that one bad line (invalid JSON or UTF-8, a value of another type
    than its neighbours) becomes one rejected row instead of a failed load. A JSON file is either
    one top-level array of rows (held in memory, so prefer JSON Lines for big data) or JSON Lines;
    an array cut short keeps its whole records, with one warning (`json_array`).

    With ``cache_dir``, JSON Lines and Parquet rows are written there as Arrow files and
    memory-mapped (what you want for big inputs and ``num_proc``); without it they are held in
    memory. A directory saved with ``save_to_disk`` is memory-mapped where it is; any other
    directory (a dataset repository cloned from the hub) and a ``path`` that does not exist but
    looks like a hub id (``name`` or ``owner/name``) go through ``datasets.load_dataset`` and its
    own cache. ``split`` picks a split other than ``train`` of a source that has splits;
    ``max_samples`` keeps the first rows only.
    """
    check_max_samples(max_samples)
    rows = _read_source(path, cache_dir, split)
    if max_samples is not None and max_samples < len(rows):
        rows = rows.select(range(max_samples))
    return rows


def _read_source(path: str | Path, cache_dir: str | Path | None, split: str | None) -> datasets.Dataset:
    p = Path(path)
    check_source(path)
    if not p.exists():
        return load_split(str(path), split, hub=True)
    if p.is_dir():
        return _read_dataset_dir(p, split)
    if split not in (None, "train"):
        raise DataError(f"{p} is one file, which has no split {split!r}: leave the split unset")
    suffix = p.suffix.lower()
    if suffix == ".json" and _first_non_space_byte(p) == b"[":
        return _read_array(p)
    if suffix in JSONL_SUFFIXES or suffix == ".json":
        if cache_dir is None:
            rows = list(_iter_jsonl(str(p)))
            return datasets.Dataset.from_list(rows, features=_RAW_FEATURES) if rows else _empty_raw()
        return datasets.Dataset.from_generator(
            _iter_jsonl,
            features=_RAW_FEATURES,
            gen_kwargs={"path": str(p)},
            cache_dir=str(cache_dir),
            fingerprint=sha256_json(["jsonl", source_fingerprint(p), ENCODER_VERSION]),
        )
    if suffix == ".parquet":
        try:
            if cache_dir is None:
                import pyarrow.parquet as pq

                return datasets.Dataset(pq.read_table(p))
            return datasets.Dataset.from_parquet(str(p), cache_dir=str(cache_dir))
        except Exception as e:  # pyarrow raises several unrelated types for a bad file
            raise DataError(f"cannot read Parquet file {p}: {error_text(e)}") from e
    raise DataError(
        f"unsupported data source {p}: expected a .jsonl, .json or .parquet file, a dataset directory "
        "(saved with datasets' save_to_disk, or a dataset repository) or a hub dataset name"
    )


def check_max_samples(max_samples: int | None) -> None:
    """Refuse a ``max_samples`` that is not a positive number of rows (``None`` keeps them all)."""
    if max_samples is not None and (type(max_samples) is not int or max_samples < 1):
        raise DataError(f"max_samples must be a positive number of rows, got {max_samples!r}")


def _read_dataset_dir(p: Path, split: str | None) -> datasets.Dataset:
    if not ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
        return load_split(str(p), split, hub=False)
    try:
        loaded = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"cannot load the saved dataset {p}: {error_text(e)}") from e
    if isinstance(loaded, datasets.DatasetDict):
        return _pick_split(loaded, split, str(p))
    if split not in (None, "train"):
        raise DataError(f"{p} is one saved dataset, which has no split {split!r}: leave the split unset")
    return loaded


def _pick_split(splits: datasets.DatasetDict, split: str | None, where: str) -> datasets.Dataset:
    """The split asked for; unasked, ``train``, or the only split there is."""
    if split is not None:
        if split not in splits:
            raise DataError(f"{where} has no split {split!r}; its splits are {', '.join(sorted(splits))}")
        return splits[split]
    if "train" in splits:
        return splits["train"]
    if len(splits) == 1:
        return next(iter(splits.values()))
    raise DataError(f"{where} holds the splits {', '.join(sorted(splits))} and none is called 'train': pick one")


def _first_non_space_byte(p: Path) -> bytes:
    with open(p, "rb") as f:
        while chunk := f.read(1 << 16):
            stripped = chunk.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()
            if stripped:
                return stripped[:1]
    return b""


_arrays: dict[tuple, datasets.Dataset] = {}
_cuts: dict[tuple, str] = {}  # file version -> the warning it deserves
_warned: set[tuple] = set()


def _file_version(p: Path) -> tuple:
    st = p.stat()
    return str(p.resolve()), st.st_size, st.st_mtime_ns


def cut_warning(p: Path) -> str | None:
    """The warning deserved by the JSON array file ``p`` if this process read it cut short."""
    return _cuts.get(_file_version(p))


def _read_array(p: Path) -> datasets.Dataset:
    """The rows of a JSON array file as raw rows (each record's own bytes), read once per process
    and file version; a file cut short keeps its whole records and warns once (see json_array)."""
    key = _file_version(p)
    if key not in _arrays:
        array = read_json_array(p)
        _arrays.clear()  # one file's rows held at a time
        _arrays[key] = datasets.Dataset.from_dict({RAW: array.records, LINE: [None] * len(array.records)},
                                                  features=_RAW_FEATURES)  # fmt: skip
        if array.cut_at is not None:
            _cuts[key] = array.cut_message(p)
    if key in _cuts and key not in _warned:
        _warned.add(key)
        warnings.warn(_cuts[key], DataWarning, stacklevel=2)
    return _arrays[key]


def _iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """Raw rows of a JSON Lines file: one per non-blank line, with its line number."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if line.strip():
                yield {RAW: line.rstrip(b"\r\n"), LINE: lineno}


def _empty_raw() -> datasets.Dataset:
    return datasets.Dataset.from_dict({RAW: [], LINE: []}, features=_RAW_FEATURES)


def source_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row of `read_rows` as the source wrote it (JSON Lines are kept raw until now)."""
    return _parse_raw(row[RAW], row.get(LINE)) if RAW in row else row


def _parse_raw(raw: bytes, line: int | None) -> dict[str, Any]:
    where = f" (line {line})" if line is not None else ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowRejected(f"invalid UTF-8: {e.reason} at byte {e.start}{where}") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowRejected(f"invalid JSON: {e.msg.removesuffix(' at')} at column {e.colno}{where}") from None
    except ValueError as e:  # e.g. a number too long to convert
        raise RowRejected(f"invalid JSON: {error_text(e)}{where}") from None
    if not isinstance(row, dict):
        raise RowRejected(f"not a JSON object: got {json_type(row)}{where}")
    return row


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for rejection reasons."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number"}
    if value is None:
        return "null"
    return names.get(type(value), "number" if isinstance(value, float) else type(value).__name__)
