"""Drafter families, registered by name (torchtitan's model registry, for drafters).

Each family is one module that builds a `Family` (base.py: its config, model, objective, useful
FLOPs, serving save and load with its own remote-code file, and its draft head for decoding) and
registers it here. The trainer, validation, metrics, bench and export look a family up by the
name a run records (`dflash train --drafter NAME`, train.json) and never branch on it; a new
family is a new module and one line below.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_cache.drafters.base import FAMILY_KEY, Choose, Family, Output, read_config

_REGISTRY: dict[str, Family] = {}


def register(f: Family) -> Family:
    """Add a family under its name (a second family of the same name is a programming error)."""
    if f.name in _REGISTRY and _REGISTRY[f.name] is not f:
        raise ValueError(f"drafter family {f.name!r} is registered twice")
    _REGISTRY[f.name] = f
    return f


def names() -> list[str]:
    """The registered families' names, in registration order."""
    return list(_REGISTRY)


def family(name: str) -> Family:
    """The family registered under `name` (ValueError naming the known ones otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown drafter family {name!r}; known: {', '.join(_REGISTRY)}") from None


def family_of_export(config: dict) -> str:
    """The family an export's config.json belongs to: its `drafter_family`; else the family whose
    architectures include the config's (a checkpoint of another tool in the family's layout, such
    as DeepSpec's released DSpark drafters); else DFlash, whose z-lab layout has no family field."""
    if FAMILY_KEY in config:
        return str(config[FAMILY_KEY])
    arch = (config.get("architectures") or [None])[0]
    return next((f.name for f in _REGISTRY.values() if arch in f.architectures), "dflash")


def load_serving(path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
                 ) -> tuple[nn.Module, object, Family]:  # fmt: skip
    """Load any family's export: (model, its config, its family). dtype None keeps the file's."""
    f = family(family_of_export(read_config(path)))
    model, cfg = f.load_serving(Path(path), dtype=dtype, device=device)
    return model, cfg, f


from dflash_cache.drafters import dflash as _dflash  # noqa: E402 - the families, registered here
from dflash_cache.drafters import dspark as _dspark  # noqa: E402

for _module in (_dflash, _dspark):
    register(_module.FAMILY)

__all__ = ["Choose", "Family", "Output", "family", "family_of_export", "load_serving", "names", "propose", "register"]
