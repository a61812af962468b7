"""JSON Lines as this program writes and reads them: one JSON value a line, lines cut at "\\n" alone.

Real text holds characters that some line splitters take for line ends: U+2028 and U+2029 (line
and paragraph separators, in ShareGPT's own rows), U+0085 (next line), and the controls \\x0b,
\\x0c and \\x1c-\\x1e. `str.splitlines()` cuts at every one of them, and `json.dumps(...,
ensure_ascii=False)` writes the first three raw (it escapes only the controls below U+0020). So:

- `dumps_line` escapes those three as well, so a line this program writes is one line to any
  reader, `splitlines()`-based or not (the escape is the same JSON string);
- `iter_lines` cuts at "\\n" alone (a trailing "\\r" is dropped), so a file written by another
  tool, with any of them raw inside its strings, reads back whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

# Line ends to splitlines() that json.dumps(ensure_ascii=False) leaves raw, and their JSON escapes.
_RAW_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps_line(value: Any) -> str:
    """`value` as one JSON Lines line, newline included: UTF-8 text kept as it is, except the
    characters other readers would cut a line at, which are escaped."""
    return json.dumps(value, ensure_ascii=False).translate(_RAW_BREAKS) + "\n"


def dumps_lines(values: Iterable[Any]) -> str:
    """Many values as JSON Lines text."""
    return "".join(dumps_line(v) for v in values)


def iter_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every non-blank line of JSON Lines `text`, cut at "\\n" alone."""
    for n, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield n, line
