"""The GPU suite's fixtures: the tiny target's prompts, and each family's target, cache and drafters
built on the GPU (once a module)."""

from __future__ import annotations

import family_targets as fam
import pytest
from helpers import ROOT, TINY_TARGET, extract_config
from test_hybrid import write_rows
from transformers import AutoTokenizer

from dflash_cache.extract import stage as extract_stage
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.train import stage as train_stage
from dflash_cache.train.config import TrainConfig

FAMILIES = ("llama3", "qwen3", "gemma", "qwen3_5", "qwen3_5_vl")


@pytest.fixture(scope="module")
def tiny():
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    prompts = load_prompts(ROOT / "data" / "prompts.jsonl", tok, limit=6)
    return tok, prompts


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory) -> dict:
    """A family's tiny target, a --final-hidden cache of its example rows extracted on the GPU,
    and a DFlash and a DSpark drafter trained on it there for a few steps."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = fam.build(family, root / "target")
    data = write_rows(root / "rows.jsonl", fam.example_rows(family))
    cache = root / "cache"
    extract_stage.run(extract_config(cache, target=str(target), data=str(data), unit_mb=1, token_budget=512,
                                     final_hidden=True, gpus=[0]))  # fmt: skip
    exports = {}
    for drafter in ("dflash", "dspark"):
        train_stage.run(TrainConfig(cache=cache, out=root / drafter, drafter=drafter, epochs=2, token_budget=256,
                                    max_anchors=8, draft_layers=1, block_size=4, log_every=1, gpus=[0]))  # fmt: skip
        exports[drafter] = root / drafter / "export"
    prompts = write_rows(root / "prompts.jsonl", [{"prompt": q} for q in fam.QUESTIONS[:3]])
    return {"family": family, "target": target, "cache": cache, "exports": exports, "prompts": prompts}
