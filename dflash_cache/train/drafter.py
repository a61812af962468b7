"""The DFlash drafter under its older import path: the family lives in `dflash_cache.drafters.dflash`
(docs/architecture.md, "Drafter families"). `load_serving` here loads DFlash exports only, and refuses
another family's with a message that says so; `dflash_cache.drafters.load_serving` loads any."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_cache.drafters.base import read_config
from dflash_cache.drafters.dflash import (
    AUTO_MAP,
    INITIALIZER_RANGE,
    MODELING_FILE,
    MODELING_SOURCE,
    DFlashDrafter,
    DrafterConfig,
    save_serving,
)
from dflash_cache.drafters.dflash import load_serving as _load_dflash


def load_serving(
    path: Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported DFlash drafter (ValueError for another family's export)."""
    from dflash_cache.drafters import family_of_export

    name = family_of_export(read_config(path))
    if name != "dflash":
        raise ValueError(f"{path} holds a {name} drafter, and this path decodes DFlash drafters only")
    return _load_dflash(path, dtype=dtype, device=device)


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
