"""What the benchmarks time with: a block's seconds with the device's queued work included, and the
process's peak resident memory."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PeakRSS:
    """Samples this process's resident memory in a thread; `peak` is the largest seen."""

    def __init__(self, every: float = 0.05):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            time.sleep(self.every)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timer(device: torch.device, out: dict, key: str) -> Iterator[None]:
    """out[key]: the block's seconds, the device's work queued in it included."""
    sync(device)
    t = time.perf_counter()
    yield
    sync(device)
    out[key] = time.perf_counter() - t
