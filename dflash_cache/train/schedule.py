"""The learning-rate schedule: warmup then cosine, over tokens rather than steps.

Its length is the run's tokens (epochs x the tokens of an epoch), which cache.json gives before the
cache is complete, so a run that follows an extraction and one on the finished cache get the same
schedule, and a resume on another number of ranks continues it. Its state (optimizer steps and
tokens done) is part of every checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_cache.train.config import TrainError


def lr_at(done: float, total: float, warmup: float) -> float:
    """The lr multiplier `done` of `total` tokens into a run: linear warmup over the first `warmup`
    fraction, then cosine decay to zero at `total`."""
    warm = warmup * total
    if done < warm:
        return done / warm
    progress = min(1.0, (done - warm) / max(total - warm, 1e-9))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """Counts the run's optimizer steps and tokens (all ranks' context tokens, as batches report
    them) and gives each step its lr: the peak `lr` times `lr_at` the middle of the step's tokens.
    `total` (tokens of the whole run) is set once the loader's position is known."""

    def __init__(self, lr: float, warmup: float, total: int = 0):
        self.lr, self.warmup, self.total = lr, warmup, total
        self.step = 0
        self.tokens = 0
        self._step_start = 0  # tokens when the current step began

    def consumed(self, tokens: int) -> None:
        self.tokens += tokens

    def next_lr(self) -> float:
        """The lr of the step that ends now; the step is counted."""
        lr = self.lr * lr_at((self._step_start + self.tokens) / 2, self.total, self.warmup)
        self.step += 1
        self._step_start = self.tokens
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "tokens" not in state:
            raise TrainError("the run's checkpoint is from an older dflash-cache (a step-based schedule); "
                             "use a new --out")  # fmt: skip
        self.step, self.tokens = state["step"], state["tokens"]
        self._step_start = self.tokens
