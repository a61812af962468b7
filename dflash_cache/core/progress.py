"""Progress from worker processes to whoever displays it, without the library knowing how.

Workers put small dicts of counters on a multiprocessing queue; a thread in the launching
process sums them and hands each update to a sink (the CLI's progress bar, or nothing).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.queues
import threading
import time
from typing import Any, Protocol

from dflash_cache.core.interrupts import held


class ProgressSink(Protocol):
    def start(self, total: int, done: int) -> None: ...
    def update(self, totals: dict[str, Any], delta: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class Channel(multiprocessing.queues.Queue):
    """The queue workers report to, whose `put` a Ctrl-C never cuts halfway (`held`).

    A single CPU worker runs in the process the user started, so its reports are put from the
    thread that Ctrl-C interrupts. A KeyboardInterrupt raised inside `Queue.put` can leave the
    queue's lock taken; the next put, the Reporter's own at `stop`, then waits for it forever."""

    def __init__(self) -> None:
        super().__init__(ctx=mp.get_context("spawn"))

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        with held():
            super().put(obj, block, timeout)


class Reporter:
    """Owns the queue the workers report to and the thread that drains it."""

    def __init__(self, sink: ProgressSink | None):
        self.sink = sink
        self.channel = Channel()
        self.totals: dict[str, Any] = {}
        self.first_at: float | None = None  # when the first work arrived: start-up ends there
        self._thread: threading.Thread | None = None

    def start(self, total: int, done: int = 0) -> None:
        if self.sink is not None:
            self.sink.start(total, done)
        self._thread = threading.Thread(target=self._drain, name="progress", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (delta := self.channel.get()) is not None:
            if self.first_at is None and delta.get("tokens"):
                self.first_at = time.perf_counter()
            for key, value in delta.items():
                if isinstance(value, (int, float)):
                    self.totals[key] = self.totals.get(key, 0) + value
                else:
                    self.totals[key] = value
            if self.sink is not None:
                self.sink.update(self.totals, delta)

    def stop(self) -> dict[str, Any]:
        with held():  # whole, or the queue's lock and feeder thread can hang the process at exit
            self.channel.put(None)
            if self._thread is not None:
                self._thread.join()
            if self.sink is not None:
                self.sink.close()
        return self.totals
