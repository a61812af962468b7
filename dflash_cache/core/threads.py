"""torch's CPU threads for a worker: its share of this machine's cores, and no more than are idle."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dflash_cache.core.devices import Worker


def idle_cores(interval: float = 0.2) -> float:
    """Cores this machine leaves idle right now (from /proc/stat over `interval` seconds); all of
    them where that cannot be read."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks[:8])  # idle + iowait, all but guest time

    cores = _cores()
    try:
        idle0, total0 = sample()
        time.sleep(interval)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return float(cores)
    return cores * (idle1 - idle0) / max(1, total1 - total0)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(share: int, idle: Callable[[], float] = idle_cores) -> int:
    """torch threads for a CPU worker: its share of the cores (`share` workers on this machine),
    and no more than the cores that are idle when it starts, so that a run beside other busy
    processes does not thrash. On 2 cores beside another busy process, a train with torch's
    default of one thread per core ran at 62 tokens/s and with one thread at 1,273: OpenMP teams
    spin while a member waits for a core (the CLI also makes them sleep instead on a machine
    without GPUs: cli/__init__.py). Never more than the process has; OMP_NUM_THREADS, where
    set, is kept."""
    fair = max(1, min(_cores() // share, torch.get_num_threads()))
    return fair if "OMP_NUM_THREADS" in os.environ else max(1, min(fair, int(idle() + 0.5)))


@contextmanager
def worker_threads(w: Worker, per_gpu: int | None = None, idle: Callable[[], float] = idle_cores) -> Iterator[None]:
    """torch's intra-op CPU threads for one worker while it runs, restored after (a one-process
    run works inside the caller's process). A CPU worker takes `cpu_threads` (the workers on this
    machine split its cores: torchrun's other nodes have their own), and a GPU worker takes at
    most `per_gpu`: where its CPU work is small ops and copies, spinning OpenMP teams of several
    processes only fight over the cores."""
    before = torch.get_num_threads()
    if w.device.type == "cpu":
        torch.set_num_threads(cpu_threads(w.on_this_machine, idle))
    elif w.device.type == "cuda" and per_gpu is not None:
        torch.set_num_threads(min(per_gpu, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)
