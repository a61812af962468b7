"""The demo's promise: a drafter trained on the cache accepts clearly more than an untrained one."""

import torch
from conftest import ROOT, TINY_TARGET

from dflash_cache.cache.spec import read_spec
from dflash_cache.evaluate import evaluate
from dflash_cache.train.config import TrainConfig, drafter_config
from dflash_cache.train.drafter import DFlashDrafter, save_serving
from dflash_cache.train.stage import run


def test_trained_drafter_beats_untrained(tiny_cache, tmp_path):
    cfg = TrainConfig(cache=tiny_cache, out=tmp_path / "run", epochs=3, lr=3e-3, token_budget=2048, max_anchors=64,
                      draft_layers=2, seed=0)  # fmt: skip
    run(cfg)
    torch.manual_seed(0)
    dcfg = drafter_config(cfg, read_spec(tiny_cache))
    save_serving(DFlashDrafter(dcfg), dcfg, tmp_path / "untrained")
    prompts = ROOT / "data" / "prompts.jsonl"
    trained = evaluate(str(TINY_TARGET), tmp_path / "run" / "export", prompts, max_new_tokens=32, limit=8)
    untrained = evaluate(str(TINY_TARGET), tmp_path / "untrained", prompts, max_new_tokens=32, limit=8)
    # measured with these seeds: untrained 1.000, trained 1.231
    assert untrained.tau < 1.05
    assert trained.tau > untrained.tau + 0.1, (trained.tau, untrained.tau)
