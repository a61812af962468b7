"""The settings every drafter family takes: the backbone's shape and the objective's sampling and
chunking. A family with settings of its own extends this dataclass in its `settings.py`; the train
stage offers every family's fields as its own (`train/config.py`), so they are flags, config-file
keys and `--set` keys like any other. Light: importing it loads no torch (the CLI reads it)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cache.core.settings import setting


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
