"""Bad inputs through the real `dflash` CLI, each in its own subprocess.

A user error must end in a clear `error:` message naming the problem and exit code 1, with no
Python traceback (plain or rich); a bad row inside a good file must be a counted rejection in
`rejected.jsonl`, not a failure. Every command starts a fresh interpreter (several seconds of
imports), so the module runs the commands concurrently, once, and each test checks one result.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import CHAT, ROOT, TINY_TARGET, jsonl_rows, smollm2_gguf

# One fixture runs every command of the module at once (a few minutes of three CLI processes), whichever
# tests are chosen: the module belongs to the full suite alone.
pytestmark = pytest.mark.slow

ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")},
    "PYTHONPATH": str(ROOT),
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "NO_COLOR": "1",
}
WORKERS = min(4, (os.cpu_count() or 2) + 1)
EXTRACT = ("--max-length", "512", "--unit-mb", "4", "--project", "none")
TRAIN = ("--epochs", "1", "--token-budget", "2048", "--max-anchors", "16", "--draft-layers", "1", "--log-every", "1")
GOOD_ROWS = 80  # about 8K tokens: two 4 MiB units, so one can be broken and the other trained on
BAD_CACHE_CASES = [("info", "not_a_cache"), ("verify", "not_a_cache"), ("train", "not_a_cache"),
                   ("train", "newer_version"), ("info", "corrupt_json")]  # fmt: skip
_TRUNCATED = object()  # stands for the path of the cache with a truncated unit, made once the cache exists
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class Result:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def flat_err(self) -> str:
        """stderr as one line: rich wraps long messages at 80 columns when stderr is a pipe."""
        return " ".join(_ANSI.sub("", self.stderr).split())

    @property
    def error(self) -> str:
        """The text from the first `error:` on, or '' when there is none."""
        err = self.flat_err
        return err[err.index("error:") :] if "error:" in err else ""

    def __str__(self) -> str:
        return (f"$ dflash {' '.join(self.argv)}\nexit {self.rc} after {self.seconds:.1f}s\n"
                f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-5000:]}")  # fmt: skip


def dflash(*args: object, timeout: float = 300) -> Result:
    argv = [str(a) for a in args]
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "cli.main", *argv], env=ENV, cwd=ROOT, capture_output=True,
                       encoding="utf-8", errors="replace", timeout=timeout)  # fmt: skip
    return Result(argv, p.returncode, p.stdout, p.stderr, time.perf_counter() - start)


def assert_no_traceback(r: Result) -> None:
    both = r.stdout + r.stderr
    assert "Traceback" not in both and "╭" not in both, f"a traceback for a user error:\n{r}"


def assert_user_error(r: Result, *needles: str) -> None:
    """Exit 1, no traceback, and an `error:` message that names the problem."""
    assert_no_traceback(r)
    assert r.rc == 1, f"expected exit 1:\n{r}"
    assert r.error, f"no 'error:' line:\n{r}"
    for needle in needles:  # blind to whitespace: rich may break a long path or word across lines
        assert "".join(needle.split()) in "".join(r.error.split()), f"the error does not say {needle!r}:\n{r}"


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

_LONG = "word " * 600  # over --max-length 512 with the tiny target's tokenizer (about 615 tokens)
# (raw JSONL line, what the rejection reason must start with)
BAD_ROWS: list[tuple[bytes, str]] = [
    (b'{"messages": [{"role": "user", "content": "hi"', "invalid JSON"),
    (b'{"text": "caf\xe9 \xff broken bytes"}', "invalid UTF-8"),
    (b"[1, 2, 3]", "not a JSON object"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]}).encode(),
     "wrong type: message 1 content must be a string"),
    (json.dumps({"messages": "hello there"}).encode(), "wrong type: messages must be a list"),
    (json.dumps({"prompt": 3, "response": "three"}).encode(), "wrong type: prompt"),
    (json.dumps({"question": "hi", "answer": "hello"}).encode(), "missing field"),
    (json.dumps({"prompt": "hi"}).encode(), "missing field: a row with prompt needs response"),
    (json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}).encode(),
     "missing field: message 0 has no content"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}).encode(),
     "unknown role"),
    (json.dumps({"messages": []}).encode(), "empty conversation"),
    (json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}).encode(),
     "no assistant turn"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _LONG}]}).encode(),
     "too long"),
]  # fmt: skip


def _good_lines(n: int) -> list[bytes]:
    with open(CHAT, "rb") as f:
        return [line.rstrip(b"\n") for _, line in zip(range(n), f, strict=False)]


def write_mixed(path: Path) -> dict[int, str]:
    """Good rows with every bad row spread among them; returns {source row: expected reason}."""
    lines, expected = _good_lines(GOOD_ROWS), {}
    for i, (raw, reason) in enumerate(BAD_ROWS):
        at = 3 + 5 * i
        lines.insert(at, raw)
        expected[at] = reason
    path.write_bytes(b"\n".join(lines) + b"\n")
    return expected


def unit_samples(unit_dir: Path) -> int:
    return int(json.loads((unit_dir / "zarr.json").read_text())["attributes"]["dflash_unit"]["n_samples"])


# ------------------------------------------------------------------------------------------------
# Every command, run once, concurrently
# ------------------------------------------------------------------------------------------------


@dataclass
class Suite:
    root: Path
    expected_rejections: dict[int, str]
    futures: dict[str, Future]
    wall_start: float

    def __getitem__(self, name: str):
        return self.futures[name].result()

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def paths(self) -> Path:
        """Where the wrong-kind-of-path cases point: a file and an empty directory, nothing else."""
        return self.root / "paths"


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Suite:
    start = time.perf_counter()
    root = tmp_path_factory.mktemp("bad_inputs")
    expected = write_mixed(root / "mixed.jsonl")
    (root / "small.jsonl").write_bytes(b"\n".join(_good_lines(20)) + b"\n")
    (root / "all_bad.jsonl").write_bytes(b"\n".join(raw for raw, _ in BAD_ROWS) + b"\n")
    (root / "empty-dir").mkdir()
    no_template = root / "no-template-target"
    shutil.copytree(TINY_TARGET, no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = no_template / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({k: v for k, v in json.loads(tok_cfg.read_text()).items() if k != "chat_template"}))
    gguf = root / "model.gguf"  # a GGUF checkpoint: converted once by `dflash convert`, never read by a stage
    gguf.write_bytes(b"GGUF" + bytes(60))
    a_file, a_dir = root / "paths" / "a-file", root / "paths" / "a-dir"
    a_dir.mkdir(parents=True)
    a_file.write_text(FILE_TEXT)

    cache, empty = root / "cache", root / "empty-dir"
    futures: dict[str, Future] = {}
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="dflash-cli")

    def submit(name: str, fn: Callable[[], object]) -> None:
        futures[name] = pool.submit(fn)

    def after_cache(fn: Callable[[], object]) -> Callable[[], object]:
        def run():
            build = futures["cache"].result()
            if build.rc != 0:
                pytest.fail(f"the shared cache was not built:\n{build}")
            return fn()

        return run

    def broken_copy(name: str, edit: Callable[[Path], None]) -> Path:
        path = root / name
        shutil.copytree(cache, path)
        edit(path)
        return path

    def newer_version(path: Path) -> None:
        spec = json.loads((path / "cache.json").read_text())
        (path / "cache.json").write_text(json.dumps({**spec, "format_version": 99}))

    def truncate_biggest_unit() -> dict[str, object]:
        path = broken_copy("truncated", lambda p: None)
        samples = {u.name: unit_samples(u) for u in sorted((path / "units").iterdir())}
        bad = max(samples, key=samples.get)  # the biggest unit: what is left trains quickly
        shard = max((f for f in (path / "units" / bad).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        return {"path": path, "bad": bad, "good": sorted(set(samples) - {bad}), "lost": samples[bad],
                "kept": sum(samples.values()) - samples[bad]}  # fmt: skip

    def on_truncated(*args: object) -> Callable[[], Result]:
        return lambda: dflash(*(futures["truncated"].result()["path"] if a is _TRUNCATED else a for a in args))

    # a checkpoint every step of a few (two kept): the damaged-checkpoint cases resume from the one before the last
    skip_run = ("train", "--cache", _TRUNCATED, "--out", root / "run-skip", *TRAIN, "--skip-bad-units",
                "--save-every", "1", "--token-budget", "1024")  # fmt: skip

    def rerun_other_settings() -> Result:
        first = futures["train_skip_bad_units"].result()
        if first.rc != 0:
            pytest.fail(f"the first run failed:\n{first}")
        return on_truncated(*skip_run, "--lr", "0.001")()

    jobs: list[tuple[str, Callable[[], object]]] = []
    extract_cases = {
        "missing_data": ["--data", root / "no-such-file.jsonl"],
        "all_rows_bad": ["--data", root / "all_bad.jsonl"],
        "target_not_a_model": ["--target", empty],
        "no_chat_template": ["--target", no_template],
        "layers_out_of_range": ["--layers", "1,99"],
        "layers_not_numbers": ["--layers", "a,b"],
        "storage_unknown": ["--storage", "int4"],
        "gpus_backwards": ["--gpus", "3-1"],
        "extract_out_is_a_file": ["--out", a_file],
        "extract_kwargs_not_json": ["--chat-template-kwargs", "{enable_thinking: false}"],
        "extract_kwargs_not_object": ["--chat-template-kwargs", "[1, 2]"],
        "mask_token_id_outside": ["--mask-token-id", "99999"],
        "target_gguf": ["--target", gguf],
    }
    if torch.cuda.device_count() == 0:
        extract_cases["gpu_missing"] = ["--gpus", "0"]
    for name, args in extract_cases.items():
        opts = {"--target": TINY_TARGET, "--data": root / "small.jsonl", "--out": root / f"out-{name}"}
        opts.update(dict(zip(args[::2], args[1::2], strict=True)))
        jobs.append((name, lambda opts=opts: dflash("extract", *(x for kv in opts.items() for x in kv), *EXTRACT)))
    # All three commands read cache.json through one function; each kind of bad cache.json is
    # tried with a different command so that every command meets more than one (a command costs
    # seconds of imports).
    for command, kind in BAD_CACHE_CASES:

        def case(command=command, kind=kind):
            if kind == "not_a_cache":
                path = empty
            elif kind == "newer_version":
                path = broken_copy(f"{kind}-{command}", newer_version)
            else:
                path = broken_copy(f"{kind}-{command}", lambda p: (p / "cache.json").write_text('{"target": [\n'))
            if command == "train":
                return dflash("train", "--cache", path, "--out", root / f"run-{kind}", *TRAIN)
            return dflash(command, path)

        jobs.append((f"{command}_{kind}", case if kind == "not_a_cache" else after_cache(case)))
    train = ("train", "--cache", cache, *TRAIN)
    jobs.append(("train_layers_not_cached", after_cache(lambda: dflash(*train, "--out", root / "run-l", "--layers",
                                                                       "0,7"))))  # fmt: skip
    jobs.append(("train_block_size_1", after_cache(lambda: dflash(*train, "--out", root / "run-b", "--block-size",
                                                                  "1"))))  # fmt: skip
    jobs.append(("train_grad_reduce_unknown", after_cache(lambda: dflash(*train, "--out", root / "run-g",
                                                                         "--grad-reduce", "fp8"))))  # fmt: skip
    small = root / "small.jsonl"
    regen = ("regen", "--target", TINY_TARGET, "--data", small, "--max-new-tokens", "4")
    wrong_kind = {
        "regen_out_is_a_dir": (*regen, "--out", a_dir),
        "regen_kwargs_not_object": (*regen, "--out", root / "paths" / "r.jsonl", "--chat-template-kwargs", "true"),
        "regen_target_is_a_file": ("regen", "--target", a_file, "--data", small, "--out", root / "paths" / "r.jsonl"),
        "train_cache_is_a_file": ("train", "--cache", a_file, "--out", root / "paths" / "run", *TRAIN),
        "train_out_is_a_file": ("train", "--cache", cache, "--out", a_file, *TRAIN),
        "export_run_is_a_file": ("export", a_file, root / "paths" / "export"),
        "info_file": ("info", a_file),
        "verify_file": ("verify", a_file),
        "demo_out_is_a_file": ("demo", "--out", a_file),
        "bench_commit_out_is_a_file": ("bench", "commit", a_file),
    }
    jobs += [(name, lambda argv=argv: dflash(*argv)) for name, argv in wrong_kind.items()]

    def eval_lookup_sampling() -> Result:  # a real export, asked to mix lookup into sampling
        first = futures["train_skip_bad_units"].result()
        if first.rc != 0:
            pytest.fail(f"the run to evaluate failed:\n{first}")
        return dflash("eval", "--target", TINY_TARGET, "--drafter", root / "run-skip" / "export", "--data", small,
                      "--lookup", "2", "--temperature", "0.5")  # fmt: skip

    jobs.append(("eval_sets_lookup_not_numbers", lambda: dflash("eval-sets", "--target", TINY_TARGET, "--drafter",
                                                                a_dir, "--data", small, "--lookup", "2,x")))
    jobs.append(("recipe_lookup_twice", lambda: dflash("recipe", "--target", TINY_TARGET, "--out", root / "recipe-l",
                                                       "--lookup", "2,2")))  # fmt: skip
    jobs.append(("demo_no_epochs", lambda: dflash("demo", "--out", root / "demo-0", "--epochs", "0")))
    jobs.append(("demo_no_rows", lambda: dflash("demo", "--out", root / "demo-0", "--rows", "0")))

    def export_out_is_a_file() -> Result:  # a real run, exported onto a file
        first = futures["train_skip_bad_units"].result()
        if first.rc != 0:
            pytest.fail(f"the run to export failed:\n{first}")
        return dflash("export", root / "run-skip", a_file)

    jobs += _damaged_file_jobs(root, futures, on_truncated, skip_run)
    truncated_jobs = [
        ("truncated", after_cache(truncate_biggest_unit)),
        ("train_skip_bad_units", on_truncated(*skip_run)),
        ("verify_truncated", on_truncated("verify", _TRUNCATED)),
        ("train_truncated", on_truncated("train", "--cache", _TRUNCATED, "--out", root / "run-refused", *TRAIN)),
    ]
    # The shared cache doubles as the bad-rows case: good rows with bad ones among them. Order:
    # the cache and jobs that need nothing first, so that no worker waits on the cache; then the
    # longest chain (cache -> truncated unit -> --skip-bad-units run -> rerun); the rest. A job
    # only waits on jobs submitted before it, so the pool cannot deadlock.
    submit("cache", lambda: dflash("extract", "--target", TINY_TARGET, "--data", root / "mixed.jsonl",
                                   "--out", cache, *EXTRACT))  # fmt: skip
    independent = [job for job in jobs if job[0] in extract_cases or job[0] in wrong_kind
                   or job[0].endswith("not_a_cache")]  # fmt: skip
    order = independent[: WORKERS - 1] + truncated_jobs + [job for job in jobs if job not in independent[: WORKERS - 1]]
    for name, fn in order:
        submit(name, fn)
    submit("rerun_other_settings", rerun_other_settings)
    submit("export_out_is_a_file", export_out_is_a_file)
    submit("eval_lookup_sampling", eval_lookup_sampling)
    for name, fn in _after_run_jobs(root, futures, on_truncated, skip_run):
        submit(name, fn)
    pool.shutdown(wait=False)
    return Suite(root, expected, futures, start)


# ------------------------------------------------------------------------------------------------
# Bad rows inside a good file: counted rejections, exit 0
# ------------------------------------------------------------------------------------------------


def test_lookup_needs_greedy_decoding_and_numbers(suite):
    assert_user_error(suite["eval_lookup_sampling"], "--lookup needs greedy decoding")
    assert_user_error(suite["eval_sets_lookup_not_numbers"], "--lookup", "comma-separated whole numbers", "2,x")
    assert_user_error(suite["recipe_lookup_twice"], "--lookup", "distinct values")
    assert not (suite.root / "recipe-l").exists()


def test_bad_rows_are_counted_rejections(suite):
    r = suite["cache"]
    assert_no_traceback(r)
    assert r.rc == 0, f"bad rows must not fail the run:\n{r}"
    assert "error:" not in r.flat_err, str(r)
    n_bad = len(BAD_ROWS)
    assert f"cached {GOOD_ROWS} samples" in r.flat_err and f"{n_bad} rows rejected" in r.flat_err, str(r)
    rejected = jsonl_rows(suite.cache / "rejected.jsonl")
    got = {x["row"]: x["reason"] for x in rejected}
    assert sorted(got) == sorted(suite.expected_rejections), rejected
    for row, reason in suite.expected_rejections.items():
        assert got[row].startswith(reason), (row, got[row], reason)
    spec = json.loads((suite.cache / "cache.json").read_text())
    assert spec["data"]["num_rejected"] == n_bad and spec["data"]["num_rows"] == GOOD_ROWS + n_bad
    assert spec["plan"]["num_samples"] == GOOD_ROWS
    assert spec["plan"]["num_units"] >= 2  # the bad-unit tests below break one unit and train on the rest


# ------------------------------------------------------------------------------------------------
# extract: bad sources, targets and options
# ------------------------------------------------------------------------------------------------


def test_missing_data_file(suite):
    assert_user_error(suite["missing_data"], "data source not found", "no-such-file.jsonl")


def test_every_row_bad_says_why(suite):
    r = suite["all_rows_bad"]
    assert_user_error(r, "every row", "rejected", f"({len(BAD_ROWS)} rows)")
    kinds = {reason.split(":")[0] for _, reason in BAD_ROWS}
    assert any(k in r.error for k in kinds), str(r)


def test_target_not_a_model(suite):
    assert_user_error(suite["target_not_a_model"], "--target", "empty-dir", "not a model directory")


def test_target_without_chat_template(suite):
    assert_user_error(suite["no_chat_template"], "no chat template")


def test_layers_out_of_range(suite):
    assert_user_error(suite["layers_out_of_range"], "--layers", "[99]", "out of range", "8 layers")


def test_layers_not_numbers(suite):
    assert_user_error(suite["layers_not_numbers"], "--layers", "'a,b'", "layer ids")


def test_storage_unknown(suite):
    assert_user_error(suite["storage_unknown"], "--storage", "int4", "auto, bf16, fp8")


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU 0")
def test_gpu_that_does_not_exist(suite):
    assert_user_error(suite["gpu_missing"], "--gpus", "GPU 0 does not exist")


@pytest.mark.parametrize(("name", "flag"), [("demo_no_epochs", "--epochs"), ("demo_no_rows", "--rows")])
def test_demo_refuses_counts_below_one_before_any_stage(suite, name, flag):
    """Refused at once, before regen: 0 epochs would otherwise run every stage and report an
    untrained drafter as the trained one."""
    assert_user_error(suite[name], f"{flag} 0: expected an integer >= 1")
    assert not (suite.root / "demo-0").exists()


def test_gpus_range_backwards(suite):
    assert_user_error(suite["gpus_backwards"], "--gpus", "3-1", "backwards")


def test_a_gguf_target_names_the_convert_command(suite):
    assert_user_error(suite["target_gguf"], "GGUF checkpoint", "dflash convert", "--target OUT")


def test_mask_token_id_outside_the_table(suite):
    assert_user_error(suite["mask_token_id_outside"], "--mask-token-id 99999", "outside", "vocab_size 1536")


@pytest.mark.parametrize("name, needles", [
    ("extract_kwargs_not_json", ("--chat-template-kwargs", "not valid JSON")),
    ("extract_kwargs_not_object", ("--chat-template-kwargs", "must be a JSON object", "list")),
    ("regen_kwargs_not_object", ("--chat-template-kwargs", "must be a JSON object", "bool")),
])  # fmt: skip
def test_template_kwargs_not_an_object(suite, name, needles):
    assert_user_error(suite[name], *needles)


# ------------------------------------------------------------------------------------------------
# Path arguments of the wrong kind: one error line, nothing written
# ------------------------------------------------------------------------------------------------

FILE_TEXT = "a file, not a directory\n"
WRONG_KIND = {
    "extract_out_is_a_file": ("--out", "a-file", "is a file"),
    "regen_out_is_a_dir": ("--out", "a-dir", "is a directory"),
    "regen_target_is_a_file": ("--target", "a-file", "not a model directory"),
    "train_cache_is_a_file": ("a-file", "is a file, not a dflash cache"),
    "train_out_is_a_file": ("--out", "a-file", "is a file"),
    "export_run_is_a_file": ("RUN", "a-file", "is a file"),
    "export_out_is_a_file": ("OUT", "a-file", "is a file"),
    "info_file": ("a-file", "is a file, not a dflash cache"),
    "verify_file": ("a-file", "is a file, not a dflash cache"),
    "demo_out_is_a_file": ("--out", "a-file", "is a file"),
    "bench_commit_out_is_a_file": ("OUT", "a-file", "is a file"),
}


@pytest.mark.parametrize("name", WRONG_KIND)
def test_path_of_the_wrong_kind(suite, name):
    assert_user_error(suite[name], *WRONG_KIND[name])


def test_paths_of_the_wrong_kind_write_nothing(suite):
    for name in [*WRONG_KIND, "regen_kwargs_not_object"]:
        suite[name]  # every case has finished
    assert sorted(p.name for p in suite.paths.iterdir()) == ["a-dir", "a-file"]
    assert (suite.paths / "a-file").read_text() == FILE_TEXT and not any((suite.paths / "a-dir").iterdir())
    assert not (suite.paths / "a-dir.parts").exists()


# ------------------------------------------------------------------------------------------------
# info / verify / train on something that is not a usable cache
# ------------------------------------------------------------------------------------------------


NEEDLES = {
    "not_a_cache": ("empty-dir", "is not a dflash cache", "cache.json"),
    "newer_version": ("format_version", "99", "upgrade"),
    "corrupt_json": ("cache.json", "not JSON"),
}


@pytest.mark.parametrize("command, kind", BAD_CACHE_CASES)
def test_bad_cache_dir(suite, command, kind):
    assert_user_error(suite[f"{command}_{kind}"], *NEEDLES[kind])


# ------------------------------------------------------------------------------------------------
# train: a drafter that does not fit, a run directory of another run
# ------------------------------------------------------------------------------------------------


def test_train_layers_not_in_cache(suite):
    cached = json.loads((suite.cache / "cache.json").read_text())["layers"]["ids"]
    assert_user_error(suite["train_layers_not_cached"], "layers", "[0, 7]", str(cached))


def test_train_block_size_1(suite):
    assert_user_error(suite["train_block_size_1"], "block", "2")


def test_train_grad_reduce_unknown(suite):
    assert_user_error(suite["train_grad_reduce_unknown"], "--grad-reduce", "'fp8'", "fp32 or bf16")
    assert not (suite.root / "run-g").exists()  # refused before anything is written


def test_train_out_holds_other_run(suite):
    assert_user_error(suite["rerun_other_settings"], "other settings", "lr", "0.001")


# ------------------------------------------------------------------------------------------------
# A cache with a truncated shard
# ------------------------------------------------------------------------------------------------


def test_verify_names_truncated_unit(suite):
    broken, r = suite["truncated"], suite["verify_truncated"]
    assert_no_traceback(r)
    assert r.rc == 1, str(r)
    assert f"bad unit {broken['bad']}:" in r.flat_err and "manifest says" in r.flat_err, str(r)
    assert not any(good in r.flat_err for good in broken["good"]), str(r)


def test_verify_failure_has_error_line(suite):
    r = suite["verify_truncated"]
    assert r.rc == 1 and r.error, str(r)


def test_train_refuses_truncated_unit(suite):
    assert_user_error(suite["train_truncated"], suite["truncated"]["bad"], "manifest says")


def test_train_skip_bad_units_reports_dropped_samples(suite):
    broken, r = suite["truncated"], suite["train_skip_bad_units"]
    assert_no_traceback(r)
    assert r.rc == 0, str(r)
    assert "warning:" in r.flat_err and "skipping bad units" in r.flat_err, str(r)
    assert broken["bad"] in r.flat_err and f"({broken['lost']} samples dropped)" in r.flat_err, str(r)
    metrics = jsonl_rows(suite.root / "run-skip" / "metrics.jsonl")
    ends = [m["samples"] for m in metrics if "epoch_end" in m]
    assert ends == [broken["kept"]], (ends, broken)  # one process, one epoch: every sample of the good units
    assert (suite.root / "run-skip" / "export" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------------
# Damaged files: each kind of file a command reads, cut short or of the wrong kind
# ------------------------------------------------------------------------------------------------


def cut(path: Path, keep: int | None = None) -> None:
    """Truncate a file to `keep` bytes (default: half), as a copy or download that stopped does."""
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2 if keep is None else keep)


def _damaged_file_jobs(root: Path, futures: dict[str, Future], on_truncated, skip_run) -> list:
    """Cases that need only the shared cache (or nothing): frozen weights, a GGUF, a regen part."""
    small = root / "small.jsonl"

    def frozen_truncated() -> Result:
        futures["cache"].result()
        path = root / "frozen-cut"
        shutil.copytree(root / "cache", path)
        cut(path / "frozen.safetensors")
        return dflash("train", "--cache", path, "--out", root / "run-frozen", *TRAIN)

    def gguf(name: str, content: bytes) -> Callable[[], Result]:
        def run() -> Result:
            (root / name).write_bytes(content)
            return dflash("convert", root / name, root / f"converted-{name}")

        return run

    def regen_part_damaged() -> Result:
        """A real regen's record and rows as the parts of an interrupted one, the first part cut mid-line."""
        args = ("regen", "--target", TINY_TARGET, "--data", small, "--max-new-tokens", "4", "--part-rows", "5")
        first = dflash(*args, "--out", root / "regen-1.jsonl")
        if first.rc != 0:
            pytest.fail(f"the regen to copy failed:\n{first}")
        parts = root / "regen-2.jsonl.parts"
        parts.mkdir()
        shutil.copy(root / ".regen-1.jsonl.regen.json", parts / "settings.json")
        rows = (root / "regen-1.jsonl").read_bytes().splitlines(keepends=True)[:5]
        (parts / "part-00000.jsonl").write_bytes(b"".join(rows)[:-40])
        return dflash(*args, "--out", root / "regen-2.jsonl")

    def recipe_record_damaged() -> Result:
        out = root / "recipe-damaged"
        out.mkdir()
        (out / "recipe.json").write_text('{"settings": {"target": ')
        return dflash("recipe", "--target", TINY_TARGET, "--out", out)

    with open(smollm2_gguf(), "rb") as f:
        first_mib = f.read(1 << 20)  # a download of the real GGUF that stopped after 1 MiB
    return [("train_frozen_truncated", frozen_truncated),
            ("convert_gguf_cut_short", gguf("cut-short.gguf", first_mib)),
            ("convert_not_a_gguf", gguf("text.gguf", b"a text file named .gguf\n" * 100)),
            ("regen_part_damaged", regen_part_damaged), ("recipe_record_damaged", recipe_record_damaged)]  # fmt: skip


