"""The train stage's settings: one dataclass whose defaults are the CLI's, the config files' and bench's,
and the drafter geometry they imply for a given cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cache.cache.spec import CacheSpec, check_drafter_fits
from dflash_cache.errors import UserError
from dflash_cache.train.drafter import DrafterConfig


class TrainError(UserError, RuntimeError):
    """A training run that cannot start or resume; the message says why."""


@dataclass
class TrainConfig:
    cache: Path
    out: Path
    epochs: int = 6
    max_steps: int | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    token_budget: int | None = None  # packed context tokens per batch per rank; default by device
    grad_accum: int = 1
    grad_reduce: str = "fp32"  # dtype of the DDP gradient all-reduce: fp32, or bf16 for half the bytes
    draft_layers: int = 5
    block_size: int = 16
    layers: list[int] | None = None  # subset of the cached layers; default all
    max_anchors: int = 512
    gamma: float | None = None
    seed: int = 0
    save_every: int = 200
    log_every: int = 10
    gpus: list[int] | None = None
    procs: int = 1
    prefetch: int = 2
    readers: int = 4
    skip_bad_units: bool = False
    loss_chunk: int = 4096
    trace: bool = False  # per-rank JSONL of the samples each step consumed, for audits and tests
    follow: bool = True  # epoch 0 of a cache still being extracted follows it; False: committed units only

    def identity(self) -> dict[str, Any]:
        """What a resume must match: everything that changes the math, not the run's length."""
        keep = ("lr", "warmup", "weight_decay", "clip", "token_budget", "grad_accum", "draft_layers", "block_size",
                "layers", "max_anchors", "gamma", "seed")  # fmt: skip
        # how batches are dealt to ranks (DDP steps of similar cost) changes which samples share a step
        return {**{k: getattr(self, k) for k in keep}, "dealing": "cost-balanced"}


def drafter_config(cfg: TrainConfig, spec: CacheSpec) -> DrafterConfig:
    """The drafter's geometry from the target's config recorded in the cache; refuses misfits."""
    layers = cfg.layers or list(spec.layers.ids)
    if not spec.target.config:
        raise TrainError("cache.json has no target config (target.config): re-extract with this version")
    try:
        dcfg = DrafterConfig.from_target(
            spec.target.config,
            target_layer_ids=layers,
            mask_token_id=spec.tokenizer.mask_token_id,
            num_draft_layers=cfg.draft_layers,
            block_size=cfg.block_size,
        )
    except ValueError as e:  # the drafter's own checks (block size, heads, layer ids)
        raise TrainError(f"drafter settings: {e}") from None
    check_drafter_fits(
        spec,
        layer_ids=layers,
        hidden_size=dcfg.hidden_size,
        vocab_size=dcfg.vocab_size,
        mask_token_id=dcfg.mask_token_id,
    )
    return dcfg
