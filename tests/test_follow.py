"""Follow mode: `dflash train` on a cache that `dflash extract` is still writing, both running as
real processes at once (as a user starts them on one node).

Coverage is read from the trainer's per-rank sample log (`--trace`), compared with the samples
the finished cache holds; the trainer's waiting is observed from outside (its log stops growing
while the extraction is paused, then grows again). An extraction is paused or killed at a unit
the test chooses (`helpers.UnitStop`: it stops itself there), never by a signal raced against it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import CHAT, ROOT, TINY_TARGET, UnitStop, as_from_a_terminal, jsonl_head, jsonl_rows

from dflash_cache.cache.heartbeat import HEARTBEAT, STALE
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import committed_units, extract_running, unit_name
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.train.checkpoint import Checkpointer

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}  # a hung command's stacks: _wait_or_dump
ROWS = 200


def _data(tmp: Path) -> Path:
    path = tmp / "rows.jsonl"
    path.write_text(jsonl_head(CHAT, ROWS))
    return path


def _start(log: Path, *args: str, env: dict[str, str] = ENV) -> subprocess.Popen:
    """A CLI command in its own process group, so signals reach its worker processes too; its
    output goes to `log` (a file: the test reads it while the command runs, and never blocks it)."""
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "cli.main", *args], env=env, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _extract(data: Path, cache: Path, project: str = "none", env: dict[str, str] = ENV) -> subprocess.Popen:
    return _start(cache.parent / "extract.log", "extract", "--target", str(TINY_TARGET), "--data", str(data),
                  "--out", str(cache), "--max-length", "512", "--unit-mb", "1", "--token-budget", "512",
                  "--project", project, env=env)  # fmt: skip


def _extract_started(data: Path, cache: Path, env: dict[str, str] = ENV) -> subprocess.Popen:
    """The extraction, once it holds the cache directory: train refuses a --cache that does not
    exist (a typo must not wait), and waits for one that an extract is preparing."""
    proc = _extract(data, cache, env=env)
    _wait_for(lambda: extract_running(cache) or (cache / "cache.json").exists() or proc.poll() is not None,
              what="the extraction to start")  # fmt: skip
    return proc


def _train(cache: Path, run: Path, *extra: str) -> subprocess.Popen:
    return _start(run.parent / "train.log", "train", "--cache", str(cache), "--out", str(run), "--token-budget",
                  "512", "--max-anchors", "4", "--draft-layers", "1", "--block-size", "4", "--log-every", "1",
                  "--save-every", "2", "--trace", *extra)  # fmt: skip


def _signal(proc: subprocess.Popen, sig: int) -> None:
    os.killpg(proc.pid, sig)


def _wait_or_dump(proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Wait for a process that was told to stop; if it hangs, fail with every thread's stack (the
    CLI commands here run with PYTHONFAULTHANDLER, which SIGABRT makes write them to the log)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGABRT)
        proc.wait(timeout=30)
        pytest.fail(f"still running {timeout:.0f} s after it was stopped; its threads:\n{log.read_text()[-12000:]}")


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> str:
    proc.wait(timeout=timeout)
    out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    return out


def _wait_for(cond, timeout: float = 120, what: str = "") -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


def _committed_samples(cache: Path) -> set[int]:
    return {int(s) for path in committed_units(cache).values() for s in UnitReader(path).sample_index}


def _trace(run: Path, rank: int = 0) -> list[dict]:
    path = run / "trace" / f"rank{rank}.jsonl"
    return jsonl_rows(path) if path.exists() else []


def _epoch_samples(run: Path, epoch: int, rank: int = 0) -> list[int]:
    return [s for x in _trace(run, rank) if x.get("epoch") == epoch and "samples" in x for s in x["samples"]]


def _epoch_ends(run: Path) -> dict[int, dict]:
    records = jsonl_rows(run / "metrics.jsonl")
    return {r["epoch_end"]: r for r in records if "epoch_end" in r}


@pytest.mark.slow  # a CLI extract and train side by side
def test_train_follows_a_paused_and_resumed_extraction(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    log = tmp_path / "train.log"
    # Started first, with --follow: it waits for the extract to create the directory, then for
    # cache.json while the extract holds the lock (a projected cache writes it once its basis is
    # fitted), and says what it waits for while paused.
    trainer = _train(cache, run, "--epochs", "2", "--follow", "--wait-report", "1")
    extract = None
    try:
        _wait_for(lambda: "waiting up to 120s for `dflash extract` to create" in log.read_text()
                  or trainer.poll() is not None, what="the trainer to wait for the cache directory")  # fmt: skip
        assert trainer.poll() is None, log.read_text()
        # A projected cache (the default) of 2 units; the extraction pauses itself (SIGSTOP to its
        # process group) once the first is committed.
        pause = UnitStop(tmp_path, units=1)
        extract = _extract(_data(tmp_path), cache, "auto", env=pause.env(ENV))
        pause.wait(extract)
        stopped_at = len(committed_units(cache))
        assert stopped_at == 1 < read_spec(cache).plan.num_units

        # The trainer consumes what is committed, then waits: its log stops growing.
        have = _committed_samples(cache)
        _wait_for(lambda: set(_epoch_samples(run, 0)) == have, what="the trainer to consume the committed units")
        seen = len(_trace(run))
        time.sleep(2.0)
        assert trainer.poll() is None and len(_trace(run)) == seen, "the trainer moved on without new units"
        _wait_for(lambda: "waiting for units: " in log.read_text(), what="the trainer to say what it waits for")
        assert len(committed_units(cache)) == stopped_at

        _signal(extract, signal.SIGCONT)
        _finish(extract, tmp_path / "extract.log")
        out = _finish(trainer, log)
    finally:
        for p in (extract, trainer):
            if p is not None and p.poll() is None:
                _signal(p, signal.SIGCONT)
                _signal(p, signal.SIGKILL)
    assert "units" in out and "committed" in out  # the follow status line was shown
    assert f"waiting up to 120s for `dflash extract` to create {cache}" in out
    assert "waiting for units: " in out and "an extract holds its lock on this host" in out
    everything = _committed_samples(cache)
    assert len(everything) == read_spec(cache).plan.num_samples
    for epoch in (0, 1):  # every sample exactly once per epoch, while following and after
        got = _epoch_samples(run, epoch)
        assert sorted(got) == sorted(everything), f"epoch {epoch}: {len(got)} vs {len(everything)}"
    ends = _epoch_ends(run)
    assert ends[0]["samples"] == ends[1]["samples"] == len(everything)
    # The token-based schedule, sized from cache.json before the cache existed, ends with the data.
    lrs = [r["lr"] for r in jsonl_rows(run / "metrics.jsonl") if "lr" in r]
    assert max(lrs) > 5e-4 and lrs[-1] < 1e-3 * max(lrs)
    assert ends[0]["followed_windows"] >= 2 and "followed_windows" not in ends[1]
    assert ends[0]["loader_wait_s"] >= 2.0  # the pause was spent waiting for data


@pytest.mark.slow  # an extract and two runs of two ranks
def test_two_ranks_follow_through_extract_and_trainer_restarts(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    data = _data(tmp_path)
    args = ("--epochs", "1", "--procs", "2")
    stop = UnitStop(tmp_path, units=2)
    extract = _extract_started(data, cache, env=stop.env(ENV))
    trainer = _train(cache, run, *args)
    try:
        # The extraction dies part way (stopped at its second unit, then killed); the trainer
        # keeps following (and checkpoints meanwhile).
        stop.wait(extract)
        _signal(extract, signal.SIGKILL)
        extract.wait()
        assert len(committed_units(cache)) == 2 < read_spec(cache).plan.num_units
        _wait_for(lambda: Checkpointer(run).latest() is not None, what="a checkpoint")
        # Then the trainer dies too, mid-follow, and both are rerun with the same commands.
        _signal(trainer, signal.SIGKILL)
        trainer.wait()
        state = Checkpointer(run).load()
        assert state["epoch"] == 0 and state["follow"] is not None and state["follow"]["windows"]
        # (a trainer started on a cache that nothing writes is refused: the extract comes first)
        extract = _extract(data, cache)
        _wait_for(lambda: extract_running(cache) or extract.poll() is not None, what="the rerun extract's lock")
        trainer = _train(cache, run, *args)
        _finish(extract, tmp_path / "extract.log")
        _finish(trainer, tmp_path / "train.log")
    finally:
        for p in (extract, trainer):
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
    everything = _committed_samples(cache)
    per_rank = [_epoch_samples(run, 0, rank) for rank in (0, 1)]
    batches = [sum(1 for x in _trace(run, rank) if x.get("epoch") == 0 and "samples" in x) for rank in (0, 1)]
    assert batches[0] == batches[1] > 0, batches  # equal steps per rank, across both restarts
    flat = per_rank[0] + per_rank[1]
    assert max(Counter(flat).values()) == 1, "a sample was trained twice in the epoch"
    assert set(flat) <= everything and len(everything) - len(flat) <= 1  # at most W - 1 left out
    assert _epoch_ends(run)[0]["samples"] == len(flat)


# ------------------------------------------------------------------------------------------------
# No silent waiting: a cache whose missing units nothing writes, and one written from another node
# ------------------------------------------------------------------------------------------------


def _part_of(cache: Path, tmp: Path) -> tuple[Path, list[str]]:
    """A copy of a finished cache with one unit committed, as a cache whose extract stopped (or a
    copy still in progress) looks; the other units are moved aside to tmp/held."""
    part, held = tmp / "part", tmp / "held"
    shutil.copytree(cache, part)
    held.mkdir()
    moved = sorted(committed_units(part))[1:]
    for u in moved:
        os.rename(part / "units" / unit_name(u), held / unit_name(u))
    return part, [unit_name(u) for u in moved]


def _beat(cache: Path, age: float = 0.0) -> None:
    """The heartbeat an extract on another node writes into a shared cache (heartbeat.py's format)."""
    beat = {"host": "other-node", "pid": 4242, "time": time.time() - age}
    tmp = cache / ".heartbeat.tmp"
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, cache / HEARTBEAT)