def _after_run_jobs(root: Path, futures: dict[str, Future], on_truncated, skip_run) -> list:
    """Cases on copies of the trained run (run-skip): its export, checkpoints and train.json."""
    small = root / "small.jsonl"

    def copy_of_run(name: str, edit: Callable[[Path], None]) -> Path:
        first = futures["train_skip_bad_units"].result()
        if first.rc != 0:
            pytest.fail(f"the run to copy failed:\n{first}")
        path = root / name
        shutil.copytree(root / "run-skip", path)
        edit(path)
        return path

    def checkpoints(run: Path) -> list[Path]:
        return sorted((run / "checkpoints").glob("step_*.pt"))

    def eval_truncated_export() -> Result:
        run = copy_of_run("run-export-cut", lambda p: cut(p / "export" / "model.safetensors"))
        return dflash("eval", "--target", TINY_TARGET, "--drafter", run / "export", "--data", small,
                      "--max-new-tokens", "4")  # fmt: skip

    def eval_sets_config_damaged() -> Result:
        run = copy_of_run("run-config-cut", lambda p: cut(p / "export" / "config.json"))
        return dflash("eval-sets", "--target", TINY_TARGET, "--drafter", run / "export", "--data", small,
                      "--limit", "1", "--max-new-tokens", "4", "--json-out", root / "eval-sets.json")  # fmt: skip

    def train_resumes_past_damage() -> dict[str, object]:
        run = copy_of_run("run-fallback", lambda p: None)
        newest = checkpoints(run)[-1]
        before = torch.load(newest, weights_only=False)
        cut(newest)
        argv = [run if a == root / "run-skip" else a for a in skip_run]
        return {"result": on_truncated(*argv)(), "newest": newest, "older": checkpoints(run)[-2],
                "before": before, "after": torch.load(newest, weights_only=False)}  # fmt: skip

    def every_checkpoint_cut(name: str) -> Path:
        return copy_of_run(name, lambda p: [cut(c) for c in checkpoints(p)])

    def train_no_checkpoint_loads() -> Result:
        run = every_checkpoint_cut("run-none-loads")
        return on_truncated(*[run if a == root / "run-skip" else a for a in skip_run])()

    def train_run_json_damaged() -> Result:
        run = copy_of_run("run-json-cut", lambda p: cut(p / "train.json"))
        return on_truncated(*[run if a == root / "run-skip" else a for a in skip_run])()

    def export_run_json_damaged() -> Result:  # another kind of file where train.json belongs
        run = copy_of_run("run-json-binary", lambda p: (p / "train.json").write_bytes(b"\x00\xff" * 64))
        return dflash("export", run, root / "export-json")

    return [("eval_truncated_export", eval_truncated_export),
            ("eval_sets_config_damaged", eval_sets_config_damaged),
            ("train_resumes_past_damage", train_resumes_past_damage),
            ("train_no_checkpoint_loads", train_no_checkpoint_loads),
            ("export_no_checkpoint_loads", lambda: dflash("export", every_checkpoint_cut("run-export-none"),
                                                          root / "export-none")),
            ("train_run_json_damaged", train_run_json_damaged),
            ("export_run_json_damaged", export_run_json_damaged)]  # fmt: skip


