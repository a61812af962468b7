"""Files written whole or not at all: what a reader, or a run resumed after a crash, finds is
either the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it, synced, then renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: leave no temporary file behind
        tmp.unlink(missing_ok=True)
        raise
