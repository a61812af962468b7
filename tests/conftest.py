"""Shared fixtures: the bundled tiny target and a real cache extracted from the bundled data."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "data" / "tiny-target"
CHAT = ROOT / "data" / "chat.jsonl"


def extract_config(out: Path, **overrides):
    from dflash_cache.extract.config import ExtractConfig

    kwargs = {"target": str(TINY_TARGET), "data": str(CHAT), "out": out, "max_length": 512, "unit_mb": 4,
              "token_budget": 2048, "tokenize_procs": 1}
    kwargs.update(overrides)
    return ExtractConfig(**kwargs)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A complete bf16 cache of the bundled chat data (several units), shared by the session."""
    from dflash_cache.extract.stage import run

    out = tmp_path_factory.mktemp("cache") / "cache"
    run(extract_config(out))
    return out