DAMAGED = {  # case: what its one error line must say (the file, and what to do)
    "train_frozen_truncated": ("frozen-cut/frozen.safetensors", "not a readable safetensors file", "dflash extract"),
    "convert_gguf_cut_short": ("cut-short.gguf", "not a readable GGUF file", "download or copy it again"),
    "convert_not_a_gguf": ("text.gguf", "not a readable GGUF file"),
    "regen_part_damaged": ("part-00000.jsonl", "rerun the same command"),
    "recipe_record_damaged": ("recipe-damaged/recipe.json", "not a readable JSON file", "delete it"),
    "eval_truncated_export": ("run-export-cut/export/model.safetensors", "not a readable safetensors file",
                              "dflash export"),
    "eval_sets_config_damaged": ("run-config-cut/export/config.json", "not a readable JSON file", "dflash export"),
    "train_no_checkpoint_loads": ("no checkpoint in", "run-none-loads/checkpoints loads", "nothing was deleted",
                                  "start the run afresh"),
    "export_no_checkpoint_loads": ("no checkpoint in", "run-export-none/checkpoints loads", "nothing was deleted"),
    "train_run_json_damaged": ("run-json-cut/train.json", "not a readable JSON file", "new --out"),
    "export_run_json_damaged": ("run-json-binary/train.json", "not a readable JSON file"),
}  # fmt: skip


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_file_is_named_in_one_error_line(suite, name):
    r = suite[name]
    assert_user_error(r, *DAMAGED[name])
    lines = [x for x in _ANSI.sub("", r.stderr).splitlines() if x.strip()]
    assert lines[-1].startswith("error:") and sum("error:" in x for x in lines) == 1, str(r)


