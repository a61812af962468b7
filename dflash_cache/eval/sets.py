"""`dflash eval-sets`: tau and the speedup of drafters on the benchmark sets (`benchsets`), the
evaluation `dflash recipe` ends with.

It runs `dflash eval` for each drafter on each set (HumanEval, MT-Bench, the ShareGPT hold-out, the
long-code prompts, or any prompt file), the target alone once a set, at batch 1 by default: the
single-stream speedup the DFlash paper reports. Each run's tau is also reported by the prompts'
length (``by_context``, `metrics.context_figures`), one set at a time: pooling sets would mix what
they ask with how long it is. It sits with the apps, not in `generate/`, since it drives
`evaluate`. On a GPU, the result also sets the target alone against its memory-bandwidth bound
(`bench.generate`).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.damage import read_json
from dflash_cache.core.progress import ProgressSink
from dflash_cache.eval.config import CODE_ROOTS, EvalConfig, EvalSetsConfig, lookup_list_problem
from dflash_cache.eval.decode import EvalError, check_config, evaluate
from dflash_cache.eval.replay import replayed
from dflash_cache.generate import load_model
from dflash_cache.generate.bandwidth import copy_bandwidth, weight_bytes


def untrained_like(export: Path, out: Path, seed: int = 0) -> Path:
    """A drafter of an export's family and shape with seeded random weights: the tau of no training."""
    from dflash_cache import drafters

    _, config, family = drafters.load_serving(export)
    torch.manual_seed(seed)
    family.save_serving(family.model(config), config, out)
    return out


def run(cfg: EvalSetsConfig, drafters: Sequence[Path], data: Sequence[str] = (),
        bars: Callable[[str], ProgressSink | None] | None = None) -> dict[str, Any]:  # fmt: skip
    """`dflash eval-sets`: the `evaluation` of `drafters`, each named by its directory (the run's, for
    RUN/export), and with `cfg.untrained` a drafter of the first one's shape with random weights, on
    `cfg.benchmarks` (`benchsets.DEFAULT_SETS` when neither they nor `data` are given) and the prompt
    files `data`; the result is also written to `cfg.json_out`."""
    from dflash_cache.eval import benchsets
    from dflash_cache.rows.chat import check_template_kwargs

    if not drafters:
        raise EvalError("no drafter to evaluate: give --drafter RUN/export (repeatable)")
    kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    sets = [*(cfg.benchmarks or ([] if data else benchsets.DEFAULT_SETS)), *data]
    runs = {d.name if d.name != "export" else d.parent.name: d for d in drafters}
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.untrained:
            runs["untrained"] = untrained_like(drafters[0], Path(tmp) / "untrained")
        return evaluation(cfg.target, runs, sets, max_new_tokens=cfg.max_new_tokens, limit=cfg.limit,
                          batch_size=cfg.batch_size, first_turn=cfg.first_turn, temperature=cfg.temperature,
                          chat_template_kwargs=kwargs or None, replay=cfg.replay, lookup=cfg.lookup,
                          code_roots=cfg.code_roots, out=cfg.json_out, bars=bars)  # fmt: skip


