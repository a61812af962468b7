"""The benchmarks run end to end on the CPU at toy sizes (their speeds only count from a GPU), and
what they report is what they did: the bytes they report are the files they wrote, their ratios
come from their own times, the data they write reads back as they were given it, and their caches
verify and hold the named shape's taps and widths."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import TINY_TARGET, read_cache

from dflash_cache.bench.extract import extract as bench_extract
from dflash_cache.bench.extract import write_random_frozen
from dflash_cache.bench.io import codec, commit, disk
from dflash_cache.bench.ranks import cache_lengths, rank_balance
from dflash_cache.bench.shapes import LONG_MAX, QWEN3_5_9B, QWEN3_8B, SMOLLM2_135M, shape_config
from dflash_cache.bench.train import resident
from dflash_cache.bench.train import train as bench_train
from dflash_cache.cache.audit import verify
from dflash_cache.cache.spec import default_layer_ids, read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.target.hybrid import linear_attention_kernels
from dflash_cache.train.loader import CacheLoader

TINY = dict(QWEN3_8B, num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
# Qwen3.5-9B's layout (three gated delta-net layers to one full-attention layer) at a toy width
TINY_HYBRID = dict(QWEN3_5_9B, num_hidden_layers=8, layer_types=QWEN3_5_9B["layer_types"][:8],
                   hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   vocab_size=512)  # fmt: skip
TINY_HYBRID["rope_parameters"] = dict(QWEN3_5_9B["rope_parameters"], mrope_section=[1, 1, 0])  # 2 frequencies


def test_disk_codec_and_commit(tmp_path, monkeypatch):
    """What each storage benchmark reports is what it wrote and read: the bytes of the disk test's
    file, zstd's ratio on the given states (which decode back to them), and every unit both commit
    variants wrote holding the states it was given; its scratch files are gone after."""
    from numcodecs import Zstd

    from dflash_cache.bench import io

    written = []

    def drop(paths):  # the disk test evicts its file just after writing it
        written.extend(f.stat().st_size for f in paths)
        evict(paths)

    evict = io.drop_page_cache
    monkeypatch.setattr(io, "drop_page_cache", drop)
    d = disk(tmp_path, size_mb=64)
    assert d["bytes"] == 64 << 20 == sum(written) and d["write_GBps"] > 0 and d["read_GBps"] > 0

    torch.manual_seed(0)
    hidden = (torch.distributions.StudentT(4.0).sample((256, 512)) * 0.5).to(torch.bfloat16)
    c = codec(hidden)
    raw = hidden.view(torch.int16).numpy().tobytes()
    encoded = Zstd(level=c["level"]).encode(raw)
    assert c["ratio"] == len(raw) / len(encoded) and 1.0 < c["ratio"] < 4.0
    assert Zstd(level=c["level"]).decode(encoded) == raw
    assert c["direct_over_zarr"] == pytest.approx(c["direct_read_GBps"] / c["zarr_read_GBps"])
    assert c["write_direct_over_zarr"] == pytest.approx(c["direct_write_GBps"] / c["zarr_write_GBps"])

    rows, width = 200, 256
    units: dict[str, dict[str, np.ndarray]] = {}

    def rmtree(path, ignore_errors=False):  # the benchmark's clean-up: read what it committed first
        for variant in ("threads", "processes"):
            for u, unit in committed_units(path / variant).items():
                units.setdefault(variant, {})[u] = UnitReader(unit).read("hidden", 0, rows)
        shutil.rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(io, "shutil", SimpleNamespace(rmtree=rmtree))
    m = commit(tmp_path, units=2, rows=rows, width=width, writers=1)
    assert m["threads_MBps"] > 0 and m["processes_MBps"] > 0
    assert m["ratio"] == pytest.approx(m["processes_MBps"] / m["threads_MBps"])
    assert m["unit_MB"] == rows * width * 2 / 1e6
    assert sorted(units["threads"]) == [0, 1] and sorted(units["processes"]) == [0, 1, 2]  # unit 2: the warm-up
    torch.manual_seed(0)
    bits = (torch.distributions.StudentT(4.0).sample((rows, width)) * 0.5).to(torch.bfloat16).view(torch.int16)
    for got in (*units["threads"].values(), *units["processes"].values()):
        np.testing.assert_array_equal(got.view(np.int16), bits.numpy())
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # its scratch folder is gone


def test_extract_and_train_benchmarks(tmp_path):
    out = tmp_path / "bx"
    x = bench_extract(out, config=TINY, num_tokens=20000, unit_mb=1, writers=1)
    spec = read_spec(out)
    assert len(committed_units(out)) == x["units"] == spec.plan.num_units and verify(out) == {}
    assert x["tokens"] == spec.plan.num_tokens and 0 < x["padding"] < 0.5
    assert x["padding"] == pytest.approx(1 - spec.plan.num_tokens / spec.plan.padded_tokens)
    # the cache is the named shape's: its taps, widths and vocabulary, every planned sample's rows
    assert (spec.target.model_type, spec.target.hidden_size, spec.target.vocab_size) == ("qwen3", 64, 512)
    assert spec.layers.ids == default_layer_ids(TINY["num_hidden_layers"])
    cached = read_cache(out)
    assert len(cached) == x["samples"] == spec.plan.num_samples
    assert sum(len(ids) for _, ids, _, _ in cached.values()) == x["tokens"]
    assert all(h.shape == (len(ids), len(spec.layers.ids) * 64) for h, ids, _, _ in cached.values())
    assert x["raw_bytes_per_token"] == len(spec.layers.ids) * 64 * 2 and 0 < x["bytes_per_token"]
    # the bytes it reports are the units' files on disk (each unit's manifest aside)
    on_disk = sum(f.stat().st_size for u in committed_units(out).values() for f in u.rglob("*")
                  if f.is_file() and f != u / "zarr.json")  # fmt: skip
    assert x["bytes_per_token"] * x["tokens"] == pytest.approx(on_disk, rel=1e-12)
    assert all(x[k] > 0 for k in ("ratio", "steady_ratio", "staged_ratio", "setup_s"))
    assert x["ratio"] == pytest.approx(x["full_tok_s"] / x["bare_tok_s"])  # bare seconds over full seconds
    # `bench ranks` on this cache's lengths, through the CLI (sorted runs minimise the sum of step maxima)
    cmd = [sys.executable, "-m", "cli.main", "bench", "ranks", "--cache", str(out), "--token-budget", "512",
           "--max-anchors", "4", "--ranks", "2,3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["samples"] == spec.plan.num_samples
    assert r["speedup_2_as_they_come"] <= r["speedup_2_by_cost"] <= 2 and r["speedup_3_by_cost"] <= 3
    lengths, edges = cache_lengths(out)  # the cache's own sample lengths, as the CLI reads them
    assert sorted(lengths.tolist()) == sorted(len(ids) for _, ids, _, _ in cached.values())
    want = rank_balance(lengths, token_budget=512, max_anchors=4, ranks=(2, 3), bucket_edges=edges)
    assert r == {k: round(v, 4) if isinstance(v, float) else v for k, v in want.items()}  # printed to 4 places
    write_random_frozen(out, TINY)
    t = bench_train(out, steps=2, warmup=1, token_budget=512, max_anchors=4, draft_layers=1, cold=True)
    assert t["steps"] == 2 and t["ratio"] > 0 and t["loader_wait_per_step_s"] >= 0 and t["peak_rss_GB"] > 0
    assert (t["token_budget"], t["max_anchors"], t["drafter_layers"], t["drafter_hidden"]) == (512, 4, 1, 64)
    assert t["ratio"] == pytest.approx(t["loader_steps_s"] / t["memory_steps_s"])  # memory seconds over loader's
    # bytes per token on disk are the cache's: loader_GBps / step_GBps is the ratio itself
    assert t["cold"] and abs(t["loader_GBps"] / t["step_GBps"] - t["ratio"]) < 1e-6
    assert t["loader_GBps"] * 1e9 < x["bytes_per_token"] * 1.2 * t["context_tok_s"]
    unit_files = sum(f.stat().st_size for f in (out / "units").rglob("*") if f.is_file())
    assert t["loader_GBps"] * 1e9 == pytest.approx(t["context_tok_s"] * unit_files / x["tokens"])
    assert t["resident_batches"] == 2  # no cap on a CPU: the in-memory phase holds both measured batches
    # on a GPU the in-memory phase holds only the batches that fit its room, and steps through them in turn
    with CacheLoader(out, token_budget=512, device=torch.device("cpu"), follow=False) as loader:
        want = [b.sample_index.tolist() for b in itertools.islice(loader.epoch(0), 1, 3)]
        assert [b.sample_index.tolist() for b in resident(loader, 1, 3, None)] == want
        assert [b.sample_index.tolist() for b in resident(loader, 1, 3, 1)] == want[:1]  # at least one


@pytest.mark.slow  # samples of 16K to 32K tokens
def test_long_extract_benchmark(tmp_path):
    """`--long` builds samples of 16K to 32K tokens (the loader's hardest case)."""
    out = tmp_path / "lx"
    # two layers: the long samples are what is tested, and each layer costs a quadratic attention on a CPU
    x = bench_extract(out, config=dict(TINY, num_hidden_layers=2), num_tokens=40000, unit_mb=1, writers=1, long=True)
    assert x["samples"] >= 2 and verify(out) == {} and read_spec(out).plan.num_tokens == x["tokens"]
    assert x["tokens"] / x["samples"] >= LONG_MAX // 2


def test_hybrid_extract_benchmark(tmp_path):
    """`--shape qwen3.5-9b`'s path at a toy width: the random hybrid is cut and tapped like a loaded
    one, and the cache it writes verifies. CPU has no flash-linear-attention: the torch path runs."""
    out = tmp_path / "hx"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the torch path's many small ops thrash when the cores are shared
    try:
        x = bench_extract(out, config=TINY_HYBRID, lengths=[40, 70, 130, 250], unit_mb=1, writers=1)
    finally:
        torch.set_num_threads(threads)
    spec = read_spec(out)
    assert verify(out) == {} and x["tokens"] == 490 == spec.plan.num_tokens and spec.layers.ids == [1, 2, 3, 4, 5]
    assert sorted(len(ids) for _, ids, _, _ in read_cache(out).values()) == [40, 70, 130, 250]
    # the kernels it reports are the ones that import here (none on this CPU machine: the torch path)
    assert x["model_type"] == "qwen3_5_text"
    assert {k: x[f"kernel_{k}"] for k in ("fla", "causal_conv1d")} == linear_attention_kernels()
    assert all(x[k] > 0 for k in ("ratio", "steady_ratio", "staged_ratio"))
    assert x["ratio"] == pytest.approx(x["full_tok_s"] / x["bare_tok_s"])
    # the named hybrids: the published layer counts and widths, three gated delta-net layers to each
    # full-attention one, a kind for every layer
    assert shape_config("qwen3.5-9b") is QWEN3_5_9B
    for name, (layers, width) in {"qwen3.5-9b": (32, 4096), "qwen3.5-27b": (64, 5120)}.items():
        shape = shape_config(name)
        kinds = shape["layer_types"]
        assert (shape["num_hidden_layers"], shape["hidden_size"], len(kinds)) == (layers, width, layers)
        assert kinds == (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    from typer.testing import CliRunner

    from cli.main import app

    r = CliRunner().invoke(app, ["bench", "extract", "--out", str(tmp_path / "no"), "--shape", "qwen3.5-4b"])
    assert r.exit_code == 1 and "error: --shape 'qwen3.5-4b': expected one of qwen3-8b, qwen3.5-9b" in r.output


def test_dspark_train_benchmark(tmp_path):
    """`bench extract --final-hidden` then `bench train --drafter dspark`: the GPU measurement of DSpark's
    step (MFU by the family's useful-FLOPs count), here at toy size."""
    out = tmp_path / "bx"
    x = bench_extract(out, config=TINY, num_tokens=8000, unit_mb=1, writers=1, final_hidden=True)
    spec = read_spec(out)
    assert spec.layers.final_hidden and verify(out) == {}
    assert x["raw_bytes_per_token"] == (len(spec.layers.ids) + 1) * 64 * 2  # the taps and the final state
    for unit in committed_units(out).values():  # the taps, and the final state in an array of its own
        r = UnitReader(unit)
        n = int(r.offsets[-1])
        assert r.read("hidden", 0, n).shape == (n, len(spec.layers.ids) * 64)
        assert r.read("final_hidden", 0, n).shape == (n, 64)
    write_random_frozen(out, TINY)
    t = bench_train(out, steps=2, warmup=1, token_budget=512, max_anchors=4, draft_layers=1, drafter="dspark")
    assert t["drafter"] == "dspark" and t["block_size"] == 7 and t["steps"] == 2 and t["memory_tflops"] > 0
    assert (t["drafter_hidden"], t["drafter_layers"]) == (64, 1)
    assert t["ratio"] == pytest.approx(t["loader_steps_s"] / t["memory_steps_s"])


@pytest.mark.slow  # the real model's conversion (the session's `smollm2`): 20-30 s
def test_smollm2_shape_is_the_real_models(smollm2):
    """`--shape smollm2-135m` builds a random model with every weight of the real SmolLM2-135M, at
    the same shape (the tied head aside, which the checkpoint does not store)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    assert shape_config("smollm2-135m") is SMOLLM2_135M
    with torch.device("meta"):
        random = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SMOLLM2_135M))
    want = {k: tuple(v.shape) for k, v in random.state_dict().items()}
    real = {}
    for f in sorted(smollm2.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            real |= {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    assert real and set(want) - set(real) == {"lm_head.weight"}
    assert {k: want[k] for k in real} == real



def test_fixed_length_benchmarks(tmp_path):
    """`bench extract --length N` and `bench train --length N` through the CLI: every sample N tokens,
    the extract run in chunks where N passes --prefill-chunk (its bare forward too), and each reports
    what it reports without --length."""
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    out = tmp_path / "bx"
    r = runner.invoke(app, ["bench", "extract", "--out", str(out), "--like", str(TINY_TARGET), "--length", "300",
                            "--tokens", "900", "--prefill-chunk", "128", "--writers", "1", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    x = json.loads(r.stdout)
    assert (x["samples"], x["tokens"], x["longest"], x["prefill_chunk"], x["chunked_samples"]) == (3, 900, 300, 128, 3)
    assert all(x[k] > 0 for k in ("ratio", "steady_ratio", "staged_ratio", "bare_tok_s", "full_tok_s"))
    assert x["ratio"] == pytest.approx(x["full_tok_s"] / x["bare_tok_s"], rel=1e-3)  # printed to 4 places
    assert verify(out) == {} and sorted(len(ids) for _, ids, _, _ in read_cache(out).values()) == [300] * 3
    phases = [line.split(" (")[0] for line in r.stderr.splitlines() if line.startswith("bench extract: ")]
    assert phases == [f"bench extract: {p}" for p in ("the random target", "warm-up", "the full extract path",
                                                      "the bare forward", "the forward and copies without writers")]
    r = runner.invoke(app, ["bench", "extract", "--out", str(tmp_path / "no"), "--length", "300", "--long"])
    assert r.exit_code == 1 and "error: --length sets every sample's length" in r.output

    cache = tmp_path / "tx"
    r = runner.invoke(app, ["bench", "train", "--cache", str(cache), "--like", str(TINY_TARGET), "--length", "300",
                            "--steps", "2", "--token-budget", "512", "--max-anchors", "4", "--draft-layers", "1",
                            "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)
    assert (t["length"], t["samples"], t["steps"], t["token_budget"], t["drafter_hidden"]) == (300, 5, 2, 512, 64)
    assert (t["project"], t["storage"]) == (64, "fp8")  # dflash extract's default cache: H values in fp8
    assert t["ratio"] == pytest.approx(t["loader_steps_s"] / t["memory_steps_s"], rel=1e-3) and t["memory_tflops"] > 0
    assert verify(cache) == {} and sorted(len(ids) for _, ids, _, _ in read_cache(cache).values()) == [300] * 5
    r = runner.invoke(app, ["bench", "train", "--cache", str(cache), "--length", "300"])  # the cache exists now
    assert r.exit_code == 1 and "with --length the benchmark writes a new cache there" in r.output
    r = runner.invoke(app, ["bench", "train", "--cache", str(tmp_path / "no"), "--length", "300", "--project", "0"])
    assert r.exit_code == 1 and "error: --project 0: expected an integer >= 1 or auto or none" in r.output


def test_sliding_window_train_benchmark(tmp_path):
    """`bench train --sliding-window W [--full-attention-layers L]` on a fixed-length cache: the
    drafter's layers slide as `dflash train`'s would and the result says so, and a step's useful
    FLOPs (what MFU divides) count only the context keys the window lets a block attend: on the
    same cache and batches, fewer than with full attention, and with one of two layers full, the
    mean of the two. Window settings the drafter refuses are refused as `dflash train` refuses
    them, before a cache is written."""
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    cache = tmp_path / "tx"
    r = runner.invoke(app, ["bench", "train", "--cache", str(cache), "--like", str(TINY_TARGET), "--length", "300",
                            "--steps", "2", "--token-budget", "512", "--max-anchors", "4", "--draft-layers", "2",
                            "--sliding-window", "64", "--full-attention-layers", "1", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)
    assert (t["length"], t["steps"], t["drafter_layers"], t["sliding_window"], t["full_attention_layers"]) == (
        300, 2, 2, 64, [1])  # fmt: skip
    assert t["memory_tflops"] > 0 and sorted(len(ids) for _, ids, _, _ in read_cache(cache).values()) == [300] * 5
    # the same cache and batches (and anchors, the seed's) with full attention, every layer sliding, one full
    kw = dict(steps=2, warmup=1, token_budget=512, max_anchors=4, draft_layers=2)
    full = bench_train(cache, **kw, sliding_window="full", profile=tmp_path / "profile.txt")
    slide = bench_train(cache, **kw, sliding_window=64)
    mixed = bench_train(cache, **kw, sliding_window=64, full_attention_layers=[1])
    assert (full["sliding_window"], full["full_attention_layers"]) == (None, None)
    # --profile: the profiled steps' operators by their own time, the drafter's products among them
    table = (tmp_path / "profile.txt").read_text()
    assert full["profile"] == str(tmp_path / "profile.txt") and "Self CPU" in table and "aten::mm" in table
    wall, busy = (float(x) for x in re.match(r"2 steps: ([\d.]+) ms wall, ([\d.]+) ms on the CPU", table).groups())
    assert 0 < busy <= wall * 1.05
    assert full["profile_shares"] is None  # no kernels on a CPU (`test_kernel_classes`)
    assert (slide["sliding_window"], slide["full_attention_layers"]) == (64, None)
    assert (mixed["sliding_window"], mixed["full_attention_layers"]) == (64, [1])
    # anchors up to 299 against a window of 64: a sliding layer's attention reads at most 63 context keys a block
    per_step = {k: v["useful_tflop_per_step"] for k, v in (("full", full), ("slide", slide), ("mixed", mixed))}
    assert 0 < per_step["slide"] < per_step["mixed"] < per_step["full"]
    assert per_step["mixed"] == pytest.approx((per_step["full"] + per_step["slide"]) / 2, rel=1e-3)
    for v in (full, slide, mixed):  # the MFU's TFLOP/s are these FLOPs over the in-memory steps' time
        assert v["memory_tflops"] == pytest.approx(v["useful_tflop_per_step"] * v["memory_steps_s"])

    for args, said in ((["--sliding-window", "0"], "error: --sliding-window 0: expected an integer >= 1"),
                       (["--sliding-window", "full", "--full-attention-layers", "1"], "every layer already attends"),
                       (["--sliding-window", "64", "--full-attention-layers", "0,1"],
                        "--full-attention-layers names every draft layer: use --sliding-window full")):  # fmt: skip
        new = tmp_path / "no"
        r = runner.invoke(app, ["bench", "train", "--cache", str(new), "--length", "300", "--draft-layers", "2",
                                *args])  # fmt: skip
        assert r.exit_code == 1 and said in r.output and not new.exists(), r.output
    r = runner.invoke(app, ["train", "--cache", str(cache), "--out", str(tmp_path / "run"), "--sliding-window", "0"])
    assert r.exit_code == 1 and "error: --sliding-window 0: expected an integer >= 1" in r.output  # dflash train's

def test_train_benchmark_on_the_products_cache(tmp_path):
    """`bench train --length` measures on what users train on: by default the cache `dflash extract`
    writes by default (H values a token under one basis over the taps, in fp8, the basis beside it
    and named in cache.json), which the train stage loads as an extracted one, its drafter reading
    H values a token; `--project none` the tapped layers as they are, in bf16, as before."""
    from dflash_cache.cache.projection import PROJECTION, Basis, file_digest
    from dflash_cache.train.config import TrainConfig, drafter_config

    kw = dict(steps=2, warmup=1, token_budget=512, max_anchors=4, draft_layers=1, length=300, config=TINY)
    k = len(default_layer_ids(TINY["num_hidden_layers"]))
    for project, rank, storage in (("auto", 64, "fp8"), ("none", None, "bf16")):
        cache = tmp_path / project
        t = bench_train(cache, **kw, **({} if project == "auto" else {"project": project}))
        assert (t["project"], t["storage"], t["steps"], t["samples"]) == (rank or "none", storage, 2, 3)
        assert t["memory_tflops"] > 0 and verify(cache) == {}  # verify checks the basis's digest too
        spec = read_spec(cache)
        assert spec.storage.dtype == storage and (spec.projection is None) == (rank is None)
        width = drafter_config(TrainConfig(cache=cache, out=cache, draft_layers=1), spec).context_width
        for unit in committed_units(cache).values():  # one group of R values, or the K taps side by side
            r = UnitReader(unit)
            assert r.read("hidden", 0, int(r.offsets[-1])).shape[1] == (rank or k * 64)
        if rank is None:
            assert width is None and not (cache / PROJECTION).exists()
            continue
        p = spec.projection
        assert (p.basis, p.rank, p.scaling, p.digest) == ("joint", 64, "layer-rms", file_digest(cache / PROJECTION))
        assert width == 64 and spec.groups == [list(range(k))]
        w = Basis.load(cache, spec).matrix()  # a random orthonormal basis of the cache's geometry
        assert w.shape == (64, k * 64) and torch.allclose(w @ w.T, torch.eye(64), atol=1e-5)


def test_kernel_classes():
    """The profile's kernel classes, on kernel names as torch's profiler gives them on an H100: the
    fused AdamW is told from the clipping's foreach kernels, which share its launcher."""
    from dflash_cache.bench.kernels import kernel_class

    names = {
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
        "kernel__5x_cublas": "GEMM",
        "triton_tem_fused_0": "flex attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float const*, "
        "float const*>": "fused AdamW",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous "
        "namespace)::NormType)1, float, float>, float*, int>": "foreach (gradient clipping)",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "fused (triton)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_alignedK_contig<at::native::(anonymous "
        "namespace)::OpaqueType<2u>, unsigned int, 2, 128, 1, 16>": "copies/casts",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "elementwise/other",
    }
    assert {name: kernel_class(name) for name in names} == names


def test_kernel_breakdown_counts_each_kernel_once():
    """On a GPU the profiler also puts the optimizer's annotated range on the device's timeline,
    spanning the fused AdamW kernel: the breakdown counts the kernel, not the range around it."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from dflash_cache.bench.kernels import kernel_breakdown

    def on_gpu(i: int, name: str, start: int, end: int, annotation: bool = False) -> FunctionEvent:
        return FunctionEvent(i, name, 0, start, end, device_type=DeviceType.CUDA, use_device="cuda",
                             is_user_annotation=annotation)  # fmt: skip

    adam = "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>"
    gemm = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT"
    events = [on_gpu(1, "Optimizer.step#AdamW.step", 99, 111, annotation=True),
              on_gpu(2, adam, 100, 110), on_gpu(3, gemm, 120, 150)]  # fmt: skip
    got = kernel_breakdown(events, steps=2)
    assert got["kernel_ms_per_step"] == (10 + 30) / 2 / 1e3
    assert got["profile"] == {"GEMM": 0.75, "fused AdamW": 0.25}
    assert [k for _, k in got["top_kernels"]] == [gemm, adam]