def test_train_resumes_from_the_checkpoint_before_a_damaged_one(suite):
    case = suite["train_resumes_past_damage"]
    r, newest, older = case["result"], case["newest"], case["older"]
    assert_no_traceback(r)
    assert r.rc == 0, str(r)
    assert f"warning: {newest}" in r.flat_err and "does not load" in r.flat_err, str(r)
    step = int(older.stem.split("_")[1])
    assert f"(step {step}) from {older}" in r.flat_err, str(r)  # resumed from the older one
    assert older.exists()  # nothing deleted
    # it trained on from the older step to the newest again, to the same weights bitwise
    before, after = case["before"], case["after"]
    assert after["step"] == before["step"] > step
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k]), k


# ------------------------------------------------------------------------------------------------
# One line
# ------------------------------------------------------------------------------------------------

USER_ERRORS = ["missing_data", "all_rows_bad", "target_not_a_model", "no_chat_template", "layers_out_of_range",
               "layers_not_numbers", "storage_unknown", "gpus_backwards", "info_not_a_cache", "train_newer_version",
               "info_corrupt_json", "train_layers_not_cached", "target_gguf", "mask_token_id_outside",
               "extract_kwargs_not_json", "extract_kwargs_not_object", "regen_kwargs_not_object",
               *WRONG_KIND]  # fmt: skip


def test_errors_are_one_line_when_piped(suite):
    for name in USER_ERRORS:
        r = suite[name]
        lines = [x for x in _ANSI.sub("", r.stderr).splitlines() if x.strip()]
        assert lines and lines[-1].startswith("error:") and lines[-1].split() == r.error.split(), str(r)
