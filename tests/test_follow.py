"""Follow mode: `dflash train` on a cache that `dflash extract` is still writing, both running as
real processes at once (as a user starts them on one node).

Coverage is read from the trainer's per-rank sample log (`--trace`), compared with the samples
the finished cache holds; the trainer's waiting is observed from outside (its log stops growing
while the extraction is paused, then grows again).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from conftest import CHAT, ROOT, TINY_TARGET

from dflash_cache.cache.format import UnitReader
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import committed_units, extract_running
from dflash_cache.train.checkpoint import Checkpointer

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ROWS = 200


def _data(tmp: Path) -> Path:
    path = tmp / "rows.jsonl"
    path.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:ROWS]))
    return path


def _start(*args: str) -> subprocess.Popen:
    """A CLI command in its own process group, so signals reach its worker processes too."""
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], env=ENV, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _extract(data: Path, cache: Path, project: str = "none") -> subprocess.Popen:
    return _start("extract", "--target", str(TINY_TARGET), "--data", str(data), "--out", str(cache),
                  "--max-length", "512", "--unit-mb", "1", "--token-budget", "512", "--project", project)  # fmt: skip


def _extract_started(data: Path, cache: Path, project: str = "none") -> subprocess.Popen:
    """The extraction, once it holds the cache directory: train refuses a --cache that does not
    exist (a typo must not wait), and waits for one that an extract is preparing."""
    proc = _extract(data, cache, project)
    _wait_for(lambda: extract_running(cache) or (cache / "cache.json").exists() or proc.poll() is not None,
              what="the extraction to start")  # fmt: skip
    return proc


def _train(cache: Path, run: Path, *extra: str) -> subprocess.Popen:
    return _start("train", "--cache", str(cache), "--out", str(run), "--token-budget", "512", "--max-anchors", "4",
                  "--draft-layers", "1", "--block-size", "4", "--log-every", "1", "--save-every", "2", "--trace",
                  *extra)  # fmt: skip


def _signal(proc: subprocess.Popen, sig: int) -> None:
    os.killpg(proc.pid, sig)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
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
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _epoch_samples(run: Path, epoch: int, rank: int = 0) -> list[int]:
    return [s for x in _trace(run, rank) if x.get("epoch") == epoch and "samples" in x for s in x["samples"]]


def _epoch_ends(run: Path) -> dict[int, dict]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["epoch_end"]: r for r in records if "epoch_end" in r}


def test_train_follows_a_paused_and_resumed_extraction(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    extract = _extract_started(_data(tmp_path), cache, "auto")  # a projected cache: the default
    trainer = _train(cache, run, "--epochs", "2")  # it waits for cache.json if the extract has not written it
    try:
        _wait_for(lambda: len(committed_units(cache)) >= 1, what="a first unit")
        _signal(extract, signal.SIGSTOP)
        planned = read_spec(cache).plan.num_units
        stopped_at = len(committed_units(cache))
        assert stopped_at < planned, "the extraction finished before it could be paused"

        # The trainer consumes what is committed, then waits: its log stops growing.
        have = _committed_samples(cache)
        _wait_for(lambda: set(_epoch_samples(run, 0)) == have, what="the trainer to consume the committed units")
        seen = len(_trace(run))
        time.sleep(2.0)
        assert trainer.poll() is None and len(_trace(run)) == seen, "the trainer moved on without new units"
        assert len(committed_units(cache)) == stopped_at

        _signal(extract, signal.SIGCONT)
        _finish(extract)
        out = _finish(trainer)
    finally:
        for p in (extract, trainer):
            if p.poll() is None:
                _signal(p, signal.SIGCONT)
                _signal(p, signal.SIGKILL)
    assert "units" in out and "committed" in out  # the follow status line was shown
    everything = _committed_samples(cache)
    assert len(everything) == read_spec(cache).plan.num_samples
    for epoch in (0, 1):  # every sample exactly once per epoch, while following and after
        got = _epoch_samples(run, epoch)
        assert sorted(got) == sorted(everything), f"epoch {epoch}: {len(got)} vs {len(everything)}"
    ends = _epoch_ends(run)
    assert ends[0]["samples"] == ends[1]["samples"] == len(everything)
    # The token-based schedule, sized from cache.json before the cache existed, ends with the data.
    lrs = [json.loads(x)["lr"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"lr"' in x]
    assert max(lrs) > 5e-4 and lrs[-1] < 1e-3 * max(lrs)
    assert ends[0]["followed_windows"] >= 2 and "followed_windows" not in ends[1]
    assert ends[0]["loader_wait_s"] >= 2.0  # the pause was spent waiting for data


def test_two_ranks_follow_through_extract_and_trainer_restarts(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    data = _data(tmp_path)
    args = ("--epochs", "1", "--procs", "2")
    extract = _extract_started(data, cache)
    trainer = _train(cache, run, *args)
    try:
        # The extraction dies part way; the trainer keeps following (and checkpoints meanwhile).
        _wait_for(lambda: len(committed_units(cache)) >= 2, what="two units")
        _signal(extract, signal.SIGKILL)
        extract.wait()
        assert len(committed_units(cache)) < read_spec(cache).plan.num_units
        _wait_for(lambda: Checkpointer(run).latest() is not None, what="a checkpoint")
        # Then the trainer dies too, mid-follow, and both are rerun with the same commands.
        _signal(trainer, signal.SIGKILL)
        trainer.wait()
        state = Checkpointer(run).load()
        assert state["epoch"] == 0 and state["follow"] is not None and state["follow"]["windows"]
        trainer = _train(cache, run, *args)
        time.sleep(1.0)
        extract = _extract(data, cache)
        _finish(extract)
        _finish(trainer)
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