def evaluation(target: str, drafters: dict[str, Path], sets: list[str], *,
               max_new_tokens: int = EvalSetsConfig.max_new_tokens, limit: int | None = None,
               batch_size: int | None = EvalSetsConfig.batch_size, first_turn: bool = False,
               temperature: float = 0.0, chat_template_kwargs: dict | None = None, replay: bool = False,
               lookup: Sequence[int] = (0,), code_roots: Sequence[str] = CODE_ROOTS, out: Path | None = None,
               bars: Callable[[str], ProgressSink | None] | None = None
               ) -> dict[str, Any]:  # fmt: skip
    """`dflash eval` of each drafter on each set (`benchsets.resolve`: a named set or a prompt file),
    the target alone once a set (with the first drafter's run), and each run's speedup over it.
    `bars(label)` gives a progress sink for each run. The result, also written to `out` as JSON, has
    a row for each set and run (``table``) and every run's figures (``sets``), by context length
    too (``by_context``). A measured set (long-code) is made from the held-out modules of
    `code_roots` and cut with the target's tokenizer.

    `lookup`: each drafter runs once for each value, as `EvalConfig.lookup` (0: the drafter alone,
    named as given; N: prompt lookup mixed in, named "NAME + lookup N"), in that order.

    `replay` (greedy only): the drafters after the first are not decoded with; their tau comes from
    replaying the first run's outputs (`replay.replayed`), in seconds instead of a decode each, and
    they have no speed figures.

    With `out`, each set's figures are also kept as it ends in OUT's `.partial.json` sibling, so an
    evaluation that is interrupted and run again with the same target, drafters and settings
    measures only the sets it had not finished (``seconds`` counts both runs)."""
    from dflash_cache.eval import benchsets
    from dflash_cache.eval.long_code import Measure

    t0 = time.perf_counter()
    if replay and temperature != 0:  # before any set is decoded, not after the first drafter's run
        raise EvalError("--replay needs greedy decoding (temperature 0)")
    if problem := lookup_list_problem(lookup):
        raise EvalError(problem)
    settings = {"max_new_tokens": max_new_tokens, "limit": limit, "batch_size": batch_size, "first_turn": first_turn,
                "temperature": temperature, "chat_template_kwargs": chat_template_kwargs}  # fmt: skip
    runs = {name if n == 0 else f"{name} + lookup {n}": (drafter, n) for name, drafter in drafters.items()
            for n in lookup}  # fmt: skip
    for drafter, n in runs.values():  # every run's settings, before the first set is decoded
        check_config(EvalConfig(target=target, drafter=drafter, data="", lookup=n, **settings))
    result: dict[str, Any] = {"target": target, **settings, "replay": replay, "lookup": list(lookup),
                              "code_roots": list(code_roots),
                              "drafters": {k: str(v) for k, v in drafters.items()},
                              "sets": {}, "table": []}  # fmt: skip
    partial = None if out is None else out.with_name(f"{out.stem}.partial.json")
    finished, before = _finished(partial, result)
    with tempfile.TemporaryDirectory() as tmp:
        measure = Measure(target, chat_template_kwargs)  # loads the tokenizer only for a measured set
        resolved = [benchsets.resolve(name, Path(tmp), measure, code_roots, limit) for name in sets]  # before decoding
        for label, rows, about in resolved:
            if label in finished:
                one = result["sets"][label] = finished[label]
            else:
                configs = {name: EvalConfig(target=target, drafter=drafter, data=str(rows), lookup=n, **settings)
                           for name, (drafter, n) in runs.items()}  # fmt: skip
                one = result["sets"][label] = about | _one_set(label, configs, bars, replay)
                if partial is not None:
                    seconds = before + time.perf_counter() - t0
                    write_atomic(partial, json.dumps(result | {"seconds": seconds}, indent=2) + "\n")
            result["table"] += [{"set": label, "run": name, **_table_row(f)} for name, f in one["runs"].items()]
    result["seconds"] = before + time.perf_counter() - t0
    result |= _bound(target, batch_size or 1)
    if out is not None:
        write_atomic(out, json.dumps(result, indent=2) + "\n")
        partial.unlink(missing_ok=True)
    return result


