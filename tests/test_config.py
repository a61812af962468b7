"""Settings from one place: the config dataclasses' defaults <- config files <- --set <- flags, the
errors that name the key, run records fed back as configs, and the CLI built from the same
dataclasses (no default restated, choices in --help, --print-config, --json)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from helpers import CHAT, ROOT, TINY_TARGET, RecordingSink, jsonl_head
from typer.testing import CliRunner

from cli.main import app
from dflash_cache.cache.spec import CACHE_JSON, write_spec
from dflash_cache.cache.store import FROZEN, cache_lock
from dflash_cache.core import settings
from dflash_cache.core.devices import DeviceError, check_gpus, parse_gpus
from dflash_cache.core.paths import PathKindError
from dflash_cache.core.settings import SettingsError, plain, resolve
from dflash_cache.eval import benchsets
from dflash_cache.eval.config import EvalConfig
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.pipelines.config import RecipeConfig, RecipeError, RegenConfig
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.follow import wait_for_cache

REQUIRED = {
    ExtractConfig: {"target": "t", "data": "d.jsonl", "out": "cache"},
    TrainConfig: {"cache": "cache", "out": "run"},
    RegenConfig: {"target": "t", "data": "d.jsonl", "out": "r.jsonl"},
    EvalConfig: {"target": "t", "drafter": "run/export", "data": "p.jsonl"},
    RecipeConfig: {"target": "t"},
}
COMMANDS = {ExtractConfig: "extract", TrainConfig: "train", RegenConfig: "regen", EvalConfig: "eval",
            RecipeConfig: "recipe"}  # fmt: skip
runner = CliRunner()


def _cli(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda c: c.__name__)
def test_the_cli_takes_every_default_from_the_dataclass(cls):
    """--print-config with only the required flags is the dataclass's own defaults, and every
    setting has a flag that defaults to unset (the CLI restates nothing)."""
    flags = [x for k, v in REQUIRED[cls].items() for x in (f"--{k.replace('_', '-')}", v)]
    r = _cli(COMMANDS[cls], *flags, "--print-config")
    assert r.exit_code == 0, r.output
    printed = yaml.safe_load(r.stdout)
    assert printed == plain(cls(**{k: Path(v) if k in ("out", "cache", "drafter") else v
                                   for k, v in REQUIRED[cls].items()}))  # fmt: skip
    params = {p.name: p for p in next(c for c in _click_app().commands.values() if c.name == COMMANDS[cls]).params}
    for f in fields(cls):
        assert params[f.name].default is None, f"--{f.name} restates a default"


def _click_app():
    import typer.main

    return typer.main.get_command(app)


def test_choices_are_in_help_and_bad_ones_fail_as_one_line():
    r = _cli("extract", "--help")
    assert "[auto|bf16|fp8]" in r.stdout
    assert "[fp32|bf16]" in _cli("train", "--help").stdout
    bad = _cli("train", "--cache", "c", "--out", "o", "--grad-reduce", "fp8")
    assert bad.exit_code == 1
    assert bad.stderr.strip() == "error: --grad-reduce 'fp8': expected fp32 or bf16"


def test_precedence_defaults_files_set_flags(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.json"
    a.write_text("cache: c\nout: o\nlr: 3e-3\nepochs: 2\nlayers: [1, 3]\nseed: 5\n")  # 3e-3: a string to PyYAML
    b.write_text(json.dumps({"epochs": 3, "seed": 6, "grad_reduce": "bf16"}))
    cfg = resolve(TrainConfig, files=[a, b], sets=["seed=7", "token-budget=512", "max_steps=null"],
                  flags={"seed": "8", "follow": False})  # fmt: skip
    assert cfg == TrainConfig(cache=Path("c"), out=Path("o"), lr=0.003, epochs=3, layers=[1, 3], seed=8,
                              grad_reduce="bf16", token_budget=512, follow=False)  # fmt: skip
    assert isinstance(cfg.lr, float) and isinstance(cfg.out, Path)
    # the printed config reads back as the same config
    (tmp_path / "same.yaml").write_text(settings.to_yaml(cfg))
    assert resolve(TrainConfig, files=[tmp_path / "same.yaml"]) == cfg


@pytest.mark.parametrize(("where", "message"), [
    ({"files": {"cache: c\nout: o\nlrr: 1\n"}}, r"--config .*a.yaml: unknown setting 'lrr' \(did you mean lr\?\)"),
    ({"files": {"cache: c\nout: o\nepochs: 2.5\n"}}, r"epochs \(in .*a.yaml\) 2.5: expected an integer >= 1"),
    ({"files": {"cache: c\nout: o\nfollow: maybe\n"}}, r"follow \(in .*a.yaml\) 'maybe': expected true or false"),
    ({"files": {"cache: c\nout: o\nlayers: {a: 1}\n"}}, r"layers \(in .*a.yaml\) \{\"a\": 1\}: expected layer ids"),
    ({"files": {"- 1\n- 2\n"}}, r"expected a mapping of settings, got list"),
    ({"sets": ["lr=fast"]}, r"--set lr 'fast': expected a number >= 0"),
    ({"sets": ["lr"]}, r"--set 'lr': expected KEY=VALUE"),
    ({"flags": {"gpus": "3-1"}}, r"--gpus '3-1': the range 3-1 runs backwards \(write 1-3\)"),
    ({"flags": {"layers": "a,b"}}, r"--layers 'a,b': expected layer ids like 1,9,17"),
    ({"flags": {"grad_reduce": "fp16"}}, r"--grad-reduce 'fp16': expected fp32 or bf16"),
    ({}, r"missing --cache, --out"),
])  # fmt: skip
def test_errors_name_the_key_and_the_expected_type(tmp_path, where, message):
    kwargs = dict(where)
    if "files" in kwargs:
        (tmp_path / "a.yaml").write_text(next(iter(kwargs["files"])))
        kwargs["files"] = [tmp_path / "a.yaml"]
    elif where:
        kwargs["flags"] = {"cache": "c", "out": "o", **kwargs.get("flags", {})}
    with pytest.raises(SettingsError, match=message):
        resolve(TrainConfig, **kwargs)


def test_name_lists_and_a_recipe_record_as_a_config(tmp_path):
    """A list of names (the recipe's families, roots and sets) from a flag, a file or its recipe.json."""
    cfg = resolve(RecipeConfig, flags={"target": "t", "families": "dflash, dspark", "epochs": "6,18"})
    assert (cfg.families, cfg.epochs, cfg.code_roots) == (["dflash", "dspark"], [6, 18], ["stdlib"])
    assert cfg.benchmarks == list(benchsets.DEFAULT_SETS)  # the papers' three sets; long-code is asked by name
    (tmp_path / "a.yaml").write_text("target: t\nfamilies: [dflash, [1]]\n")
    with pytest.raises(SettingsError, match=r"families \(in .*a.yaml\) .*: expected comma-separated names"):
        resolve(RecipeConfig, files=[tmp_path / "a.yaml"])
    (tmp_path / "p.yaml").write_text("target: t\nproject: [auto, 288]\n")  # YAML reads 288 as a number
    assert resolve(RecipeConfig, files=[tmp_path / "p.yaml"]).project == ["auto", "288"]
    (tmp_path / "f.yaml").write_text("target: t\nfamilies: [1]\n")
    with pytest.raises(RecipeError, match="--families: unknown drafter family '1'"):
        resolve(RecipeConfig, files=[tmp_path / "f.yaml"])
    with pytest.raises(SettingsError, match=r"--benchmarks ' , ': expected comma-separated names"):
        resolve(RecipeConfig, flags={"target": "t", "benchmarks": " , "})
    (tmp_path / "recipe.json").write_text(json.dumps({"settings": plain(cfg), "stages": {}}))
    assert resolve(RecipeConfig, files=[tmp_path]) == cfg
    older = {k: v for k, v in plain(cfg).items() if k != "long_rows"}  # recorded before the recipe made long rows
    (tmp_path / "recipe.json").write_text(json.dumps({"settings": older, "stages": {}}))
    assert cfg.long_rows == [600] and resolve(RecipeConfig, files=[tmp_path]).long_rows == [0]
    assert _cli("recipe", "--target", "t", "--families", "dflash,nope").stderr.strip() == (
        "error: --families: unknown drafter family 'nope'; known: dflash, dspark")


def test_template_kwargs_and_missing_config_file(tmp_path):
    with pytest.raises(SettingsError, match=r"--chat-template-kwargs '\{x: 1\}': not valid JSON"):
        resolve(ExtractConfig, flags={**REQUIRED[ExtractConfig], "chat_template_kwargs": "{x: 1}"})
    with pytest.raises(SettingsError, match=r"--chat-template-kwargs \[1\]: must be a JSON object, got list"):
        resolve(ExtractConfig, flags={**REQUIRED[ExtractConfig], "chat_template_kwargs": "[1]"})
    kwargs = '{"enable_thinking": false}'
    cfg = resolve(ExtractConfig, flags={**REQUIRED[ExtractConfig], "chat_template_kwargs": kwargs})
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SettingsError, match="no such file"):
        resolve(TrainConfig, files=[tmp_path / "nope.yaml"])
    with pytest.raises(SettingsError, match="a directory without train.json"):
        resolve(TrainConfig, files=[tmp_path])


