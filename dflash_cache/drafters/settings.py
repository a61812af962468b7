"""The settings every drafter family takes: the backbone's shape and the objective's sampling and
chunking. A family with settings of its own extends this dataclass in its `settings.py`; the train
stage offers every family's fields as its own (`train/config.py`), so they are flags, config-file
keys and `--set` keys like any other. Light: importing it loads no torch (the CLI reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_cache.core.settings import setting

# The draft layers' window when none is asked for: the recipe's study on SmolLM2 found a 2,048-token
# window matching or beating full attention on every set, and its step stays O(W) at any context
# (docs/guides/long-context.md); speculators and SpecForge slide at 2,048 too.
DEFAULT_WINDOW = 2048


@dataclass
class DrafterSettings:
    """The backbone's settings: what every family's config and objective read."""

    draft_layers: int = setting(5, "Drafter decoder layers.", min=1)
    block_size: int | None = setting(None, "Block size B (default: the family's, 16 for dflash, 7 for dspark).")
    layers: list[int] | None = setting(None, "Subset of the cached layer ids (default: all cached).",
                                       expects="layer ids like 1,9,17")  # fmt: skip
    max_anchors: int = setting(512, "Anchors sampled per sequence.", min=1)
    gamma: float | None = setting(None, "Loss decay over a block's drafted tokens, exp(-i/gamma) for the i-th "
                                  "(default: dflash 7 for B=16, dspark 4).", tuning=True)  # fmt: skip
    loss_chunk: int = setting(4096, "Block tokens per LM-head chunk of the loss.", min=1, tuning=True)
    sliding_window: int | Literal["full"] | None = setting(
        None, f"Sliding-window draft layers: a block token attends to the context within W positions of its own "
        f"(z-lab's rule), so a block's attention costs O(W) at any context; full: every layer attends to the "
        f"whole context (default: {DEFAULT_WINDOW}; a run begun earlier resumes with the window it began with).",
        min=1)  # fmt: skip
    full_attention_layers: list[int] | None = setting(None, "The draft layers (0-based) that keep full attention "
                                                      "beside the sliding ones (default: none, every layer slides).",
                                                      expects="draft-layer indices like 4 or 0,4")  # fmt: skip

    def window(self) -> int | None:
        """The sliding layers' window: `sliding_window`, DEFAULT_WINDOW when unset, None for full."""
        if self.sliding_window == "full":
            return None
        return DEFAULT_WINDOW if self.sliding_window is None else self.sliding_window

    def layer_types(self) -> list[str] | None:
        """Each draft layer's type for `sliding_window` and `full_attention_layers` ("sliding_attention"
        or "full_attention"), None for full attention everywhere; ValueError naming the flag for
        settings that do not make sense."""
        full = self.full_attention_layers or []
        window = self.window()
        if window is None:
            if full:
                raise ValueError("--full-attention-layers with --sliding-window full: every layer already attends "
                                 "to the whole context")  # fmt: skip
            return None
        if window < 1:
            raise ValueError(f"--sliding-window {window}: expected an integer >= 1 or full")
        wrong = sorted(i for i in set(full) if not 0 <= i < self.draft_layers)
        if wrong:
            raise ValueError(f"--full-attention-layers {','.join(map(str, wrong))}: out of range for "
                             f"{self.draft_layers} draft layers (0-{self.draft_layers - 1})")  # fmt: skip
        if len(set(full)) == self.draft_layers:
            raise ValueError("--full-attention-layers names every draft layer: use --sliding-window full")
        return ["full_attention" if i in full else "sliding_attention" for i in range(self.draft_layers)]


def describe_windows(windows: list[int | None]) -> str:
    """How the draft layers attend (each layer's window, None for full attention), in words for the
    train stage's start-up line: the window is the default, so it is said."""
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not sliding:
        return "full attention (every layer attends to the whole context)"
    window = f"a window of {windows[sliding[0]]:,} tokens"
    if len(sliding) == len(windows):
        return f"every layer slides in {window} (--sliding-window full for none)"
    full = [i for i, w in enumerate(windows) if w is None]
    return f"{_layers(sliding)} in {window}, {_layers(full, 'attends', 'attend')} to the whole context"


def _layers(ids: list[int], one: str = "slides", many: str = "slide") -> str:
    """'layer 0 slides' or 'layers 0,1 slide'."""
    return f"layer {ids[0]} {one}" if len(ids) == 1 else f"layers {','.join(map(str, ids))} {many}"