def _finished(partial: Path | None, asked: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The sets an interrupted evaluation of the same target, drafters and settings left in
    `partial`, and its seconds; nothing for another evaluation's."""
    if partial is None or not partial.is_file():
        return {}, 0.0
    kept = read_json(partial, "delete it to evaluate every set again (it keeps the sets an interrupted run finished)")
    same = json.loads(json.dumps({k: v for k, v in asked.items() if k not in ("sets", "table")}))
    if any(kept.get(k) != v for k, v in same.items()):
        return {}, 0.0
    return kept["sets"], kept["seconds"]


def _one_set(label: str, configs: dict[str, EvalConfig], bars: Callable[[str], ProgressSink | None] | None,
             replay: bool = False) -> dict[str, Any]:  # fmt: skip
    """Each drafter's run on one set, and the target alone's (measured with the first); with
    `replay`, the others replayed on the first run's outputs."""
    runs: dict[str, Any] = {}
    first = None
    for i, (name, cfg) in enumerate(configs.items()):
        if first is not None and replay:
            r = replayed(cfg, first)
        else:
            r = evaluate(cfg, bars(f"{label} {name}") if bars else None, baseline=i == 0)
        if i == 0:
            first = r
            seconds, tokens = r.settings["target_seconds"], r.settings["target_new_tokens"]
            prefill = r.settings["target_prefill_seconds"]
            alone = {"tok_s": r.target_tok_s, "seconds": seconds, "new_tokens": tokens, "prefill_seconds": prefill,
                     "ms_per_token": 1e3 * seconds / tokens if tokens else None,
                     "ms_per_token_without_prefill": 1e3 * (seconds - prefill) / tokens if tokens else None,
                     "decode_tok_s": _rate(tokens, seconds - prefill)}  # fmt: skip
            lookup = r.lookup
        runs[name] = _run_figures(r, alone)
    baselines = {"prompt lookup": lookup} if lookup else {}
    return {"prompts": r.settings["prompts"], "turn_prompts": r.settings["turn_prompts"], "rejected": r.rejected,
            "batch_size": r.settings["batch_size"], "runs": runs | baselines | {"target alone": alone}}  # fmt: skip


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _run_figures(r, alone: dict[str, Any]) -> dict[str, Any]:
    """A drafter's figures on one set: taus (overall and by turn), histogram, speed and speedup, and
    the milliseconds a speculative step takes, each prompt's prefill included (the speedup is about
    pooled tau times the target alone's ms_per_token over it) and left out (`decode_speedup`: the
    decode's tokens/s over the target alone's, prefills left out, as z-lab's benchmark times it)."""
    figures = {k: getattr(r, k) for k in ("tau", "tau_per_prompt", "histogram", "steps", "new_tokens", "spec_tok_s",
                                          "by_context")}  # fmt: skip
    if r.settings.get("replayed"):  # not decoded: acceptance only
        unmeasured = ("seconds", "spec_tok_s", "ms_per_step", "prefill_seconds", "ms_per_step_without_prefill",
                      "same_as_target", "differ_from_target", "differ_by_turn", "first_differences", "speedup",
                      "decode_speedup")  # fmt: skip
        return figures | {"turns": r.turns, "replayed": True} | dict.fromkeys(unmeasured)
    seconds, prefill = r.settings["spec_seconds"], r.settings["spec_prefill_seconds"]
    return figures | {"seconds": seconds, "turns": r.turns, "ms_per_step": 1e3 * seconds / r.steps if r.steps else None,
                      "prefill_seconds": prefill,
                      "ms_per_step_without_prefill": 1e3 * (seconds - prefill) / r.steps if r.steps else None,
                      "same_as_target": all(s["same_as_target"] is not False for s in r.samples),
                      "differ_from_target": sum(s["same_as_target"] is False for s in r.samples),  # prompts (turns)
                      "differ_by_turn": [sum(s["same_as_target"] is False for s in r.samples if s["turn"] == t["turn"])
                                         for t in r.turns],  # fmt: skip
                      "first_differences": sorted(s["first_difference"] for s in r.samples
                                                  if s["first_difference"] is not None),  # fmt: skip
                      "speedup": _ratio(r.spec_tok_s, alone["tok_s"]),
                      "decode_speedup": _ratio(_rate(r.new_tokens, seconds - prefill),
                                               alone["decode_tok_s"])}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _table_row(f: dict[str, Any]) -> dict[str, Any]:
    """The printed tables' columns of one run: the target alone has speed only, prompt lookup
    acceptance only (it is computed from the greedy outputs, not run)."""
    if "turns" not in f:
        return {"tau_per_prompt": None, "tau": None, "tau_by_turn": None, "tau_by_context": None, "tok_s": f["tok_s"],
                "speedup": 1.0, "decode_speedup": 1.0}  # fmt: skip
    by_turn = [t["tau_per_prompt"] for t in f["turns"]] if len(f["turns"]) > 1 else None
    by_context = {k: b["tau_per_prompt"] for k, b in f.get("by_context", {}).items()}  # none in an older result
    return {"tau_per_prompt": f["tau_per_prompt"], "tau": f["tau"], "tau_by_turn": by_turn,
            "tau_by_context": by_context, "tok_s": f.get("spec_tok_s"), "speedup": f.get("speedup"),
            "decode_speedup": f.get("decode_speedup")}  # fmt: skip


def _bound(target: str, batch: int) -> dict[str, Any]:
    """On a GPU: the bandwidth, the target's weight bytes and the target alone's bound at `batch`."""
    if not torch.cuda.is_available():
        return {}
    device = torch.device("cuda")
    model = load_model(target, device)
    bw, weights = copy_bandwidth(device), weight_bytes(model)
    return {"bandwidth_GBps": bw / 1e9, "weight_GB": weights / 1e9, "target_alone_bound_tok_s": batch * bw / weights}