def test_a_run_directory_is_a_config(tmp_path):
    """RUN (its train.json, as the train stage writes it) reads back as the run's settings."""
    cfg = TrainConfig(cache=Path("c"), out=tmp_path, lr=3e-3, layers=[1, 2], gpus=None, token_budget=2048
                      ).for_run(None)  # a new run's settings, its window settled, as the stage records them
    (tmp_path / "train.json").write_text(json.dumps({"identity": cfg.identity(), "config": plain(cfg), "drafter": {}}))
    assert resolve(TrainConfig, files=[tmp_path]) == cfg
    assert resolve(TrainConfig, files=[tmp_path / "train.json"], flags={"out": "new"}).out == Path("new")


def test_a_cache_is_a_config_that_makes_the_same_cache(tmp_path):
    """CACHE (its cache.json) reads back as settings whose plan and spec equal the cache's own, so
    feeding it back resumes that cache instead of refusing it."""
    from dflash_cache.extract.stage import prepare

    rows = tmp_path / "rows.jsonl"
    rows.write_text(jsonl_head(CHAT, 12))
    cache = tmp_path / "cache"
    cfg = ExtractConfig(target=str(TINY_TARGET), data=str(rows), out=cache, max_length=512, unit_mb=1,
                        token_budget=512, storage="fp8", zstd_level=5, tokenize_procs=1, max_samples=10,
                        chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    spec = prepare(cfg, write=False).spec
    cache.mkdir()
    write_spec(cache, spec)
    again = resolve(ExtractConfig, files=[cache], flags={"tokenize_procs": "1"})
    assert (again.out, again.storage, again.zstd_level, again.unit_mb, again.max_samples) == (cache, "fp8", 5, 1, 10)
    assert prepare(again, write=False).spec.differences(spec) == []


def test_wait_for_cache_fails_at_once_on_a_typo_and_waits_for_a_live_extract(tmp_path, monkeypatch):
    def no_wait(seconds: float) -> None:
        raise AssertionError(f"it waited ({seconds} s) for a path that does not exist")

    with monkeypatch.context() as m:  # at once: without a single wait, however loaded the machine
        m.setattr(time, "sleep", no_wait)
        with pytest.raises(PathKindError, match="does not exist"):
            wait_for_cache(tmp_path / "typo")
    told = []  # --follow given: the directory may come, for a bounded time, and it says so
    with pytest.raises(PathKindError, match="does not exist after waiting"):
        wait_for_cache(tmp_path / "never", poll=0.05, appear=0.3, on_wait=told.append)
    assert len(told) == 1 and "waiting up to" in told[0]
    later = threading.Timer(0.3, (tmp_path / "later").mkdir)
    later.start()
    wait_for_cache(tmp_path / "later", poll=0.05, appear=30)  # created in time: no cache.json, no extract
    later.join()
    wait_for_cache(tmp_path)  # an existing directory that no extract holds: back at once
    cache = tmp_path / "cache"
    cache.mkdir()

    def extract_writes_its_spec() -> None:
        time.sleep(0.5)
        (cache / FROZEN).write_bytes(b"")
        (cache / CACHE_JSON).write_text("{}")

    with cache_lock(cache):  # an extract that has begun: it holds the lock, no cache.json yet
        writer = threading.Thread(target=extract_writes_its_spec)
        writer.start()
        waited = []
        wait_for_cache(cache, poll=0.05, on_wait=waited.append)
        writer.join()
    assert len(waited) == 1 and "holds its lock" in waited[0] and (cache / CACHE_JSON).exists()


def test_train_with_a_mistyped_cache_fails_at_once(tmp_path):
    t0 = time.monotonic()
    r = _cli("train", "--cache", tmp_path / "typo", "--out", tmp_path / "run")
    assert r.exit_code == 1 and "does not exist" in r.stderr and time.monotonic() - t0 < 10
    assert not (tmp_path / "run").exists()


def test_gpu_ids():
    with pytest.raises(DeviceError, match=r"--gpus '3-1': the range 3-1 runs backwards"):
        parse_gpus("3-1")
    with pytest.raises(DeviceError, match="expected ids and ranges"):
        parse_gpus("a")
    with pytest.raises(DeviceError, match="distinct"):
        check_gpus([0, 0])
    import torch

    n = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=f"GPU {n} does not exist"):
        check_gpus([n])
    assert check_gpus(None) is None


