"""A training run resumed on another number of processes (issue 16: growing onto the extract GPUs).

The multi-process test is the recommended one-node flow in small: `dflash train --procs 2` follows
a cache whose extraction is not finished (units held back), checkpoints and is killed mid-follow;
a resume on 3 processes is refused while the cache is incomplete, then, once every unit is
committed, the same command with `--procs 3` finishes the run. Coverage is read from `--trace`
against the samples the cache holds; the schedule from `metrics.jsonl` against the warmup-cosine
formula over the plan's tokens. The pure tests check the re-dealt plans without processes.
"""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import CHAT, extract_config, jsonl_head, jsonl_rows
from test_follow import _committed_samples, _epoch_ends, _signal, _start, _trace, _wait_for

from dflash_cache.cache.heartbeat import beating
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import UNITS, committed_units
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.extract.stage import run as extract
from dflash_cache.train.batching import SampleTable, epoch_batches, rest_of_epoch, resume_parts
from dflash_cache.train.checkpoint import Checkpointer
from dflash_cache.train.config import TrainError
from dflash_cache.train.stage import check_resume

EDGES = [64, 128, 256, 512]


def _table(n: int = 300, seed: int = 0) -> SampleTable:
    rng = np.random.default_rng(seed)
    length = rng.integers(8, 700, n).astype(np.int64)
    unit = np.repeat(np.arange(n // 10, dtype=np.int64), 10)
    start = np.concatenate([np.concatenate([[0], np.cumsum(length[i : i + 10])[:-1]]) for i in range(0, n, 10)])
    return SampleTable(unit, start.astype(np.int64), length, np.arange(n, dtype=np.int64))


def _used(per_rank: list[list[np.ndarray]], n: int | None = None) -> list[int]:
    """The rows of the first `n` batches of every rank (all of them when None)."""
    return [int(i) for mine in per_rank for b in mine[:n] for i in b]


def test_rest_of_epoch_trains_each_sample_once_across_world_sizes():
    table = _table()
    kw = {"epoch": 3, "seed": 5, "token_budget": 600, "bucket_edges": EDGES,
          "batch_cost": lambda lengths: float(len(lengths) * 10 + lengths.sum())}  # fmt: skip
    # part 0 is the epoch's own plan on 2 ranks, cut after 7 batches a rank
    first = epoch_batches(table, world_size=2, **kw)
    assert rest_of_epoch(table, world_size=2, parts=[], **kw)[0][0].tolist() == first[0][0].tolist()
    part0 = _used(first, 7)
    # then 3 ranks, cut 4 batches later (batch 11 of the epoch), then the rest on 4 ranks
    mid = rest_of_epoch(table, world_size=3, parts=[(2, 7)], **kw)
    part1 = _used(mid, 4)
    rest = rest_of_epoch(table, world_size=4, parts=[(2, 7), (3, 11)], **kw)
    assert len({len(mine) for mine in mid}) == 1 and len({len(mine) for mine in rest}) == 1  # equal steps
    everything = part0 + part1 + _used(rest)
    assert max(Counter(everything).values()) == 1, "a sample trained twice in the epoch"
    assert len(table) - len(everything) <= 3  # at most W - 1 of the last deal left out
    assert all(table.length[b].sum() <= 600 or len(b) == 1 for mine in rest for b in mine)
    rest1 = set(range(len(table))) - set(part0)  # part 1 re-deals exactly what part 0 left
    assert set(_used(mid)) <= rest1 and len(_used(mid)) >= len(rest1) - 2
    # a pure function: the same parts give the same plan; other parts another one
    again = rest_of_epoch(table, world_size=4, parts=[(2, 7), (3, 11)], **kw)
    assert [b.tolist() for mine in again for b in mine] == [b.tolist() for mine in rest for b in mine]
    with pytest.raises(ValueError, match="outside its plan"):
        rest_of_epoch(table, world_size=3, parts=[(2, 10_000)], **kw)


def _state(**kw) -> dict:
    return {"epoch": 1, "batch": 6, "samples": [40, 41], "follow": None, **kw}


def _resume_parts(state: dict, world_size: int, cache_complete: bool) -> list[list[int]]:
    """What a resume does with a checkpoint: refuse it (the stage, before starting), or continue
    from its position with these parts (the loader)."""
    check_resume(state, world_size, cache_complete)
    return resume_parts(state, world_size)


def test_resume_parts_only_on_another_world_size():
    # same world size: the epoch's own plan, as before (older checkpoints have no world_size/parts)
    assert _resume_parts(_state(), 2, True) == []
    assert _resume_parts(_state(world_size=3, samples=[1, 2, 3], parts=[[2, 4]]), 3, True) == [[2, 4]]
    # at an epoch boundary nothing ran yet: the next epoch is planned for the new size
    assert _resume_parts(_state(batch=0), 3, True) == []
    # mid-epoch on another size: the part so far is recorded, parts accumulate
    assert _resume_parts(_state(), 3, True) == [[2, 6]]
    assert _resume_parts(_state(world_size=3, samples=[1, 2, 3], parts=[[2, 4]], batch=9), 1, False) == [[2, 4], [3, 9]]
    # mid-follow of a cache still being extracted: refused; once it is complete: re-dealt
    follow = {"windows": [[[0, 1], False]]}
    with pytest.raises(TrainError, match="resume on 2 .* until the extraction ends"):
        _resume_parts(_state(epoch=0, follow=follow), 3, False)
    assert _resume_parts(_state(epoch=0, follow=follow), 3, True) == [[2, 6]]


# ---------------------------------------------------------------------------------- processes


def _train(cache: Path, run: Path, procs: int, log: Path) -> subprocess.Popen:
    return _start(log, "train", "--cache", str(cache), "--out", str(run), "--procs", str(procs), "--epochs", "2",
                  "--token-budget", "512", "--max-anchors", "4", "--draft-layers", "1", "--block-size", "4",
                  "--log-every", "1", "--save-every", "2", "--trace")  # fmt: skip


def _lr(done: float, total: float, peak: float = 6e-4, warmup: float = 0.04) -> float:
    """The schedule as docs/guides/train.md states it: linear warmup over 4% of the tokens, then cosine to zero."""
    if done < warmup * total:
        return peak * done / (warmup * total)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (done - warmup * total) / (total - warmup * total))))


