"""`dflash demo`: the whole pipeline on the bundled code target and data, in a few minutes on a CPU.

regen (the target continues code prefixes from the Python standard library's training modules)
-> extract -> train -> eval on prefixes from modules the target never saw, for the trained
drafter and for an untrained one of the same shape, so the acceptance length the training bought
is visible. The target is ``data/code-target`` (``data/make_code_target.py``). Every stage is the
library's own; each one resumes if the demo is run again.

The target and the two prefix files are package data, ``dflash_cache/demo_data``: in a checkout its
entries are links to ``data/``, and the wheel holds copies, so an installed ``dflash demo`` runs
from any directory.

The steps are separate functions so that ``benchmarks/quality.py`` runs the same pipeline with other
recipes and storage formats, and the demo's test runs it at the demo's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import read_frozen
from dflash_cache.core.progress import ProgressSink
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.decode import evaluate
from dflash_cache.eval.metrics import EvalResult
from dflash_cache.extract import stage as extract
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.pipelines import regen
from dflash_cache.pipelines.config import DemoConfig
from dflash_cache.train import stage as train
from dflash_cache.train.config import TrainConfig, drafter_config
from dflash_cache.train.fold import save_export


def regenerate(cfg: DemoConfig, sink: ProgressSink | None = None) -> Path:
    """The target's own greedy continuations of the training prefixes (DFlash trains on them)."""
    path = cfg.out / "regen.jsonl"
    regen.run(regen.RegenConfig(target=str(cfg.target), data=str(cfg.data), out=path,
                                max_new_tokens=cfg.regen_tokens, batch_size=cfg.regen_batch,
                                part_rows=max(64, cfg.regen_batch), seed=cfg.seed, gpus=cfg.gpus,
                                max_samples=cfg.rows), sink)  # fmt: skip
    return path


def extract_cache(cfg: DemoConfig, data: Path, storage: str = "auto", sink: ProgressSink | None = None,
                  final_hidden: bool = False) -> tuple[Path, dict[str, Any]]:  # fmt: skip
    """The cache of the regenerated rows (`final_hidden`: with the target's final hidden state,
    which DSpark drafters train on; DFlash trains on the same cache as on one without it)."""
    cache = cfg.out / ("cache" if storage == "auto" else f"cache-{storage}")
    ex = extract.run(ExtractConfig(target=str(cfg.target), data=str(data), out=cache, max_length=2048,
                                   storage=storage, gpus=cfg.gpus, final_hidden=final_hidden),
                     sink)  # type: ignore[arg-type]  # fmt: skip
    return cache, ex


def train_config(cfg: DemoConfig, cache: Path, run_dir: Path) -> TrainConfig:
    return TrainConfig(cache=cache, out=run_dir, epochs=cfg.epochs, lr=cfg.lr, token_budget=cfg.token_budget,
                       max_anchors=cfg.max_anchors, draft_layers=cfg.draft_layers, seed=cfg.seed,
                       gpus=cfg.gpus)  # fmt: skip


def train_drafter(tcfg: TrainConfig, sink: ProgressSink | None = None) -> Path:
    """Train (or resume) and return the serving export."""
    train.run(tcfg, sink)
    return tcfg.out / "export"


def untrained_drafter(tcfg: TrainConfig, out: Path) -> Path:
    """A drafter of the trained one's shape with its seeded initial weights: the tau of no training."""
    if not (out / "config.json").exists():
        torch.manual_seed(tcfg.seed)
        family = tcfg.family()
        dcfg = drafter_config(tcfg, read_spec(tcfg.cache))
        save_export(family, family.model(dcfg), dcfg, out, cache_dir=tcfg.cache, frozen=read_frozen(tcfg.cache))
    return out


def evaluate_drafter(cfg: DemoConfig, drafter: Path, sink: ProgressSink | None = None) -> EvalResult:
    try:
        ecfg = EvalConfig(target=str(cfg.target), drafter=drafter, data=str(cfg.prompts),
                          max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, limit=cfg.eval_prompts)  # fmt: skip
        return evaluate(ecfg, sink, baseline=cfg.baseline)
    finally:  # evaluate leaves its sink open for the caller
        if sink is not None:
            sink.close()


def run(cfg: DemoConfig, say=print, bars: Callable[[str], ProgressSink | None] = lambda stage: None
        ) -> dict[str, Any]:
    """Run every stage into `cfg.out`; returns the two evaluations. `bars(stage)` gives each stage's
    progress sink ("regen", "extract", "train", "eval untrained", "eval trained"), or None."""
    which = "the" if cfg.rows is None else f"the first {cfg.rows}"
    say(f"[1/4] regen: the target continues {which} code prefixes of {cfg.data.name}")
    data = regenerate(cfg, bars("regen"))
    say("[2/4] extract: tapped hidden states -> cache")
    cache, ex = extract_cache(cfg, data, sink=bars("extract"))
    say(f"      {ex['samples']} samples, {ex['tokens']:,} tokens, padding {100 * ex['padding']:.1f}%")
    say(f"[3/4] train: {cfg.epochs} epochs")
    tcfg = train_config(cfg, cache, cfg.out / "run")
    trained = train_drafter(tcfg, bars("train"))
    untrained = untrained_drafter(tcfg, cfg.out / "untrained")
    say(f"[4/4] eval: speculative decoding on {cfg.eval_prompts} prefixes of held-out modules")
    return {name: evaluate_drafter(cfg, drafter, bars(f"eval {name}"))
            for name, drafter in (("untrained", untrained), ("trained", trained))}
