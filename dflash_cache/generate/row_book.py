"""The host's record of the target's rows: which request each holds, what it has committed, and
when it ends (a stop token or its length), so that the row can take the next prompt."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_cache.generate.requests import LENGTH, STOP, Completion, Request, StopRule

ENDED = object()  # a row whose request ended in this step, freed after it


@dataclass
class Row:
    """A request a row holds: its reply so far, each step's accepted count (speculative only)."""

    request: Request
    out: list[int] = field(default_factory=list)
    accepted: list[int] | None = None
    started: float = field(default_factory=time.perf_counter)


class RowBook:
    """`rows[i]`: None (free), the `Row` it holds, or ENDED (its request ended this step, freed by
    `release`). `speculative` rows record each step's accepted count."""

    def __init__(self, slots: int, stop: StopRule, *, speculative: bool) -> None:
        self.rows: list[Row | object | None] = [None] * slots
        self.stop, self.speculative = stop, speculative

    @property
    def live(self) -> int:
        """Rows that hold a request (or ended this step)."""
        return len(self.rows) - self.rows.count(None)

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def start(self, i: int, request: Request) -> None:
        self.rows[i] = Row(request, accepted=[] if self.speculative else None)

    def held(self) -> list[Row | None]:
        """Which request each row holds now (None: none), for a step's result to be matched with."""
        return [r if isinstance(r, Row) else None for r in self.rows]

    def commit(self, i: int, tokens: list[int], *, step: bool) -> Completion | None:
        """Row i commits `tokens` (cut at a stop token and the length limit); returns its
        completion when that ended it."""
        row = self.rows[i]
        kept, stopped = self.stop.cut(tokens, row.request.max_new_tokens - len(row.out))
        row.out.extend(kept)
        if step and row.accepted is not None:
            row.accepted.append(len(kept))
        if not stopped and len(row.out) < row.request.max_new_tokens:
            return None
        self.rows[i] = ENDED
        return Completion(row.request, row.out, STOP if stopped else LENGTH, row.accepted,
                          time.perf_counter() - row.started)  # fmt: skip

    def release(self) -> list[int]:
        """The rows that ended this step, free again."""
        ended = [i for i, r in enumerate(self.rows) if r is ENDED]
        for i in ended:
            self.rows[i] = None
        return ended
