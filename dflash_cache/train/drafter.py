"""The DFlash drafter on its own: the DFlash family's model, config and serving export
(`dflash_cache.drafters.dflash`), with a `load_serving` that loads DFlash exports only and refuses
another family's with a message that says so; `dflash_cache.drafters.load_serving` loads any."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_cache.drafters import family_of_export
from dflash_cache.drafters.dflash.config import (
    AUTO_MAP,
    INITIALIZER_RANGE,
    MODELING_FILE,
    MODELING_SOURCE,
    DrafterConfig,
)
from dflash_cache.drafters.dflash.family import load_serving as load_dflash
from dflash_cache.drafters.dflash.family import save_serving
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.drafters.serving import read_config


def load_serving(
    path: Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported DFlash drafter (ValueError for another family's export)."""
    name = family_of_export(read_config(path))
    if name != "dflash":
        raise ValueError(f"{path} holds a {name} drafter, and this path decodes DFlash drafters only")
    return load_dflash(path, dtype=dtype, device=device)


__all__ = [
    "AUTO_MAP",
    "INITIALIZER_RANGE",
    "MODELING_FILE",
    "MODELING_SOURCE",
    "DFlashDrafter",
    "DrafterConfig",
    "load_serving",
    "save_serving",
]
