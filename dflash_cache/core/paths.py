"""Path arguments of the wrong kind: a file where a directory belongs, or the reverse.

Checked before a command writes anything, so that a mistyped path ends in one line naming the
argument instead of an OSError halfway through (or a directory created beside a file).
"""

from __future__ import annotations

from pathlib import Path

from dflash_cache.core.errors import UserError


class PathKindError(UserError, ValueError):
    """A path argument that names the wrong kind of thing; the message names the argument."""


def output_dir(path: str | Path, arg: str) -> Path:
    """A directory to create or reuse: refuse an existing file, or a file in the way of creating it."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PathKindError(f"{arg} {p} is a file; it must be a directory (new or existing)")
    _parents_are_dirs(p, arg)
    return p


def output_file(path: str | Path, arg: str) -> Path:
    """A file to write: refuse an existing directory, or a file where its parent directory belongs."""
    p = Path(path)
    if p.is_dir():
        raise PathKindError(f"{arg} {p} is a directory; it must be a file path")
    _parents_are_dirs(p, arg)
    return p


def input_dir(path: str | Path, arg: str) -> Path:
    """An existing directory to read."""
    p = Path(path)
    if not p.exists():
        raise PathKindError(f"{arg} {p} does not exist")
    if not p.is_dir():
        raise PathKindError(f"{arg} {p} is a file; it must be a directory")
    return p


def _parents_are_dirs(p: Path, arg: str) -> None:
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise PathKindError(f"{arg} {p}: {parent} is a file, not a directory")
            return