@pytest.mark.slow  # runs of two and three processes
def test_followed_run_killed_on_two_processes_finishes_on_three(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(jsonl_head(CHAT, 60))
    cache, run, held = tmp_path / "cache", tmp_path / "run", tmp_path / "held"
    extract(extract_config(cache, data=str(rows), unit_mb=1, token_budget=512))
    spec = read_spec(cache)
    everything = _committed_samples(cache)
    units = committed_units(cache)
    assert len(units) == spec.plan.num_units >= 3
    held.mkdir()
    for uid in list(units)[2:]:  # an extraction part way: the last units not committed yet
        shutil.move(units[uid], held / units[uid].name)

    # the extract's heartbeat, as one on another node keeps it: a trainer follows only a cache being written
    with beating(cache, interval=1.0):
        trainer = _train(cache, run, 2, tmp_path / "killed.log")
        try:
            _wait_for(lambda: (p := Checkpointer(run).latest()) is not None and p.name >= "step_00000002",
                      timeout=180, what="a checkpoint mid-follow")  # fmt: skip
            _signal(trainer, signal.SIGKILL)
            trainer.wait()
        finally:
            if trainer.poll() is None:
                _signal(trainer, signal.SIGKILL)
        state = Checkpointer(run).load()
        assert state["epoch"] == 0 and state["batch"] > 0 and state["world_size"] == 2 and state["follow"]["windows"]
        killed_at = state["step"]

        refused = _train(cache, run, 3, tmp_path / "refused.log")
        refused.wait(timeout=120)
        out = (tmp_path / "refused.log").read_text()
        assert refused.returncode != 0 and "error: the checkpoint is" in out and "until the extraction ends" in out, out

        for path in held.iterdir():  # the extraction ends: every unit committed
            shutil.move(path, cache / UNITS / path.name)
    resumed = _train(cache, run, 3, tmp_path / "resumed.log")
    resumed.wait(timeout=300)
    out = (tmp_path / "resumed.log").read_text()
    assert resumed.returncode == 0, out

    traces = [_trace(run, r) for r in range(3)]
    for epoch in (0, 1):
        per_rank = [[s for x in t if x.get("epoch") == epoch for s in x["samples"]] for t in traces]
        flat = [s for mine in per_rank for s in mine]
        assert max(Counter(flat).values()) == 1, f"epoch {epoch}: a sample trained twice"
        assert set(flat) <= everything and len(everything) - len(flat) <= 2, (epoch, len(flat))  # W - 1
        assert all(per_rank), f"epoch {epoch}: a rank trained nothing"  # rank 2 joined mid-epoch 0
        assert _epoch_ends(run)[epoch]["samples"] == len(flat)
    # the ranks' replicas agree after every step since the resume, and every step is there once
    sums = [{x["step"]: x["checksum"] for x in t if "step" in x} for t in traces]
    assert sorted(sums[0]) == list(range(1, max(sums[0]) + 1))
    assert all(sums[r][s] == sums[0][s] for r in (1, 2) for s in sums[r]) and min(sums[2]) == killed_at + 1
    # the same schedule: tokens of all ranks over epochs x the plan's tokens, continued across the resize
    steps = [m for m in jsonl_rows(run / "metrics.jsonl") if "lr" in m]
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1))
    total, before = 2 * spec.plan.num_tokens, 0
    for m in steps:
        assert m["lr"] == pytest.approx(_lr((before + m["tokens"]) / 2, total), rel=1e-9, abs=1e-15), m["step"]
        before = m["tokens"]
    readers = [UnitReader(path) for path in committed_units(cache).values()]
    length = {int(s): int(n) for r in readers for s, n in zip(r.sample_index, np.diff(r.offsets), strict=True)}
    trained = [s for t in traces for x in t if "samples" in x for s in x["samples"]]
    assert before == sum(length[s] for s in trained)  # every rank's tokens counted once, before and after
    final = Checkpointer(run).load()
    assert (final["epoch"], final["batch"], final["world_size"], final["parts"]) == (2, 0, 3, [])
