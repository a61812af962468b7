"""Benchmarks a user can run before a long job; each prints ratios measured side by side.

- `disk`: sequential write/read bandwidth of the cache's filesystem (read cold via fadvise).
- `codec`: compression ratio and per-thread encode/decode speed on hidden-state-shaped data.
- `extract`: the full extract path against the bare truncated forward on the same batches, for a
  target of a chosen shape (`SHAPES`: Qwen3-8B, SmolLM2-135M, or the hybrid Qwen3.5-9B and -27B).
- `train`: drafter steps with the real loader against the same steps on batches already on
  the device.
- `ranks`: how evenly DDP ranks' steps are loaded, from the sample lengths alone (no timing).

Targets are random-weight models built from a config at real shapes: throughput does not depend
on the weights.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash_cache.core.errors import UserError
from dflash_cache.extract.config import resolve_token_budget as extract_budget
from dflash_cache.train.config import TrainConfig, drafter_config
from dflash_cache.train.cost import QWEN3_8B, run_token_budget

if TYPE_CHECKING:
    from dflash_cache.train.loader import Batch


def _qwen3_5(layers: int, hidden: int, intermediate: int, heads: int, linear_value_heads: int) -> dict:
    """A Qwen3.5 text model (the hub checkpoints' text_config): gated delta-net layers, three to
    each full-attention layer; full attention with 256-dim heads, a quarter of each rotated."""
    return {
        "model_type": "qwen3_5_text", "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 256,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": linear_value_heads, "vocab_size": 248320,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }  # fmt: skip


QWEN3_5_9B = _qwen3_5(32, 4096, 12288, 16, 32)
QWEN3_5_27B = _qwen3_5(64, 5120, 17408, 24, 48)
SMOLLM2_135M = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3.5-9b": QWEN3_5_9B, "qwen3.5-27b": QWEN3_5_27B, "smollm2-135m": SMOLLM2_135M}


class BenchError(UserError, ValueError):
    """A benchmark asked for something it cannot do."""


def shape_config(name: str) -> dict:
    """The config of a random target shape by name (`dflash bench extract --shape`)."""
    if name not in SHAPES:
        raise BenchError(f"--shape {name!r}: expected one of {', '.join(SHAPES)}")
    return SHAPES[name]


LONG_MAX = 32768


def long_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-context samples: uniform from 16K to 32K tokens."""
    return np.random.default_rng(seed).integers(LONG_MAX // 2, LONG_MAX, size=n)


def lognormal_lengths(n: int, lo: int = 64, hi: int = 3072, seed: int = 0) -> np.ndarray:
    """A realistic chat length mix: log-normal, median about 600 tokens, clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.8, size=n), lo, hi).astype(np.int64)


class PeakRSS:
    """Samples this process's resident memory in a thread; `peak` is the largest seen."""

    def __init__(self, every: float = 0.05):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            time.sleep(self.every)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache, so the next read comes from the disk."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk(path: Path, size_mb: int = 2048) -> dict[str, float]:
    """Sequential write (with fsync) and cold read bandwidth of the filesystem holding `path`."""
    path.mkdir(parents=True, exist_ok=True)
    f = path / f".dflash-bench-{os.getpid()}"
    block = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    n = max(1, size_mb // 64)
    try:
        t = time.perf_counter()
        with open(f, "wb") as fh:
            for _ in range(n):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        write = n * len(block) / (time.perf_counter() - t)
        drop_page_cache([f])
        t = time.perf_counter()
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
        read = n * len(block) / (time.perf_counter() - t)
    finally:
        f.unlink(missing_ok=True)
    return {"write_GBps": write / 1e9, "read_GBps": read / 1e9, "bytes": n * len(block)}


def codec(hidden: torch.Tensor | None = None, level: int = 3, rows: int = 4096, width: int = 5 * 4096,
          threads: int = 4) -> dict:
    """zstd on bf16 hidden-state bits: ratio, single-thread encode/decode GB/s, and a unit's reads
    through zarr and through `ShardRows` (`unit_reads`)."""
    from numcodecs import Zstd

    if hidden is None:  # activations are heavy-tailed: a Student-t stands in for real ones
        torch.manual_seed(0)
        hidden = (torch.distributions.StudentT(4.0).sample((rows, width)) * 0.5).to(torch.bfloat16)
    raw = hidden.contiguous().view(torch.int16).cpu().numpy().tobytes()
    z = Zstd(level=level)
    t = time.perf_counter()
    enc = z.encode(raw)
    t_enc = time.perf_counter() - t
    t = time.perf_counter()
    z.decode(enc)
    t_dec = time.perf_counter() - t
    bits = hidden.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    return {"ratio": len(raw) / len(enc), "encode_GBps": len(raw) / t_enc / 1e9, "decode_GBps": len(raw) / t_dec / 1e9,
            "level": level, **unit_reads(bits, level=level, threads=threads)}  # fmt: skip


def unit_reads(bits: np.ndarray, *, level: int = 3, threads: int = 4, repeats: int = 3) -> dict:
    """The loader's reads of one unit's hidden rows, in pieces of 8 chunks over `threads` threads,
    through zarr and through the zarr-free `ShardRows`, side by side on the same files (in the page
    cache): decoded GB/s of each, best of `repeats`."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_cache.cache.format import UnitArrays, UnitReader, chunk_tokens_for, write_group
    from dflash_cache.cache.spec import StorageInfo

    n = bits.shape[0]
    chunk = chunk_tokens_for(bits.shape[1] * 2)
    storage = StorageInfo(dtype="bf16", codec={"name": "zstd", "level": level, "checksum": True}, chunk_tokens=chunk)
    arrays = UnitArrays(hidden=bits, input_ids=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                        offsets=np.array([0, n]), sample_index=np.array([0]))  # fmt: skip
    out = np.empty_like(bits)
    pieces = [(a, min(n, a + 8 * chunk)) for a in range(0, n, 8 * chunk)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(threads) as pool:
        write_group(Path(tmp) / "u", 0, arrays, storage)
        readers = {"zarr": UnitReader(Path(tmp) / "u", direct=False), "direct": UnitReader(Path(tmp) / "u")}
        best = {}
        for _ in range(repeats):
            for name, reader in readers.items():
                t = time.perf_counter()
                list(pool.map(lambda p, r=reader: r.read_into("hidden", p[0], p[1], out[p[0] : p[1]]), pieces))
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
        assert np.array_equal(out, bits)
    return {"read_threads": threads, "zarr_read_GBps": bits.nbytes / best["zarr"] / 1e9,
            "direct_read_GBps": bits.nbytes / best["direct"] / 1e9, "direct_over_zarr": best["zarr"] / best["direct"]}


@contextmanager
def _python_load():
    """A thread that runs Python (holding the GIL) until the block ends, as a launch loop does."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def commit(out: Path, *, units: int = 8, rows: int = 3200, width: int = 5 * 4096, writers: int = 2) -> dict:
    """Unit commits while another thread of the process runs Python, as extraction's forward loop
    does: writer threads in the process (the design before commit.py) against writer processes.
    Both write the same bf16-shaped units; the figures are raw MB/s committed."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_cache.cache.format import RowFormat, UnitArrays, chunk_tokens_for
    from dflash_cache.cache.spec import StorageInfo
    from dflash_cache.cache.store import write_unit
    from dflash_cache.extract.commit import BufferLayout, Committer, SharedBuffers

    out = Path(out) / f".dflash-bench-commit-{os.getpid()}"  # only this is written, and removed
    torch.manual_seed(0)
    bits = (torch.distributions.StudentT(4.0).sample((rows, width)) * 0.5).to(torch.bfloat16).view(torch.int16).numpy()
    meta = {"input_ids": np.zeros(rows, np.int32), "loss_mask": np.ones(rows, np.uint8),
            "offsets": np.array([0, rows]), "sample_index": np.array([0])}  # fmt: skip
    storage = StorageInfo(dtype="bf16", codec={"name": "zstd", "level": 3, "checksum": True},
                          chunk_tokens=chunk_tokens_for(width * 2))  # fmt: skip
    times = {}
    with _python_load(), ThreadPoolExecutor(writers) as pool:
        t = time.perf_counter()
        arrays = UnitArrays(hidden=bits.view(np.uint16), **meta)
        for f in [pool.submit(write_unit, out / "threads", u, arrays, storage) for u in range(units)]:
            f.result()
        times["threads"] = time.perf_counter() - t
    shared = SharedBuffers(BufferLayout(count=writers + 1, rows=rows, row=RowFormat("bf16", width, 1)))
    for arrays in shared.arrays:
        arrays["hidden"][:] = bits
    committed = threading.Semaphore(0)
    committer = Committer(out / "processes", storage, shared, writers, lambda _: committed.release())

    def commit_units(ids: range) -> None:
        for u in ids:
            committer.commit(committer.take(), u, rows, meta["offsets"], meta["sample_index"], meta["input_ids"],
                             meta["loss_mask"])  # fmt: skip
        for _ in ids:
            committed.acquire()

    commit_units(range(units, units + writers))  # warm-up: the writer processes start and import
    with _python_load():
        t = time.perf_counter()
        commit_units(range(units))
        times["processes"] = time.perf_counter() - t
    committer.close()
    shutil.rmtree(out, ignore_errors=True)
    raw = units * bits.nbytes / 1e6
    return {"units": units, "unit_MB": bits.nbytes / 1e6, "writers": writers, "threads_MBps": raw / times["threads"],
            "processes_MBps": raw / times["processes"], "ratio": times["threads"] / times["processes"]}  # fmt: skip


@dataclass
class RandomTarget:
    """A random-weight model of a real shape, cut and tapped like a loaded target."""

    config: dict[str, Any]
    layer_ids: list[int]
    device: torch.device
    final: bool = False  # every layer and the final norm run, for the final hidden state

    def build(self):
        from transformers import AutoConfig, AutoModelForCausalLM

        from dflash_cache.extract.target import TappedTarget

        cfg = AutoConfig.for_model(**self.config)
        if not self.final:  # the layers above the last tap never run
            n = max(self.layer_ids) + 1
            if getattr(cfg, "layer_types", None):  # a hybrid's per-layer kinds, as many as its layers
                cfg.layer_types = list(cfg.layer_types[:n])
            cfg.num_hidden_layers = n
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.eval().requires_grad_(False)
        return TappedTarget(model, self.layer_ids, cfg.num_hidden_layers, self.final)


def synthetic_dataset(lengths: np.ndarray, vocab: int, seed: int = 0):
    """A tokenized dataset (as `data.tokenize` returns) of random token ids with given lengths."""
    import datasets

    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict({
        "sample_index": np.arange(len(lengths)),
        "input_ids": [rng.integers(0, vocab, size=n, dtype=np.int32) for n in lengths],
        "loss_mask": [np.ones(n, dtype=np.uint8) for n in lengths],
        "length": lengths.astype(np.int32),
    })  # fmt: skip


def bench_spec(config: dict, layer_ids: list[int], plan, storage: str, chunk_tokens: int, final_hidden: bool = False,
               projection=None):  # fmt: skip
    """A cache spec for a synthetic benchmark cache."""
    from dflash_cache.cache.spec import CacheSpec, DataInfo, LayerInfo, PlanInfo, StorageInfo, TargetInfo, TokenizerInfo

    return CacheSpec(
        target=TargetInfo(path="random", revision=None, weights_fingerprint="random", config_digest="random",
                          model_type=config["model_type"], num_layers=config["num_hidden_layers"],
                          hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                          compute_dtype="bfloat16", tied_embeddings=False, config=config),
        layers=LayerInfo(ids=layer_ids, final_hidden=final_hidden),
        storage=StorageInfo(dtype=storage, codec={"name": "zstd", "level": 3, "checksum": True},
                            chunk_tokens=chunk_tokens),
        tokenizer=TokenizerInfo(digest="random", chat_template_digest=None, mask_token_id=config["vocab_size"] - 1,
                                pad_token_id=0, eos_token_ids=[]),
        data=DataInfo(source="synthetic", fingerprint="synthetic", max_length=max(3072, *plan.bucket_edges),
                      truncate=False,
                      num_rows=plan.num_samples, num_rejected=0),
        plan=PlanInfo(bucket_edges=list(plan.bucket_edges), token_budget=plan.token_budget,
                      unit_tokens=plan.unit_tokens, num_units=len(plan.units), num_samples=plan.num_samples,
                      num_tokens=plan.num_tokens, padded_tokens=plan.padded_tokens),
        projection=projection,
    )  # fmt: skip


@contextmanager
def _timer(device: torch.device, out: dict, key: str):
    _sync(device)
    t = time.perf_counter()
    yield
    _sync(device)
    out[key] = time.perf_counter() - t


def _plan_batches(plan, dataset, device: torch.device):
    """(unit, batch, padded input ids, real-token index) for every forward batch of a plan."""
    from dflash_cache.extract.stage import batch_inputs, unit_tokens

    for unit in plan.units:
        ids, *_ = unit_tokens(dataset, unit)
        for b in unit.batches:
            r0, r1 = int(unit.offsets[b.start]), int(unit.offsets[b.stop])
            inp, index = batch_inputs(ids[r0:r1], unit.lengths[b.start : b.stop], b.max_len, 0, device)
            yield unit, b, inp, index


def _steady_rate(plan, marks: dict) -> float:
    """Tokens/s between the first and the last batch launch (the first batch's tokens excluded)."""
    first = plan.units[0]
    b = first.batches[0]
    tokens = plan.num_tokens - int(first.offsets[b.stop] - first.offsets[b.start])
    return tokens / max(marks["last"] - marks["first"], 1e-9)


def extract(out: Path, *, config: dict = QWEN3_8B, num_tokens: int = 2_000_000, token_budget: int | None = None,
            storage: str = "bf16", unit_mb: int = 512, writers: int = 6,
            device: torch.device | None = None, target=None, long: bool = False,
            lengths: np.ndarray | None = None, final_hidden: bool = False,
            project: int | None = None, project_basis: str = "joint") -> dict[str, Any]:  # fmt: skip
    """Full extract path vs the bare truncated forward, same model, same batches, one process.
    `long`: samples of 16K to 32K tokens instead of the chat mix; `lengths`: these samples instead
    (e.g. a cache's, from `cache_lengths`). `final_hidden`: the cache also holds the final hidden
    state (what DSpark trains on); the bare forward then runs every layer. `project`: the cache
    holds that many projected values a token (the stage's fit, timed apart as fit_s, on the
    random target's own features); the bare forward stays the target's alone, so the ratio
    carries the projection's product."""
    from dflash_cache.cache.format import RowFormat, chunk_tokens_for, encode_rows, host_rows
    from dflash_cache.cache.spec import ProjectionInfo, default_bucket_edges, default_layer_ids, write_spec
    from dflash_cache.cache.store import committed_units
    from dflash_cache.extract.plan import make_plan
    from dflash_cache.extract.stage import copy_out, extract_units, fit_projection, projecting

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_budget = extract_budget(token_budget, device.type == "cuda")  # the stage's default
    layer_ids = default_layer_ids(config["num_hidden_layers"])
    target = target or RandomTarget(config, layer_ids, device, final_hidden).build()
    if lengths is None:
        lengths = long_lengths(max(2, num_tokens // 24576)) if long else lognormal_lengths(max(8, num_tokens // 700))
    lengths = np.asarray(lengths, dtype=np.int64)
    dataset = synthetic_dataset(lengths, config["vocab_size"])
    projection = None
    if project:
        projection = ProjectionInfo(basis=project_basis, rank=project, scaling="layer-rms", fit_tokens=131072)
    row = RowFormat.planned(storage, len(layer_ids), config["hidden_size"], projection, final=final_hidden)
    row_bytes = row.hidden_bytes
    plan = make_plan(lengths, bucket_edges=default_bucket_edges(LONG_MAX if long else 3072),
                     token_budget=max(token_budget, int(lengths.max())),
                     unit_tokens=(unit_mb << 20) // row_bytes)  # fmt: skip
    spec = bench_spec(config, layer_ids, plan, storage, chunk_tokens_for(row_bytes), final_hidden, projection)
    out.mkdir(parents=True, exist_ok=True)
    bare_target, fit_s = target, 0.0
    if projection is not None:
        t = time.perf_counter()
        basis, spec = fit_projection(target, spec, plan, dataset, device)
        _sync(device)
        fit_s = time.perf_counter() - t
        spec = dataclasses.replace(spec, projection=dataclasses.replace(spec.projection, digest=basis.save(out)))
        target = projecting(target, basis, len(layer_ids))
    write_spec(out, spec)
    # warm up kernels on the largest batch, outside the timings
    target(next(_plan_batches(plan, dataset, device))[2])
    # The full path runs first, so any first-use cost of a batch shape is charged to it, not
    # to the bare forward it is compared with. "steady" runs from the first batch to the last,
    # leaving out two one-time costs a long job amortises: pinning the unit buffers (about a
    # second per GiB, setup_s) and committing the units still queued after the last forward
    # (drain_s). Back-pressure from slow writers still lands inside it: the forward loop waits
    # for a free buffer.
    times: dict[str, float] = {}
    written = {"bytes": 0, "first": 0.0, "last": 0.0, "wait": 0.0}

    def report(d: dict) -> None:
        written["bytes"] += d.get("bytes", 0)
        written["wait"] += d.get("buffer_wait_s", 0)
        if "tokens" in d:
            written["last"] = time.perf_counter()
            written["first"] = written["first"] or written["last"]

    with PeakRSS() as rss, _timer(device, times, "full"):
        t0 = time.perf_counter()
        extract_units(target, list(plan.units), dataset, spec, out, device, report, writers=writers)
    times["setup"], times["drain"] = written["first"] - t0, t0 + times["full"] - written["last"]
    with _timer(device, times, "bare"):
        for *_, inp, _index in _plan_batches(plan, dataset, device):
            bare_target(inp)
    # Forward, unpad and the device-to-host copy into one pinned buffer, without compression or
    # disk: separates what the copy-out costs from what the writers cost.
    buf = host_rows(max(u.num_tokens for u in plan.units), row, pin=device.type == "cuda")
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with _timer(device, times, "staged"):
        for unit, b, inp, index in _plan_batches(plan, dataset, device):
            copy_out(stream, buf, int(unit.offsets[b.start]), int(unit.offsets[b.stop]),
                     encode_rows(target(inp), index, row))
    assert len(committed_units(out)) == len(plan.units)
    from dflash_cache.extract.target import linear_attention_kernels

    hybrid = "linear_attention" in config.get("layer_types", ())
    return {
        "model_type": config["model_type"],
        **({f"kernel_{k}": v for k, v in linear_attention_kernels().items()} if hybrid else {}),
        "tokens": plan.num_tokens, "samples": plan.num_samples, "units": len(plan.units),
        "padding": plan.padding_ratio, "storage": storage, "project": project, "fit_s": fit_s,
        "raw_bf16_bytes_per_token": 2 * len(layer_ids) * config["hidden_size"],
        "bare_tok_s": plan.num_tokens / times["bare"], "full_tok_s": plan.num_tokens / times["full"],
        "ratio": times["bare"] / times["full"], "setup_s": times["setup"], "drain_s": times["drain"],
        "steady_ratio": _steady_rate(plan, written) * times["bare"] / plan.num_tokens,
        "staged_ratio": times["bare"] / times["staged"], "buffer_wait_s": written["wait"],
        "bytes_per_token": written["bytes"] / plan.num_tokens, "raw_bytes_per_token": row_bytes + row.final_bytes,
        "peak_rss_GB": rss.peak / 1e9,
    }  # fmt: skip


def peer_baseline(out: Path, *, config: dict = QWEN3_8B, num_tokens: int = 2_000_000, token_budget: int | None = None,
                  device: torch.device | None = None, max_files: int = 2000) -> dict[str, Any]:  # fmt: skip
    """The common practice this project replaces, on the same length mix and batches: the full
    model with `output_hidden_states=True`, one `torch.save` file per sample holding the padded
    tapped layers, then a loader that `torch.load`s the files one by one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cache.cache.spec import default_bucket_edges, default_layer_ids
    from dflash_cache.extract.plan import make_plan
    from dflash_cache.extract.stage import batch_inputs

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_budget = extract_budget(token_budget, device.type == "cuda")  # the stage's default
    layer_ids = default_layer_ids(config["num_hidden_layers"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()
    lengths = lognormal_lengths(max(8, int(num_tokens / 700)))
    plan = make_plan(lengths, bucket_edges=default_bucket_edges(3072), token_budget=token_budget, unit_tokens=1 << 62)
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    n_files = tokens = 0
    with torch.inference_mode(), _timer(device, times, "extract"):
        for unit in plan.units:
            for b in unit.batches:
                lens = unit.lengths[b.start : b.stop]
                ids = rng.integers(0, config["vocab_size"], size=int(lens.sum()), dtype=np.int32)
                inp, _ = batch_inputs(ids, lens, b.max_len, 0, device)
                hs = model(input_ids=inp, output_hidden_states=True).hidden_states
                padded = torch.stack([hs[i + 1] for i in layer_ids], dim=1).cpu()  # [b, K, T, H], padding kept
                for j in range(len(lens)):
                    torch.save({"input_ids": inp[j].cpu(), "hidden_states": padded[j].clone()},
                               out / f"{n_files:08d}.pt")  # fmt: skip
                    n_files += 1
                tokens += int(lens.sum())
    nbytes = sum(f.stat().st_size for f in out.glob("*.pt"))
    files = sorted(out.glob("*.pt"))
    order = rng.permutation(len(files))[:max_files]
    loaded = 0
    with _timer(device, times, "load"):
        for k in order:
            d = torch.load(files[k], map_location="cpu")
            loaded += d["hidden_states"].shape[1]  # padded tokens per file
            d["hidden_states"].to(device, non_blocking=False)
    return {
        "files": n_files, "tokens": tokens, "extract_tok_s": tokens / times["extract"],
        "bytes_per_token": nbytes / tokens, "loader_padded_tok_s": loaded / times["load"],
    }  # fmt: skip


def loader_rate(cache: Path, *, token_budget: int | None = None, device: torch.device | None = None,
                max_batches: int = 50) -> dict[str, Any]:  # fmt: skip
    """Tokens/s of the streaming loader alone (decode, pinned staging, copy to the device)."""
    from dflash_cache.train.loader import CacheLoader

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_budget = extract_budget(token_budget, device.type == "cuda")  # the stage's default
    loader = CacheLoader(cache, token_budget=token_budget, device=device)
    times: dict[str, float] = {}
    tokens = 0
    with _timer(device, times, "load"):
        for i, batch in enumerate(loader.epoch(0)):
            tokens += batch.num_tokens
            if i + 1 >= max_batches:
                break
    return {"loader_tok_s": tokens / times["load"], "batches": min(max_batches, loader.num_batches(0))}


def shape_of(target: str | Path) -> dict[str, Any]:
    """A target's text config (its shape: layers, widths, vocabulary) for a random benchmark model."""
    from dflash_cache.extract.target import load_config, text_config

    config = text_config(load_config(str(target)))
    keep = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version", "dtype")}
    return {**keep, "model_type": config.get("model_type") or "llama"}


def write_random_frozen(cache: Path, config: dict) -> None:
    from dflash_cache.cache.store import write_frozen

    g = torch.Generator().manual_seed(0)
    shape = (config["vocab_size"], config["hidden_size"])
    write_frozen(cache, torch.randn(shape, generator=g).mul_(0.02).bfloat16(),
                 torch.randn(shape, generator=g).mul_(0.02).bfloat16())  # fmt: skip


def train(cache: Path, *, steps: int = 20, warmup: int = 3, token_budget: int | None = None,
          max_anchors: int = TrainConfig.max_anchors, block_size: int | None = TrainConfig.block_size,
          draft_layers: int = TrainConfig.draft_layers, readers: int | None = None, cold: bool = False,
          device: torch.device | None = None, drafter: str = TrainConfig.drafter) -> dict[str, Any]:  # fmt: skip
    """Drafter steps with the real loader reading `cache` vs the same steps on batches already on
    the device. Both phases run the same batches (the first `steps` of epoch 0 after `warmup`),
    after every one of them has run once untimed, so neither phase pays for compiling.
    Also the useful TFLOP/s and MFU of the in-memory steps (the drafter family's count,
    `Family.flops`). The drafter, its optimizer and the loader are the train stage's own
    (`stage.setup`), on one rank; `drafter` names the family (dspark needs a `final_hidden` cache).

    `cold` evicts the cache's files from the page cache first, so the loader reads the disk.
    `loader_GBps` (bytes on disk read per second by the loader) and `step_GBps` (what the
    in-memory step would consume) set the loader against `bench disk`'s bandwidth."""
    from dflash_cache.train.metrics import peak_flops

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(cache=cache, out=cache, token_budget=token_budget, max_anchors=max_anchors,
                      block_size=block_size, draft_layers=draft_layers, drafter=drafter,
                      **({"readers": readers} if readers else {}))  # fmt: skip
    steps_of = _BenchSteps(cfg, device)
    s, loader = steps_of.setup, steps_of.setup.loader
    n = min(steps + warmup, loader.num_batches(0))
    files = [p for p in cache.glob("units/**/*") if p.is_file()]
    disk_bytes_per_token = sum(p.stat().st_size for p in files) / max(1, loader.epoch_tokens)
    # Every batch's shapes are compiled before either phase is timed: the compiled stages meet
    # a new shape now and then in the first tens of steps of a run, and a warm-up of a few steps
    # left those compiles inside the loader phase (0.59x on an H200 where the run itself showed
    # no loader wait).
    for batch in itertools.islice(loader.epoch(0), n):
        steps_of.step(batch)
    if cold:
        drop_page_cache(files)
    times: dict[str, float] = {}
    wait, peak_gpu, peak_rss = _loader_phase(steps_of, warmup, n, times)
    kept = list(itertools.islice(loader.epoch(0), warmup, n))
    steps_of.useful.clear()
    with _timer(device, times, "memory"):  # the very same batches, already on the device
        for batch in kept:
            steps_of.step(batch)
    measured = len(kept)
    context_tokens = sum(b.num_tokens for b in kept)
    tflops = steps_of.useful_flops() / times["memory"] / 1e12
    peak = peak_flops(device)
    loader.close()
    return {
        "drafter": s.family.name, "block_size": s.dcfg.block_size,
        "steps": measured, "token_budget": cfg.token_budget, "max_anchors": max_anchors,
        "drafter_hidden": s.dcfg.hidden_size, "drafter_layers": s.dcfg.num_hidden_layers,
        "loader_steps_s": measured / times["loader"], "memory_steps_s": measured / times["memory"],
        "ratio": times["memory"] / times["loader"], "loader_wait_per_step_s": wait / max(1, measured),
        "context_tok_s": context_tokens / times["loader"], "peak_gpu_GB": peak_gpu / 1e9, "peak_rss_GB": peak_rss / 1e9,
        "readers": cfg.readers, "memory_tflops": tflops, "memory_mfu": tflops * 1e12 / peak if peak else None,
        "cold": cold, "loader_GBps": context_tokens * disk_bytes_per_token / times["loader"] / 1e9,
        "step_GBps": context_tokens * disk_bytes_per_token / times["memory"] / 1e9,
    }  # fmt: skip


class _BenchSteps:
    """The train stage's own drafter, optimizer and loader on one rank (`stage.setup`, writing nothing
    to `cfg.out`), and its steps: each one a forward, backward and optimizer step, whose useful-FLOPs
    terms (`Family.flops`) are kept in `useful`. Without a token budget, the stage's default for this
    drafter on a cache too large to cap it."""

    def __init__(self, cfg: TrainConfig, device: torch.device):
        from dflash_cache.cache.spec import read_spec
        from dflash_cache.core.devices import Worker
        from dflash_cache.train.stage import setup

        if cfg.token_budget is None:
            spec = read_spec(cfg.cache)
            cfg.token_budget = run_token_budget(cfg, drafter_config(cfg, spec), spec, device, few_steps_cap=False)
        self.setup = setup(Worker(0, 1, device), cfg)
        self.flops = self.setup.family.flops(self.setup.model)
        self.useful: list[tuple] = []  # (blocks, context tokens, sum of anchors, scored slots) a step

    def step(self, batch: Batch) -> None:
        from dflash_cache.train.stage import train_step

        s = self.setup
        out = train_step(s.objective, s.model, s.embed, s.head, batch, s.anchors(batch), s.cfg.grad_accum)
        s.opt.step()
        s.opt.zero_grad(set_to_none=True)
        blocks = out.blocks
        self.useful.append((blocks.layout.num_blocks, batch.num_tokens, blocks.layout.block_anchor.sum(),
                            0 if out.scored is None else out.scored))  # fmt: skip

    def useful_flops(self) -> float:
        """The useful FLOPs of the steps in `useful`."""
        return sum(self.flops(nb, ctx, int(anchors), int(scored)) for nb, ctx, anchors, scored in self.useful)


def _loader_phase(steps_of: _BenchSteps, warmup: int, n: int, times: dict[str, float]) -> tuple[float, int, int]:
    """Batches `warmup` to `n` of epoch 0 stepped as the real loader streams them (times["loader"]);
    returns the loader's wait over them, the peak GPU memory (bytes, 0 on a CPU) and the peak RSS."""
    loader, device = steps_of.setup.loader, steps_of.setup.worker.device
    it = loader.epoch(0)
    for _ in range(warmup):
        next(it)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wait0 = loader.wait_seconds
    steps_of.useful.clear()
    with PeakRSS() as rss, _timer(device, times, "loader"):
        for _ in range(warmup, n):
            steps_of.step(next(it))
    wait = loader.wait_seconds - wait0
    peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return wait, peak_gpu, rss.peak


def cache_lengths(cache: Path) -> tuple[np.ndarray, list[int] | None]:
    """A cache's sample lengths and its plan's bucket edges, for `rank_balance`."""
    from dflash_cache.cache.spec import read_spec
    from dflash_cache.train.batching import SampleTable
    from dflash_cache.train.loader import open_units

    spec = read_spec(cache)
    return SampleTable.from_units(open_units(cache, spec=spec)[0]).length, list(spec.plan.bucket_edges) or None


def rank_balance(lengths: np.ndarray, *, token_budget: int = 4096, block_size: int | None = TrainConfig.block_size,
                 max_anchors: int = TrainConfig.max_anchors,
                 ranks: tuple[int, ...] = (2, 4, 8), bucket_edges: list[int] | None = None,
                 seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Predicted DDP speed-up over one rank, batches dealt as they come against dealt by cost (what
    `dflash train` does). A step lasts as long as its costliest rank's batch, with a batch's cost
    modelled by `cost.drafter_cost`; no timing, so it runs anywhere, on a cache's lengths."""
    from dflash_cache.cache.spec import default_bucket_edges
    from dflash_cache.train.batching import SampleTable, pack_and_deal
    from dflash_cache.train.cost import drafter_cost

    lengths = np.asarray(lengths, dtype=np.int64)
    table = SampleTable(np.zeros_like(lengths), np.zeros_like(lengths), lengths, np.arange(len(lengths)))
    edges = bucket_edges or default_bucket_edges(int(lengths.max()))
    block_size = block_size or TrainConfig(cache=Path(), out=Path()).family().default_block_size  # dflash train's
    cost_of = partial(drafter_cost, block_size=block_size, max_anchors=max_anchors)

    def dealt(world: int, by_cost: bool) -> list[list[np.ndarray]]:  # the same packing every time (same seed)
        return pack_and_deal(table, np.random.default_rng(seed), token_budget=token_budget, bucket_edges=edges,
                             world_size=world, final=False, batch_cost=cost_of if by_cost else None)[0]  # fmt: skip

    cost = np.array([cost_of(lengths[b]) for b in dealt(1, False)[0]])
    out: dict[str, Any] = {"samples": len(lengths), "batches": len(cost),
                           "batch_cost_spread": float(cost.max() / cost.min())}  # fmt: skip
    for w in ranks:
        for name, by_cost in (("as_they_come", False), ("by_cost", True)):
            per_rank = dealt(w, by_cost)
            steps = np.array([[cost_of(lengths[r[i]]) for r in per_rank] for i in range(len(per_rank[0]))])
            out[f"speedup_{w}_{name}"] = float(w * steps.mean(1).sum() / steps.max(1).sum())
    return out
