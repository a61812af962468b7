"""Both stages under torchrun across two "nodes" (two torchrun launches on 127.0.0.1 with gloo),
against independent runs: extract against one in-process extraction (bitwise the same cache),
train against a `--procs 2` run of the same world size (the same weights, metrics and traces).
docs/guides/multi-gpu.md's torchrun recipe is these commands with a real host in place of 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CHAT, ROOT, TINY_TARGET, extract_config, jsonl_head, jsonl_rows, read_cache

from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.core.devices import DeviceError
from dflash_cache.core.launch import launch, torchrun_worker
from dflash_cache.core.threads import worker_threads
from dflash_cache.extract.stage import run
from dflash_cache.train import stage as train

ROWS = 80  # 3 units at --unit-mb 1: rank 0 extracts two, rank 1 one
EXTRACT = ["--max-length", "512", "--unit-mb", "1", "--token-budget", "2048", "--project", "none"]
TRAIN = ["--epochs", "1", "--token-budget", "1024", "--max-anchors", "16", "--draft-layers", "1", "--log-every", "1",
         "--save-every", "3", "--trace"]  # fmt: skip
TIMING = {"time", "tokens_per_s", "tflops_per_gpu", "mfu", "loader_wait_s"}  # measured, not computed
# Each "node" gets one core of this machine, as a node would have its own: torch's default of one
# thread per core would put two spinning OpenMP teams on each core.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(rendezvous: str, argv: list[str], logs: Path, per_node: int = 1) -> None:
    """`torchrun --nnodes 2 --nproc-per-node PER_NODE -m cli.main ARGV` twice, as nodes 0 and 1; both must
    exit 0. static: --master-addr/--master-port and --node-rank; c10d: --rdzv-endpoint (ranks in
    the order the nodes join, --node-rank unused)."""
    port = _free_port()
    if rendezvous == "static":
        where = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}"]
    procs = []
    for node in (0, 1):
        node_rank = ["--node-rank", str(node)] if rendezvous == "static" else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
               *where, *node_rank, "-m", "cli.main", *argv]  # fmt: skip
        log = open(logs / f"node{node}.log", "w")  # noqa: SIM115 - closed below, after the process
        proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, log))
    try:  # until both end, or one fails: that leaves the other in torchrun's exit barrier for 300 s
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
            if any(p.poll() for p, _ in procs):
                break
            time.sleep(0.2)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the agent and its worker: this launch's session
                p.wait()
            log.close()
    codes = [p.returncode for p, _ in procs]  # -9: killed here, after the other node failed
    tails = "".join(
        f"\n--- node {n} (exit {c}):\n" + (logs / f"node{n}.log").read_text()[-2000:] for n, c in enumerate(codes)
    )
    assert codes == [0, 0], tails


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text(jsonl_head(CHAT, ROWS))
    return path


@pytest.fixture(scope="module")
def one_process(rows, tmp_path_factory) -> Path:
    """The reference: the same extraction in this process, one worker."""
    out = tmp_path_factory.mktemp("one") / "cache"
    run(extract_config(out, data=str(rows), unit_mb=1))
    return out


def _files(cache: Path) -> dict[str, bytes]:
    """Every file of the cache but cache.json, by path: the units' arrays and manifests, the frozen
    weights, the rejections. Not the run's own state (.lock, which torchrun ranks do not take; the
    tokenized rows in .work)."""
    files = (p for p in sorted(cache.rglob("*")) if p.is_file() and p.name != "cache.json")
    return {str(p.relative_to(cache)): p.read_bytes() for p in files if p.relative_to(cache).parts[0][0] != "."}


@pytest.mark.slow  # two torchrun nodes, twice
def test_extract_on_two_nodes_resumes_to_the_one_process_cache(rows, one_process, tmp_path):
    """Node 0 failed after node 1 committed its unit 1 (a copy of the reference's): the rerun on both
    nodes extracts units 0 and 2 on rank 0, none on rank 1, and the cache is bitwise the one-process
    cache. Rank 1, with nothing to do, ends first: it must not count rank 0's units as missing."""
    out = tmp_path / "cache"
    (out / "units").mkdir(parents=True)
    shutil.copy(one_process / "cache.json", out)
    shutil.copytree(one_process / "units" / "u000001", out / "units" / "u000001")
    argv = ["extract", "--target", str(TINY_TARGET), "--data", str(rows), "--out", str(out), *EXTRACT]
    _two_nodes("static", argv, tmp_path)
    assert read_spec(out).differences(read_spec(one_process)) == []  # resumed: the same plan and spec
    units, ref = committed_units(out), committed_units(one_process)
    assert sorted(units) == sorted(ref) and len(units) == 3
    for uid in units:  # every array decodes to the same values
        a, b = UnitReader(units[uid]), UnitReader(ref[uid])
        assert sorted(a.arrays) == sorted(b.arrays)
        for key in a.arrays:
            np.testing.assert_array_equal(a.arrays[key][...], b.arrays[key][...], err_msg=f"unit {uid} {key}")
    files, want = _files(out), _files(one_process)
    assert sorted(files) == sorted(want)
    assert [f for f in files if files[f] != want[f]] == []  # and every file holds the same bytes


@pytest.mark.slow  # four ranks on 2 cores: about 40 s
def test_sharded_copies_on_two_nodes(rows, one_process, tmp_path):
    """`--tp 2` under torchrun, two processes a node: each node runs one copy of the target sharded
    over its two ranks, each copy in a process group of its own formed through torchrun's store.
    Every sample is cached once, equal to the one-process cache up to bf16 rounding."""
    out = tmp_path / "cache"
    argv = ["extract", "--target", str(TINY_TARGET), "--data", str(rows), "--out", str(out), *EXTRACT, "--tp", "2"]
    _two_nodes("c10d", argv, tmp_path, per_node=2)
    assert read_spec(out).differences(read_spec(one_process)) == [] and read_spec(out).parallel["tp"] == 2
    got, want = read_cache(out), read_cache(one_process)  # read_cache fails on a sample cached twice
    assert sorted(got) == sorted(want) and len(committed_units(out)) == 3
    for s in want:
        bits = [torch.from_numpy(x[0].view(np.int16)).view(torch.bfloat16).float() for x in (got[s], want[s])]
        torch.testing.assert_close(*bits, rtol=2**-7, atol=1e-5)


def _metrics(run_dir: Path) -> list[dict]:
    lines = jsonl_rows(run_dir / "metrics.jsonl")
    return [{k: v for k, v in m.items() if k not in TIMING} for m in lines]


@pytest.mark.slow  # two torchrun nodes and a two-process reference
def test_train_on_two_nodes_is_the_two_process_run(one_process, tmp_path):
    ref, out = tmp_path / "procs", tmp_path / "nodes"
    # the CLI's defaults and these settings, as `dflash train ... --procs 2` runs them (in this process: one
    # interpreter less to start)
    train.run(train.TrainConfig(cache=one_process, out=ref, procs=2, epochs=1, token_budget=1024, max_anchors=16,
                                draft_layers=1, log_every=1, save_every=3, trace=True))  # fmt: skip
    _two_nodes("c10d", ["train", "--cache", str(one_process), "--out", str(out), *TRAIN], tmp_path)
    got, want = _metrics(out), _metrics(ref)
    assert got == want and len([m for m in want if "loss" in m]) >= 3
    assert (out / "export" / "model.safetensors").read_bytes() == (ref / "export" / "model.safetensors").read_bytes()
    for rank in (0, 1):  # each rank read the same samples and its replica agreed after every step
        assert (out / "trace" / f"rank{rank}.jsonl").read_text() == (ref / "trace" / f"rank{rank}.jsonl").read_text()
    assert sorted(p.name for p in (out / "trace").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]


def test_torchrun_environment_picks_the_worker(monkeypatch):
    """Rank, device and CPU threads from torchrun's variables; a --gpus list maps LOCAL_RANK onto it."""
    monkeypatch.delenv("RANK", raising=False)
    assert torchrun_worker() is None  # not under torchrun: launch starts the processes itself
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    w = torchrun_worker([5, 7])  # `--gpus 5,7` on a node torchrun gave two processes
    assert (w.rank, w.world_size, w.local_rank, w.on_this_machine, w.device) == (3, 4, 1, 2, torch.device("cuda", 7))
    with pytest.raises(DeviceError, match="--nproc-per-node 3"):
        torchrun_worker([5, 6, 7])
    with pytest.raises(DeviceError, match="--procs 2 under torchrun"):
        launch(lambda w: None, (), procs=2)
    before = torch.get_num_threads()
    local = torchrun_worker()  # a CPU worker where there is no GPU
    all_idle = lambda: float(os.cpu_count())  # noqa: E731 (a machine with every core idle)
    with worker_threads(local, idle=all_idle):  # two of the four ranks on this machine share its cores
        assert torch.get_num_threads() == (min(max(1, os.cpu_count() // 2), before) if local.device.type == "cpu"
                                           else before)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with worker_threads(torchrun_worker(), idle=all_idle):  # alone on its node: all of them
        assert torch.get_num_threads() == before
