"""`CACHE/.heartbeat`: an extract says, to readers on any host, that it is writing the cache.

The extract's lock (`store.cache_lock`, an flock) shows a live extract only on its own host. A
trainer on another node of a shared filesystem sees it through this file instead: while an extract
runs, a thread rewrites it atomically every `INTERVAL` seconds with the writer's host, pid and the
time. A heartbeat younger than `STALE` seconds means the cache is being written; an older one, or
one from a process of this host that is no longer alive, means nothing is writing it. Hosts'
clocks are compared, so they must agree to well within `STALE` (NTP does).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_cache.cache.store import pid_alive
from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.interrupts import held

HEARTBEAT = ".heartbeat"
INTERVAL = 15.0  # seconds between beats
STALE = 90.0  # a heartbeat older than this is from an extract that stopped (or lost the filesystem)


@dataclass(frozen=True)
class Beat:
    """The last heartbeat of a cache's writer."""

    host: str
    pid: int
    age: float  # seconds since it was written, by this host's clock


def _write(cache_dir: Path) -> None:
    beat = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    try:
        write_atomic(Path(cache_dir) / HEARTBEAT, json.dumps(beat) + "\n")
    except OSError:  # a full disk or a vanished directory: the extract itself reports that
        pass


@contextmanager
def beating(cache_dir: Path, interval: float = INTERVAL) -> Iterator[None]:
    """Keep `cache_dir`'s heartbeat fresh while the block runs (a daemon thread). On the way out the
    file is removed if it is still this process's own, so that a finished or failed extract is
    not taken for a running one; another process's beat (a torchrun rank elsewhere) is left."""
    stop = threading.Event()
    _write(cache_dir)

    def run() -> None:
        # Ctrl-C and kills are the main thread's to answer (interrupts.py): never this thread's
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while not stop.wait(interval):
            _write(cache_dir)

    thread = threading.Thread(target=run, name="dflash-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with held():
            stop.set()
            thread.join()
            beat = last_beat(cache_dir)
            if beat is not None and (beat.host, beat.pid) == (socket.gethostname(), os.getpid()):
                (Path(cache_dir) / HEARTBEAT).unlink(missing_ok=True)


def last_beat(cache_dir: Path) -> Beat | None:
    """The heartbeat in `cache_dir`, or None if there is none (or it cannot be read: it is
    replaced atomically, so an unreadable one was not written by an extract)."""
    try:
        d = json.loads((Path(cache_dir) / HEARTBEAT).read_text())
        return Beat(str(d["host"]), int(d["pid"]), time.time() - float(d["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_beat(cache_dir: Path) -> Beat | None:
    """The heartbeat of an extract that is writing `cache_dir` now, from any host, or None."""
    beat = last_beat(cache_dir)
    if beat is None or beat.age > STALE:
        return None
    if beat.host == socket.gethostname() and not pid_alive(beat.pid):
        return None
    return beat
