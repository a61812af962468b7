"""The DSpark drafter's config: a DFlash backbone's geometry, DSpark's heads and its loss weights, and
DeepSpec's config.json of a released DSpark drafter (what vLLM's `dspark` reads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dspark.settings import HEAD_TYPES
from dflash_cache.drafters.serving import FAMILY_KEY

NAME = "dspark"
ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's and vLLM's
BLOCK_SIZE = 7  # the DSpark paper's configs
GAMMA = 4.0  # DeepSpec's loss_decay_gamma
MODELING_SOURCE = Path(__file__).with_name("modeling_dspark.py")
MODELING_FILE = "dspark.py"
AUTO_MAP = {"AutoModel": "dspark.Qwen3DSparkModel"}


@dataclass
class DSparkConfig(DrafterConfig):
    """A DFlash backbone's geometry, DSpark's heads and its loss weights."""

    block_size: int = BLOCK_SIZE
    markov_rank: int = 256  # 0: no Markov head
    markov_head_type: str = "vanilla"
    confidence_head_with_markov: bool = True
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0  # 0: no confidence head
    gamma: float = GAMMA
    num_anchors: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(HEAD_TYPES)}, got {self.markov_head_type!r}")
        if min(self.ce_alpha, self.l1_alpha, self.confidence_alpha) < 0:
            raise ValueError("the loss weights (ce_alpha, l1_alpha, confidence_alpha) must be >= 0")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs the Markov head (markov_rank > 0)")

    @property
    def enable_confidence_head(self) -> bool:
        return self.confidence_alpha > 0

    @property
    def needs_target(self) -> bool:
        """Whether the loss needs the target's distribution (the L1 term or the confidence head)."""
        return self.l1_alpha > 0 or self.enable_confidence_head

    def to_serving_config(self) -> dict:
        """DeepSpec's config.json of a released DSpark drafter (what vLLM's `dspark` reads)."""
        d = super().to_serving_config()
        d.pop("dflash_config")
        d.update({
            "architectures": [ARCHITECTURE], "auto_map": dict(AUTO_MAP), FAMILY_KEY: NAME,
            "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
            "num_anchors": self.num_anchors, "markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.enable_confidence_head and self.confidence_head_with_markov,
            "dspark_loss": {"ce_alpha": self.ce_alpha, "l1_alpha": self.l1_alpha,
                            "confidence_alpha": self.confidence_alpha, "gamma": self.gamma},
        })  # fmt: skip
        return d

    @classmethod
    def from_serving_config(cls, d: dict) -> DSparkConfig:
        """From our export, a DeepSpec checkpoint (the DSpark fields at the top level) or a SpecForge
        one (them in `dflash_config`); the loss weights, which neither records, are the defaults."""
        nested = d.get("dflash_config") or {}

        def get(key: str, default: Any) -> Any:
            return d.get(key, nested.get(key, default))

        base = DrafterConfig.from_serving_config({**d, "dflash_config": {
            "target_layer_ids": get("target_layer_ids", None), "mask_token_id": get("mask_token_id", None)}})
        loss = d.get("dspark_loss") or {}
        confidence = bool(get("enable_confidence_head", float(get("confidence_head_alpha", 0.0) or 0.0) > 0))
        return cls(**{**dataclasses.asdict(base), "block_size": d.get("block_size", BLOCK_SIZE)},
                   markov_rank=int(get("markov_rank", 0) or 0), markov_head_type=get("markov_head_type", "vanilla"),
                   confidence_head_with_markov=bool(get("confidence_head_with_markov", False)),
                   confidence_alpha=loss.get("confidence_alpha", 1.0) if confidence else 0.0,
                   ce_alpha=loss.get("ce_alpha", 0.1), l1_alpha=loss.get("l1_alpha", 0.9),
                   gamma=loss.get("gamma", GAMMA), num_anchors=int(d.get("num_anchors", 512)))  # fmt: skip