def test_the_cli_starts_without_the_heavy_libraries():
    """Building every command's options imports no torch, transformers, datasets or hub: `dflash
    info` answers fast, and the libraries' progress bars are silenced through their environment
    variables, which they read when they are imported, after the CLI has set them."""
    code = ("import sys, cli.main; print(sorted(m for m in ('torch', 'transformers', 'datasets', 'huggingface_hub') "
            "if m in sys.modules))")  # fmt: skip
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stdout + got.stderr


def test_json_output_is_one_object_on_stdout(tmp_path):
    """extract, info, verify, train and export with --json: stdout is exactly one JSON object (no
    bar, no other line); the human forms print their lines instead."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(jsonl_head(CHAT, 12))
    cache, run = tmp_path / "cache", tmp_path / "run"
    config = tmp_path / "extract.yaml"
    config.write_text(f"target: {TINY_TARGET}\ndata: {rows}\nout: {cache}\nmax_length: 512\nunit_mb: 1\n"
                      "token_budget: 512\ntokenize_procs: 1\nwriters: 1\n")  # fmt: skip
    r = _cli("extract", "--config", config, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    # stderr: only the two notes of the projection basis's fit (what it was fitted on, what it keeps)
    notes = r.stderr.splitlines()
    assert summary["samples"] == 12 and summary["missing_units"] == [] and len(notes) == 2, r.stderr
    assert notes[0].startswith("fitting the projection basis") and notes[1].startswith("fitted the basis")
    assert json.loads(_cli("info", cache, "--json").stdout)["spec"]["data"]["num_rows"] == 12
    r = _cli("verify", cache, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"cache": str(cache), "ok": True, "present_only": False,
                                                         "bad": {}}  # fmt: skip
    r = _cli("train", "--cache", cache, "--out", run, "--epochs", "1", "--draft-layers", "1", "--block-size", "4",
             "--set", "max_anchors=4", "--set", "token_budget=512", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["steps"] > 0
    # notes and warnings still reach stderr: here how the drafter attends, and that this tiny run is
    # too short to generalise
    assert [ln.split(" optimizer steps")[0] for ln in r.stderr.splitlines() if ln.strip()] == [
        "drafter: dflash, 1 layer, every layer slides in a window of 2,048 tokens (--sliding-window full for none)",
        f"warning: this run takes {json.loads(r.stdout)['steps']}"], r.stderr
    r = _cli("export", run, tmp_path / "export", "--json")
    assert json.loads(r.stdout) == {"export": str(tmp_path / "export")}
    r = _cli("verify", cache)
    assert r.stdout == "" and "all units sound" in r.stderr


def test_eval_shows_progress_and_prints_json(tmp_path):
    from test_evaluate import PROMPTS, export_random_drafter

    from dflash_cache.eval.config import EvalConfig
    from dflash_cache.eval.decode import evaluate

    drafter = export_random_drafter(tmp_path / "export", 4)
    sink = RecordingSink()
    result = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=drafter, data=str(PROMPTS), max_new_tokens=6,
                                 limit=3), sink)  # fmt: skip
    assert sink.started == (6, 0) and [d["prompts"] for d in sink.deltas] == [1] * 6 and sink.closed
    assert sink.totals["prompts"] == 6 and sink.totals["tau"] == pytest.approx(result.tau_per_prompt)
    args = ("eval", "--target", TINY_TARGET, "--drafter", drafter, "--data", PROMPTS, "--limit", "1",
            "--max-new-tokens", "4")  # fmt: skip
    r = _cli(*args, "--json")
    assert r.exit_code == 0 and r.stderr == ""
    assert json.loads(r.stdout)["settings"]["prompts"] == 1
    r = _cli(*args)
    assert "tau/prompt" in r.stdout and "2/2 decodes tau" in r.stderr
