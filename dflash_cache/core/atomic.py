"""Files written whole or not at all: what a reader, or a run resumed after a crash, finds is
either the old file or the new one, never half of one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def is_temporary(name: str) -> bool:
    """Whether a file name is one of `replacing`'s temporary files (another process's write in flight)."""
    return name.startswith(".") and name.endswith(".tmp")


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; then synced and renamed over `path`.
    On failure (a full disk) no temporary file is left behind and `path` is untouched."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it, synced, then renamed."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
