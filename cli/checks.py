"""Arguments refused before any work starts, and before the stage's seconds of imports: a path of the
wrong kind before anything is written, a GPU that does not exist or a data source that is not there
before the data is tokenized."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_paths(*checks: tuple[str, Path, str]) -> None:
    """Each (kind, path, argument) through `dflash_cache.core.paths.<kind>`, e.g. ("output_dir", out, "--out")."""
    from dflash_cache.core import paths

    for kind, path, arg in checks:
        getattr(paths, kind)(path, arg)


def check_gpus(cfg: Any) -> None:
    """The GPUs `cfg.gpus` names exist."""
    from dflash_cache.core.devices import check_gpus as check

    check(cfg.gpus)


def check_data(cfg: Any) -> None:
    """`cfg.data` is on disk or names a hub dataset."""
    from dflash_cache.rows.hub import check_source

    check_source(cfg.data)
