"""Faults against an uninterrupted run: many SIGKILLs at random moments, and a disk that fills up.

Each kill-and-resume test starts the real command in a subprocess again and again on the same
output, and kills it (SIGKILL) either after a random delay (often inside start-up: lock, sweep,
tokenized-data reuse, checkpoint load) or a random moment after a random number of new units /
checkpoints / parts have committed (often inside the next commit). The kill schedule comes from a
seeded `random.Random`, so a failure replays. A kill only counts as landed if the process was still
running when it was sent; the tests assert that enough of them landed (half for extract and train;
two for regen, whose tiny runs can finish before a late kill), then let the command finish and
compare with an uninterrupted run bit for bit: the cache, the weights and every step's metrics, the
output rows. They are the suite's kill-and-resume tests of extract and train (test_regen.py kills
a batched regen once).

Kills per stage: 14 each for extract, train and regen (20 until the suite outgrew its time budget;
the kill schedules are seeded, so the same moments replay). Every restart pays a few seconds of
start-up (torch, transformers, the target). Measured on 2 CPU cores: 20 extract kills took about
105-115 s, and 20 train plus 20 regen kills 134 s together. Most kills land; in one CI-like run
only 3 of 8 regen kills did (its tiny runs can finish before a late kill), hence the bounds above.

Disk full: a real tmpfs filled with a ballast file after 2 units (when `mount` works, i.e. as root),
and ENOSPC injected into zarr's LocalStore file writes (always). The run must fail with an
ExtractError that says the disk is full, naming the unit and the cache; no torn unit in `units/`,
nothing left in `.partial/`; with space again the same run completes the cache bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    CHAT,
    ROOT,
    TINY_TARGET,
    UnitStop,
    as_from_a_terminal,
    assert_same_cache,
    extract_cmd,
    extract_config,
    jsonl_head,
    jsonl_rows,
    read_cache,
    read_metrics,
)

from dflash_cache.cache.audit import verify
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import PARTIAL, committed_units, unit_name
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.cache.unit.verify import verify_unit
from dflash_cache.extract.stage import ExtractError, run
from dflash_cache.pipelines.regen import parts_dir
from dflash_cache.train.checkpoint import Checkpointer

KILLS_EXTRACT = 10
KILLS_TRAIN = 10
KILLS_REGEN = 10
# one thread a process: on a CPU a run takes as many threads as cores are idle when it starts, and
# results are bitwise the same only for the same number of threads
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _rows(path: Path, n: int) -> Path:
    path.write_text(jsonl_head(CHAT, n))
    return path


def kill_and_resume(cmd, rng, kills, progress, total, max_delay=3.0, timeout=180):
    """Start `cmd` `kills` times, SIGKILL it at a random moment each time; returns the landed kills.

    `progress()` counts what is committed (units, checkpoints, parts) out of `total`. A kill comes
    either after a random delay, or a random moment after 1-2 more things have committed (never
    waiting for the last one, so that most kills land before the run ends; one may still land
    after the last commit, during shut-down). A kill sent to a process that already exited is not
    counted.
    """
    landed = 0
    for _ in range(kills):
        before = progress()
        by_delay = rng.random() < 0.35 or before >= total - 1
        delay = rng.uniform(0.05, max_delay)
        need = min(before + rng.randint(1, 2), total - 1)
        extra = rng.uniform(0.0, 0.4)
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            if by_delay and time.monotonic() - t0 >= delay:
                break
            if not by_delay and progress() >= need:
                time.sleep(extra)
                break
            time.sleep(0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            landed += 1
        proc.wait()
    return landed


# ----------------------------------------------------------------------------------------- extract


def _workers(pid: int) -> list[int]:
    """The worker processes that `pid` has spawned (multiprocessing's spawn), started or starting."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(x) for x in f.read().split()]
    found = []
    for c in children:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(c)
        except FileNotFoundError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _as_from_a_terminal(cmd, env=ENV) -> subprocess.Popen:
    return as_from_a_terminal(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ctrl_c(cmd, ready, left, reset, attempts=6, timeout=180, stop=None):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) at a moment the test
    sees: once `ready()` holds, the run is frozen (SIGSTOP to its group), and if `left()` says
    work remains, SIGINT is sent before it goes on (SIGCONT); returns (return code, stderr).
    Frozen, the run cannot finish between the look and the signal. A run that got past its last
    piece of work before it could be frozen (or that ended before the test saw `ready()`) is let
    finish, `reset()`, and started again. With `stop` (helpers.UnitStop), an extract freezes
    itself at the unit count it names instead, so work is always left: no attempt is lost."""
    for _ in range(attempts):
        p = _as_from_a_terminal(cmd, env=ENV if stop is None else stop.env(ENV))
        if stop is not None:
            stop.wait(p, timeout)
        else:
            deadline = time.monotonic() + timeout
            while p.poll() is None and not ready(p) and time.monotonic() < deadline:
                time.sleep(0.002)
            if p.poll() is not None:  # it ended while the test was not looking (a loaded machine)
                _, err = p.communicate()
                assert p.returncode == 0, err
                reset()
                continue
            os.killpg(p.pid, signal.SIGSTOP)
        mid_run = left()
        if mid_run:
            os.killpg(p.pid, signal.SIGINT)
        os.killpg(p.pid, signal.SIGCONT)
        _, err = p.communicate(timeout=timeout)
        if mid_run:
            deadline = time.monotonic() + 30
            while _alive(p.pid) and time.monotonic() < deadline:  # no process of the run left behind
                time.sleep(0.1)
            assert not _alive(p.pid), "processes of the interrupted run are still alive"
            return p.returncode, err
        assert p.returncode == 0, err
        reset()
    raise AssertionError(f"no attempt of {attempts} could be frozen with work left")


def _one_line(rc: int, err: str, stage: str) -> None:
    # the bar's lines and a new train run's start-up line are not the interruption's
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith((f"{stage} ", "drafter: "))]
    assert rc == 130 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("interrupted:") and "rerun the same command" in lines[0], err


@pytest.mark.slow  # a CLI extract stopped by Ctrl-C and rerun, twice
@pytest.mark.parametrize("when", ["after the first unit", "during the last unit"])
def test_ctrl_c_ends_extract_with_one_line_and_resumes(tmp_path, when):
    """Ctrl-C mid-extract, writer processes included, ends it with one line that says how to
    resume and exit code 130, also while the last unit is being written; the same command then
    completes the cache."""
    data = _rows(tmp_path / "rows.jsonl", 80)  # 5 units
    out = tmp_path / "cache"
    cmd = extract_cmd(data, out)
    total = 5
    need = 1 if when == "after the first unit" else total - 1
    rc, err = ctrl_c(cmd, None, lambda: len(committed_units(out)) < total, lambda: shutil.rmtree(out),
                     stop=UnitStop(tmp_path, need))  # fmt: skip
    _one_line(rc, err, "extract")
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(committed_units(out)) == total and verify(out) == {}


def test_ctrl_c_while_workers_start(tmp_path):
    """Ctrl-C once the first of `--procs 2`'s worker processes exists, while the parent is
    starting the other and both import torch and the stage: one line, exit code 130, and no
    process of the run left behind. The workers start deaf to it; the parent must not be, else
    the Ctrl-C is lost and the run goes on to the end (dflash_cache.core.interrupts)."""
    data = _rows(tmp_path / "rows.jsonl", 80)
    out = tmp_path / "cache"
    cmd = [*extract_cmd(data, out), "--procs", "2"]
    rc, err = ctrl_c(cmd, lambda p: len(_workers(p.pid)) >= 1, lambda: not committed_units(out),
                     lambda: shutil.rmtree(out))  # fmt: skip
    _one_line(rc, err, "extract")


def test_an_interrupted_command_ends_even_if_an_exit_hook_never_returns():
    """After the interrupted line, exit hooks get EXIT_GRACE_S and the process then ends with 130:
    a hook left waiting on what the Ctrl-C half-stopped (a queue's feeder thread, a lock) must not
    hang the command the user was told is over."""
    script = """
import atexit, threading, typer
from cli import errors
errors.EXIT_GRACE_S = 1.0
errors.in_own_process()
atexit.register(threading.Event().wait)  # an exit hook that never returns
app = typer.Typer()

@app.command()
@errors.friendly
def go() -> None:
    raise KeyboardInterrupt

app()
"""
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 130 and "interrupted:" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert time.monotonic() - start < 30


def test_ctrl_c_during_reports_never_hangs_the_reporter():
    """A worker that runs in the process the user started (one CPU process) reports from the
    thread Ctrl-C interrupts: a thousand Ctrl-Cs land while it reports, some inside the queue's
    put, and the Reporter still stops. A KeyboardInterrupt raised inside a bare Queue.put could
    leave the queue's lock taken, and the stop's own put then waited forever (a regen on CPU hung
    after its Ctrl-C that way, about once in 40 runs on a loaded machine)."""
    script = """
import os, random, signal, threading
from dflash_cache.core.progress import Reporter

reporter = Reporter(None)
reporter.start(1)
ready, done = threading.Event(), threading.Event()

def ctrl_c() -> None:  # one Ctrl-C at a time, at a random moment of the reporting loop
    while not done.is_set():
        if ready.wait(0.1):
            ready.clear()
            threading.Event().wait(random.random() * 2e-4)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

threading.Thread(target=ctrl_c, daemon=True).start()
interrupts = 0
while interrupts < 1000:
    try:
        ready.set()
        while True:
            reporter.channel.put({"rows": 1})
    except KeyboardInterrupt:
        interrupts += 1
done.set()
stopped = threading.Event()
threading.Thread(target=lambda: (reporter.stop(), stopped.set()), daemon=True).start()
print("stopped" if stopped.wait(20) else "hung", reporter.totals.get("rows", 0) > 0, flush=True)
os._exit(0)
"""
    p = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["stopped", "True"], p.stdout + p.stderr[-3000:]


@pytest.mark.slow  # two CLI extracts
def test_ctrl_c_after_the_work_is_done(tmp_path):
    """A Ctrl-C once every unit is committed, while the process reports and exits: it ends with
    its summary (exit 0) or the interrupted line (130), never a traceback or death by the signal."""
    data = _rows(tmp_path / "rows.jsonl", 48)
    out = tmp_path / "cache"
    p = _as_from_a_terminal(extract_cmd(data, out))
    total = 3
    while p.poll() is None and len(committed_units(out)) < total:
        time.sleep(0.001)
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode in (0, 130) and "Traceback" not in err, (p.returncode, err)
    assert len(committed_units(out)) == total and verify(out) == {}


@pytest.mark.slow  # three runs of two processes: about 40 s
def test_sharded_extract_answers_ctrl_c_and_a_lost_rank(tmp_path):
    """`--procs 2 --tp 2` (one copy of the target over two ranks): Ctrl-C after the first unit ends
    it as without --tp (one line, exit 130, no process left). A rank killed mid-run (as the OOM
    killer would) ends the run with one error line and no rank left waiting for it in a
    collective. Each time the same command completes the cache, every sample once."""
    data = _rows(tmp_path / "rows.jsonl", 80)  # 5 units
    out = tmp_path / "cache"
    cmd = [*extract_cmd(data, out), "--procs", "2", "--tp", "2"]
    total = 5
    rc, err = ctrl_c(cmd, None, lambda: len(committed_units(out)) < total, lambda: shutil.rmtree(out),
                     stop=UnitStop(tmp_path, 1))  # fmt: skip
    _one_line(rc, err, "extract")
    for unit in list(committed_units(out).values())[1:]:
        shutil.rmtree(unit)  # work left for the next run, whatever Ctrl-C left
    stop = UnitStop(tmp_path, 2)  # the run freezes itself at its second unit, with units left to forward
    p = _as_from_a_terminal(cmd, env=stop.env(ENV))
    stop.wait(p)
    assert len(_workers(p.pid)) == 2 and len(committed_units(out)) == 2
    os.kill(_workers(p.pid)[1], signal.SIGKILL)  # the copy's second rank, which the lead's forwards wait for
    os.killpg(p.pid, signal.SIGCONT)
    _, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("extract ")]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error"), err
    deadline = time.monotonic() + 30
    while _alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(p.pid), "processes of the failed run are still alive"
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(committed_units(out)) == total and verify(out) == {}
    assert len(read_cache(out)) == read_spec(out).plan.num_samples  # read_cache fails on a sample cached twice


@pytest.mark.slow  # the CLI extract killed and rerun KILLS_EXTRACT times
def test_extract_killed_many_times(tmp_path):
    data = _rows(tmp_path / "rows.jsonl", 160)
    ref = tmp_path / "ref"
    done = subprocess.run(extract_cmd(data, ref), env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    total = len(committed_units(ref))
    assert total >= 6, total

    out = tmp_path / "killed"
    cmd = extract_cmd(data, out)
    landed = kill_and_resume(cmd, random.Random(20261130), KILLS_EXTRACT, lambda: len(committed_units(out)), total)
    assert landed >= 0.5 * KILLS_EXTRACT, f"only {landed} of {KILLS_EXTRACT} kills landed mid-run"
    assert cmd[-2] == "--token-budget"  # a changed token budget is another plan: refused, naming the field
    other = subprocess.run([*cmd[:-1], "2048"], env=ENV, capture_output=True, text=True)
    assert other.returncode == 1 and "plan.token_budget" in other.stderr, other.stderr
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not any((out / PARTIAL).iterdir())
    assert verify(out) == {}
    spec = read_spec(out)
    cached = read_cache(out)  # asserts that no sample is cached twice
    rejected = {r["row"] for r in jsonl_rows(out / "rejected.jsonl")}
    assert sorted(cached) == [i for i in range(160) if i not in rejected]
    assert len(cached) == spec.plan.num_samples
    assert_same_cache(out, ref)


# ------------------------------------------------------------------------------------------- train


def _train_cmd(cache: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "cli.main", "train", "--cache", str(cache), "--out", str(out), "--epochs", "2",
            "--max-steps", "16", "--save-every", "2", "--token-budget", "512", "--max-anchors", "4",
            "--draft-layers", "1", "--block-size", "4", "--log-every", "1"]  # fmt: skip


def _step(run_dir: Path) -> int:
    latest = Checkpointer(run_dir).latest()
    return 0 if latest is None else int(latest.name[5:13])


@pytest.mark.slow
def test_train_killed_many_times(small_cache, tmp_path):
    ref = tmp_path / "ref"
    done = subprocess.run(_train_cmd(small_cache, ref), env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    final = Checkpointer(ref).load()
    total = final["step"]
    assert total == 16
    ends = read_metrics(ref)
    assert any("epoch_end" in m for m in ends), "the run should cross an epoch boundary"

    out = tmp_path / "killed"
    cmd = _train_cmd(small_cache, out)
    # progress in checkpoints (every 2 steps): total // 2 of them
    landed = kill_and_resume(cmd, random.Random(7), KILLS_TRAIN, lambda: _step(out) // 2, total // 2, max_delay=5.0)
    assert landed >= 0.5 * KILLS_TRAIN, f"only {landed} of {KILLS_TRAIN} kills landed mid-run"
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = Checkpointer(out).load()
    assert got["step"] == total
    a, b = got["model"], final["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    def losses(run_dir):
        return [(m["step"], m["loss"], m["slot_acc"]) for m in read_metrics(run_dir) if "loss" in m]

    # every step logged once, with the uninterrupted run's loss and accuracies
    assert losses(out) == losses(ref) and [m[0] for m in losses(out)] == list(range(1, total + 1))


@pytest.mark.slow  # two CLI trains
def test_ctrl_c_ends_train_with_one_line_and_resumes(small_cache, tmp_path):
    """Ctrl-C mid-train (loader threads and all): one line, exit code 130; the rerun resumes from
    the last checkpoint to the uninterrupted run's step count."""
    out = tmp_path / "run"
    cmd = _train_cmd(small_cache, out)
    rc, err = ctrl_c(cmd, lambda p: _step(out) >= 2, lambda: _step(out) < 16, lambda: shutil.rmtree(out))
    _one_line(rc, err, "train")
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Checkpointer(out).load()["step"] == 16


# ------------------------------------------------------------------------------------------- regen


def _regen_cmd(data: Path, out: Path) -> list[str]:
    code = ("from pathlib import Path; from dflash_cache.pipelines.regen import RegenConfig, run; "
            f"run(RegenConfig(target={str(TINY_TARGET)!r}, data={str(data)!r}, out=Path({str(out)!r}), "
            "max_new_tokens=12, part_rows=1, batch_size=1, temperature=0.8, seed=3))")  # fmt: skip
    return [sys.executable, "-c", code]


@pytest.mark.slow
def test_regen_killed_many_times(tmp_path):
    rows = jsonl_rows(CHAT, 12)
    prompts = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": "-"}) + "\n" for p in prompts))
    ref = tmp_path / "ref.jsonl"
    done = subprocess.run(_regen_cmd(data, ref), env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    total = len(prompts)

    out = tmp_path / "out.jsonl"
    cmd = _regen_cmd(data, out)

    def parts():
        return len(list(parts_dir(out).glob("part-*.jsonl")))

    landed = kill_and_resume(cmd, random.Random(3), KILLS_REGEN, parts, total)
    assert landed >= 2, f"only {landed} of {KILLS_REGEN} kills landed mid-run"
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == ref.read_text()
    assert not parts_dir(out).exists()


@pytest.mark.slow  # two regens in processes of their own
def test_ctrl_c_ends_regen_with_one_line_and_resumes(tmp_path):
    """Ctrl-C mid-regen: one line, exit code 130; the rerun completes the output."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i} things.", "response": "-"}) + "\n" for i in range(8)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "cli.main", "regen", "--target", str(TINY_TARGET), "--data", str(data), "--out",
           str(out), "--max-new-tokens", "12", "--part-rows", "1", "--batch-size", "1"]  # fmt: skip

    def parts() -> int:
        return len(list(parts_dir(out).glob("part-*.jsonl")))

    def reset() -> None:
        shutil.rmtree(parts_dir(out), ignore_errors=True)
        out.unlink(missing_ok=True)

    rc, err = ctrl_c(cmd, lambda p: parts() >= 1, lambda: not out.exists() and parts() < 8, reset)
    _one_line(rc, err, "regen")
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(jsonl_rows(out)) == 8


# --------------------------------------------------------------------------------------- disk full


def _try_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], capture_output=True)
    return res.returncode == 0


# Imported at start-up by every Python process of the run (the extract and its writer processes),
# through PYTHONPATH: once `after` units are committed, writes into `.partial/` meet a full disk,
# either a real one (a ballast file fills the tmpfs) or an injected ENOSPC.
DISK_FULL_HOOK = """
import errno, json, os
from pathlib import Path

_cfg = os.environ.get("DFLASH_TEST_DISK_FULL")
if _cfg:
    import zarr.storage._local as _zl

    _cfg, _real = json.loads(_cfg), _zl._put

    def _put(path, value, exclusive=False):
        units = Path(_cfg["out"]) / "units"
        done = sum(1 for _ in units.iterdir()) if units.is_dir() else 0
        if ".partial" in Path(path).parts and done >= _cfg["after"]:
            if _cfg["fill"] is None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            ballast = Path(_cfg["fill"]) / "ballast"
            if not ballast.exists():
                with open(ballast, "wb") as f:
                    try:
                        while True:
                            f.write(bytes(1 << 16))
                            f.flush()
                    except OSError:
                        pass
        return _real(path, value, exclusive=exclusive)

    _zl._put = _put
"""


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_disk_full_fails_clearly_and_resumes(small_cache, tmp_path, monkeypatch, how):
    data = _rows(tmp_path / "rows.jsonl", 60)
    ref = small_cache  # the same rows and settings, uninterrupted
    total = len(committed_units(ref))
    assert total >= 3

    root = tmp_path / "disk"
    mounted = how == "tmpfs" and _try_tmpfs(root, 64)
    if how == "tmpfs" and not mounted:
        pytest.skip("cannot mount a tmpfs here (not root or no mount); the injected case covers ENOSPC")
    try:
        out = root / "cache"
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(DISK_FULL_HOOK)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setenv("DFLASH_TEST_DISK_FULL", json.dumps({"out": str(out), "after": 2,
                                                                "fill": str(root) if mounted else None}))  # fmt: skip
        with pytest.raises(ExtractError) as err:  # one writer: units commit in turn, so the third one fails
            run(extract_config(out, data=str(data), unit_mb=1, token_budget=512, writers=1))
        msg = str(err.value)
        assert "disk is full" in msg and str(out) in msg and "unit u0" in msg, msg
        units = committed_units(out)
        assert 2 <= len(units) < total
        spec = read_spec(out)
        for path in units.values():  # no torn unit: every committed one decodes completely
            assert verify_unit(path, RowFormat.of(spec)) == []
        assert verify(out, present_only=True) == {}
        missing = verify(out)  # the cache is incomplete: its uncommitted units fail a full verify
        assert sorted(missing) == sorted(unit_name(u) for u in set(range(spec.plan.num_units)) - set(units))
        assert all(p == [f"not committed (the plan has {spec.plan.num_units} units)"] for p in missing.values())
        left = sorted(str(p.relative_to(out)) for p in (out / PARTIAL).rglob("*"))
        assert not left, f"a failed write should not leave its partial unit behind: {left}"

        # space again: the same command completes the cache
        monkeypatch.delenv("DFLASH_TEST_DISK_FULL")
        (root / "ballast").unlink(missing_ok=True)
        summary = run(extract_config(out, data=str(data), unit_mb=1, token_budget=512))
        assert summary["samples"] == len(read_cache(ref))
        assert len(committed_units(out)) == total
        assert verify(out) == {}
        assert_same_cache(out, ref)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)