def test_train_refuses_at_once_a_cache_that_nothing_writes(tiny_cache, tmp_path):
    part, missing = _part_of(tiny_cache, tmp_path)
    _beat(part, age=10 * STALE)  # an extract on another node that stopped long ago
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "cli.main", "train", "--cache", str(part), "--out",
                        str(tmp_path / "run")], env={**ENV, "NO_COLOR": "1"}, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    err = " ".join(r.stderr.split())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60, "it waited before refusing"
    assert err.count("error:") == 1 and missing[0] in err and f"dflash extract --out {part}" in err, err
    assert "--no-follow" in err and f"lacks {len(missing)} of the {len(missing) + 1} units" in err, err
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # a CLI train waiting on a heartbeat
def test_train_waits_for_a_live_heartbeat_from_another_node_and_says_so(tiny_cache, tmp_path):
    part, missing = _part_of(tiny_cache, tmp_path)
    log = tmp_path / "train.log"
    stop = threading.Event()

    def extract_on_another_node() -> None:
        while not stop.is_set():
            _beat(part)
            stop.wait(0.3)

    beating = threading.Thread(target=extract_on_another_node, daemon=True)
    beating.start()
    with open(log, "w") as out:
        trainer = as_from_a_terminal([sys.executable, "-m", "cli.main", "train", "--cache", str(part), "--out",
                                      str(tmp_path / "run"), "--token-budget", "512", "--max-anchors", "4",
                                      "--draft-layers", "1", "--block-size", "4", "--wait-report", "1"],
                                     env={**ENV, "NO_COLOR": "1"}, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_for(lambda: log.read_text().count("waiting for units: ") >= 2 or trainer.poll() is not None,
                  what="two lines saying what training waits for")  # fmt: skip
        assert trainer.poll() is None, log.read_text()
        _signal(trainer, signal.SIGINT)  # as a terminal's Ctrl-C
        _wait_or_dump(trainer, log)
    finally:
        stop.set()
        if trainer.poll() is None:
            _signal(trainer, signal.SIGKILL)
    text = log.read_text()
    want = f"{part}: 1 of {len(missing) + 1} units committed; an extract on other-node (pid 4242) wrote its"
    assert f"following the extraction: {want}" in text, text
    assert f"waiting for units: {want}" in text, text
    assert trainer.returncode == 130 and "Traceback" not in text, text
