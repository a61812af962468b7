"""Drafter families, registered by name (torchtitan's model registry, for drafters).

Each family is one package of this folder (`dflash/`, `dspark/`): `settings.py` holds its settings
dataclass (`DrafterSettings` or an extension of it; light, the CLI reads it) and `family.py` builds
its `Family` (base.py: its config, model, objective, useful FLOPs, serving save and load with its
own remote-code file, and its draft head for decoding) from the shared pieces of this folder. The
trainer, validation, metrics, bench and export look a family up by the name a run records
(`dflash train --drafter NAME`, train.json) and never branch on it; a new family is a new package
and its name in `FAMILIES`. This layer sits below the train stage: it imports nothing of it.

Light: importing the registry loads no torch; a family's code loads when it is first looked up.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cache.drafters.base import Choose, Family, Objective, Output, TrainingBatch
from dflash_cache.drafters.settings import DrafterSettings

if TYPE_CHECKING:
    import torch
    from torch import nn

FAMILIES = ("dflash", "dspark")  # the packages of this folder, in the order `names()` lists them


def names() -> list[str]:
    """The registered families' names, in registration order."""
    return list(FAMILIES)


def _known(name: str) -> str:
    if name not in FAMILIES:
        raise ValueError(f"unknown drafter family {name!r}; known: {', '.join(FAMILIES)}")
    return name


def settings(name: str) -> type[DrafterSettings]:
    """The settings dataclass of the family registered under `name`, without loading its code."""
    return import_module(f"{__name__}.{_known(name)}.settings").SETTINGS


def family(name: str) -> Family:
    """The family registered under `name` (ValueError naming the known ones otherwise)."""
    return import_module(f"{__name__}.{_known(name)}.family").FAMILY


def family_of_export(config: dict) -> str:
    """The family an export's config.json belongs to: its `drafter_family`; else the family whose
    architectures include the config's (a checkpoint of another tool in the family's layout, such
    as DeepSpec's released DSpark drafters); else DFlash, whose z-lab layout has no family field."""
    from dflash_cache.drafters.serving import FAMILY_KEY

    if FAMILY_KEY in config:
        return str(config[FAMILY_KEY])
    arch = (config.get("architectures") or [None])[0]
    return next((name for name in FAMILIES if arch in family(name).architectures), "dflash")


def load_serving(path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
                 ) -> tuple[nn.Module, object, Family]:  # fmt: skip
    """Load any family's export: (model, its config, its family). dtype None keeps the file's."""
    from dflash_cache.drafters.serving import read_config

    f = family(family_of_export(read_config(path)))
    model, cfg = f.load_serving(Path(path), dtype=dtype, device=device)
    return model, cfg, f


__all__ = ["FAMILIES", "Choose", "DrafterSettings", "Family", "Objective", "Output", "TrainingBatch", "family",
           "family_of_export", "load_serving", "names", "settings"]  # fmt: skip
