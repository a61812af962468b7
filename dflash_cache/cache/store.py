"""The cache directory: atomic unit commits, the extract lock, listing, sweeping, frozen weights.

A unit (its content: cache/unit/) is written under `.partial/`, fsynced, and renamed into
`units/` once complete, so a reader never sees a torn unit. One extract holds a cache's lock on a
host; partial units of dead writers are swept on the next start.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cache.cache.spec import StorageInfo
from dflash_cache.cache.unit.write import UnitArrays, write_group
from dflash_cache.core.atomic import replacing, write_atomic
from dflash_cache.core.errors import UserError
from dflash_cache.core.jsonl import dumps_lines

if TYPE_CHECKING:  # torch is imported where it is used: unit writer processes never load it
    import torch

UNITS = "units"
PARTIAL = ".partial"
FROZEN = "frozen.safetensors"
REJECTED = "rejected.jsonl"
LOCK = ".lock"
WORK = ".work"  # tokenized dataset, reused by reruns; safe to delete
_UNIT_RE = re.compile(r"^u(\d{6,})$")


class CacheBusy(UserError, RuntimeError):
    """Another extract holds the cache's lock."""


def unit_name(unit_id: int) -> str:
    return f"u{unit_id:06d}"


def write_unit(cache_dir: Path, unit_id: int, arrays: UnitArrays, storage: StorageInfo) -> int:
    """Write a unit under `.partial/`, fsync it and rename it into `units/`; returns bytes written.

    If the unit is already committed (another writer got there first), the new copy is
    discarded and 0 is returned: a unit id always names the same samples. If writing fails (a full
    disk, say), the partial copy is removed before the error propagates.
    """
    cache_dir = Path(cache_dir)
    name = unit_name(unit_id)
    tmp = cache_dir / PARTIAL / f"{name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        files = write_group(tmp, unit_id, arrays, storage)
        _fsync_tree(tmp)
    except BaseException:
        _remove_failed(tmp)
        raise
    target = cache_dir / UNITS / name
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    _fsync_dir(target.parent)
    return sum(files.values())


def _remove_failed(tmp: Path, settle: float = 0.05, limit: float = 2.0) -> None:
    """Remove a partial unit whose write failed. zarr writes some metadata files concurrently and a
    failed gather does not wait for the others, so a straggler can recreate the directory just
    after it was removed: remove it until it has stayed gone for `settle` seconds."""
    deadline = time.monotonic() + limit
    while True:
        shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(settle)
        if not tmp.exists() or time.monotonic() > deadline:
            return


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


@contextmanager
def cache_lock(cache_dir: Path) -> Iterator[None]:
    """One extract per cache on a host: a second is refused. The OS frees the lock when its holder
    dies, so a crashed run never blocks the rerun."""
    path = Path(cache_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise CacheBusy(f"another dflash extract is writing {cache_dir} (pid {holder}); wait for it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def extract_running(cache_dir: Path) -> bool:
    """Whether an extract on this host holds the cache's lock right now (for status lines)."""
    path = Path(cache_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def committed_units(cache_dir: Path) -> dict[int, Path]:
    """Committed units by id. Only `units/` is looked at: `.partial/` is never read."""
    root = Path(cache_dir) / UNITS
    if not root.is_dir():
        return {}
    out = {}
    for entry in os.scandir(root):
        m = _UNIT_RE.match(entry.name)
        if m and entry.is_dir():
            out[int(m.group(1))] = Path(entry.path)
    return dict(sorted(out.items()))


def sweep_partial(cache_dir: Path) -> int:
    """Remove partial units left by dead writers on this host; returns how many were removed.

    A partial unit of a live process (another extract on the same cache) is left alone, and so is
    one from another host, which this host cannot judge.
    """
    root = Path(cache_dir) / PARTIAL
    if not root.is_dir():
        return 0
    host, removed = socket.gethostname(), 0
    for entry in root.iterdir():
        parts = entry.name.split(".")
        if len(parts) >= 4 and parts[-3] == host and parts[-2].isdigit() and pid_alive(int(parts[-2])):
            continue
        if len(parts) >= 4 and parts[-3] != host:
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_frozen(cache_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
    """Save the target's token embedding and LM head (omitted when tied) atomically."""
    from safetensors.torch import save_file

    path = Path(cache_dir) / FROZEN
    tensors = {"embed_tokens.weight": embed.detach().contiguous().cpu()}
    if lm_head is not None:
        tensors["lm_head.weight"] = lm_head.detach().contiguous().cpu()
    with replacing(path) as tmp:
        save_file(tensors, str(tmp), metadata={"tied": str(lm_head is None).lower()})


def read_frozen(cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen (embedding, LM head) pair; the same tensor twice when the target ties them. A
    damaged file is `DamagedFile`, which says how to have extract write it again."""
    from dflash_cache.core.damage import damaged, load_safetensors

    path = Path(cache_dir) / FROZEN
    fix = f"delete it and rerun the `dflash extract --out {cache_dir}` that made the cache: it writes it again"
    tensors = load_safetensors(path, fix)
    if "embed_tokens.weight" not in tensors:
        raise damaged(path, "frozen weights file", "it has no embed_tokens.weight", fix)
    embed = tensors["embed_tokens.weight"]
    return embed, tensors.get("lm_head.weight", embed)


def write_rejected(cache_dir: Path, rejected: list[tuple[int, str]]) -> None:
    """Record the source rows that were not cached, and why (one JSON object per line)."""
    write_atomic(Path(cache_dir) / REJECTED, dumps_lines({"row": row, "reason": reason}
                                                     for row, reason in rejected))
