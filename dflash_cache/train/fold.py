"""The export of a drafter trained on a projected cache: `fc = fc' W` (docs/reference/projection.md).

Training on a projected cache gives `fc'` [H, r] over the stored values `z = W x`. The serving
format (and z-lab's code, vLLM and SGLang) reads `fc` [H, K*H] over the full tapped layers; the
fold writes `fc = fc' W`, which computes on the target's live features exactly what `fc'` computed
on the cache. Every other weight is exported as it is, so both families export through here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from dflash_cache.cache.projection import PROJECTION, Basis
from dflash_cache.cache.spec import CACHE_JSON, CacheSpec, read_spec
from dflash_cache.drafters import Family
from dflash_cache.train.config import TrainError


def folded_config(dcfg: Any) -> Any:
    """The drafter's config as served: fc reads the tapped layers side by side."""
    if dcfg.context_width is None:
        return dcfg
    full = copy.copy(dcfg)
    full.context_width = None
    return full


def folded(model: nn.Module, dcfg: Any, cache_dir: Path, spec: CacheSpec | None = None) -> tuple[nn.Module, Any]:
    """The drafter and its config as served: `model` itself when it reads the tapped layers as they
    are, else a copy whose `fc` reads them, folded through the cache's basis."""
    if dcfg.context_width is None:
        return model, dcfg
    if spec is None:
        if not (Path(cache_dir) / CACHE_JSON).is_file():
            raise TrainError(f"the drafter was trained on the projected cache {cache_dir}, whose basis its export "
                             "folds back into fc, and the cache is gone; restore it (cache.json and "
                             f"{PROJECTION} suffice) to export")  # fmt: skip
        spec = read_spec(cache_dir)
    basis = Basis.load(cache_dir, spec)
    full = folded_config(dcfg)
    weight = model.fc.weight
    fc = nn.Linear(full.fc_inputs, full.hidden_size, bias=False, device=weight.device, dtype=weight.dtype)
    fc.weight.data.copy_(basis.fold(weight, spec.group_positions(dcfg.target_layer_ids)))
    out = copy.deepcopy(model)
    out.fc = fc
    out.config = full
    return out, full


def save_export(family: Family, model: nn.Module, dcfg: Any, out: Path, *, cache_dir: Path,
                spec: CacheSpec | None = None, frozen: Any = None) -> None:  # fmt: skip
    """`family.save_serving` of the drafter as served (`folded`)."""
    model, dcfg = folded(model, dcfg, cache_dir, spec)
    family.save_serving(model, dcfg, Path(out), frozen=frozen)
