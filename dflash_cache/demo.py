"""`dflash demo`: the whole pipeline on the bundled data and tiny target, in a few minutes on a CPU.

regen (the target rewrites the bundled conversations) -> extract -> train -> eval on held-out
prompts, for the trained drafter and for an untrained one of the same shape, so the acceptance
length the training bought is visible. Every stage is the library's own; each one resumes if the
demo is run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_cache import evaluate, regen
from dflash_cache.cache.spec import read_spec
from dflash_cache.extract import stage as extract
from dflash_cache.train import stage as train
from dflash_cache.train.drafter import DFlashDrafter, save_serving

DATA = Path(__file__).resolve().parents[1] / "data"


@dataclass
class DemoConfig:
    out: Path = Path("demo")
    target: Path = DATA / "tiny-target"
    data: Path = DATA / "chat.jsonl"
    prompts: Path = DATA / "prompts.jsonl"
    epochs: int = 4
    draft_layers: int = 2  # a tiny target wants a tiny drafter: 2 layers against its 8
    max_new_tokens: int = 48
    eval_prompts: int = 10
    seed: int = 0


def run(cfg: DemoConfig, say=print) -> dict[str, Any]:
    """Run every stage into `cfg.out`; returns the two evaluations."""
    out = cfg.out
    say(f"[1/4] regen: the target rewrites the assistant turns of {cfg.data.name}")
    regen.run(regen.RegenConfig(target=str(cfg.target), data=str(cfg.data), out=out / "regen.jsonl",
                                max_new_tokens=160, batch_size=64, seed=cfg.seed))  # fmt: skip
    say("[2/4] extract: tapped hidden states -> cache")
    ex = extract.run(extract.ExtractConfig(target=str(cfg.target), data=str(out / "regen.jsonl"), out=out / "cache",
                                           max_length=1024))  # fmt: skip
    say(f"      {ex['samples']} samples, {ex['tokens']:,} tokens, padding {100 * ex['padding']:.1f}%")
    say(f"[3/4] train: {cfg.epochs} epochs")
    tcfg = train.TrainConfig(cache=out / "cache", out=out / "run", epochs=cfg.epochs, lr=3e-3, token_budget=2048,
                             max_anchors=64, draft_layers=cfg.draft_layers, seed=cfg.seed)  # fmt: skip
    train.run(tcfg)
    untrained = out / "untrained"
    if not (untrained / "config.json").exists():
        torch.manual_seed(cfg.seed)
        dcfg = train.drafter_config(tcfg, read_spec(out / "cache"))
        save_serving(DFlashDrafter(dcfg), dcfg, untrained)
    say(f"[4/4] eval: speculative decoding on {cfg.eval_prompts} held-out prompts")
    results = {}
    for name, drafter in (("untrained", untrained), ("trained", out / "run" / "export")):
        results[name] = evaluate.evaluate(str(cfg.target), drafter, cfg.prompts, max_new_tokens=cfg.max_new_tokens,
                                          seed=cfg.seed, limit=cfg.eval_prompts)  # fmt: skip
    return results
