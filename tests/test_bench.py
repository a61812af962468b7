"""The benchmarks run end to end on the CPU at toy sizes (their figures only count from a GPU),
and what they build is sound: the extract benchmark's cache verifies, every path is exercised."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from dflash_cache.bench import suite as bench
from dflash_cache.cache.audit import verify
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import committed_units

TINY = dict(bench.QWEN3_8B, num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
# Qwen3.5-9B's layout (three gated delta-net layers to one full-attention layer) at a toy width
TINY_HYBRID = dict(bench.QWEN3_5_9B, num_hidden_layers=8, layer_types=bench.QWEN3_5_9B["layer_types"][:8],
                   hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   vocab_size=512)  # fmt: skip
TINY_HYBRID["rope_parameters"] = dict(bench.QWEN3_5_9B["rope_parameters"], mrope_section=[1, 1, 0])  # 2 frequencies


def test_disk_codec_and_commit(tmp_path):
    d = bench.disk(tmp_path, size_mb=64)
    assert d["bytes"] == 64 << 20 and d["write_GBps"] > 0 and d["read_GBps"] > 0
    c = bench.codec(rows=256, width=512)
    assert 1.0 < c["ratio"] < 4.0
    m = bench.commit(tmp_path, units=2, rows=200, width=256, writers=1)
    assert m["threads_MBps"] > 0 and m["processes_MBps"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # its scratch folder is gone


def test_extract_and_train_benchmarks(tmp_path):
    out = tmp_path / "bx"
    x = bench.extract(out, config=TINY, num_tokens=20000, unit_mb=1, writers=1)
    spec = read_spec(out)
    assert len(committed_units(out)) == x["units"] == spec.plan.num_units and verify(out) == {}
    assert x["tokens"] == spec.plan.num_tokens and 0 < x["padding"] < 0.5
    assert x["raw_bytes_per_token"] == len(spec.layers.ids) * 64 * 2 and 0 < x["bytes_per_token"]
    assert all(x[k] > 0 for k in ("ratio", "steady_ratio", "staged_ratio", "setup_s"))
    # `bench ranks` on this cache's lengths, through the CLI (sorted runs minimise the sum of step maxima)
    cmd = [sys.executable, "-m", "cli.main", "bench", "ranks", "--cache", str(out), "--token-budget", "512",
           "--max-anchors", "4", "--ranks", "2,3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["samples"] == spec.plan.num_samples
    assert r["speedup_2_as_they_come"] <= r["speedup_2_by_cost"] <= 2 and r["speedup_3_by_cost"] <= 3
    bench.write_random_frozen(out, TINY)
    t = bench.train(out, steps=2, warmup=1, token_budget=512, max_anchors=4, draft_layers=1, cold=True)
    assert t["steps"] == 2 and t["ratio"] > 0 and t["loader_wait_per_step_s"] >= 0 and t["peak_rss_GB"] > 0
    # bytes per token on disk are the cache's: loader_GBps / step_GBps is the ratio itself
    assert t["cold"] and abs(t["loader_GBps"] / t["step_GBps"] - t["ratio"]) < 1e-6
    assert t["loader_GBps"] * 1e9 < x["bytes_per_token"] * 1.2 * t["context_tok_s"]


def test_long_extract_benchmark(tmp_path):
    """`--long` builds samples of 16K to 32K tokens (the loader's hardest case)."""
    out = tmp_path / "lx"
    # two layers: the long samples are what is tested, and each layer costs a quadratic attention on a CPU
    x = bench.extract(out, config=dict(TINY, num_hidden_layers=2), num_tokens=40000, unit_mb=1, writers=1, long=True)
    assert x["samples"] >= 2 and verify(out) == {} and read_spec(out).plan.num_tokens == x["tokens"]
    assert x["tokens"] / x["samples"] >= bench.LONG_MAX // 2


def test_hybrid_extract_benchmark(tmp_path):
    """`--shape qwen3.5-9b`'s path at a toy width: the random hybrid is cut and tapped like a loaded
    one, and the cache it writes verifies. CPU has no flash-linear-attention: the torch path runs."""
    out = tmp_path / "hx"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the torch path's many small ops thrash when the cores are shared
    try:
        x = bench.extract(out, config=TINY_HYBRID, lengths=[40, 70, 130, 250], unit_mb=1, writers=1)
    finally:
        torch.set_num_threads(threads)
    spec = read_spec(out)
    assert verify(out) == {} and x["tokens"] == 490 == spec.plan.num_tokens and spec.layers.ids == [1, 2, 3, 4, 5]
    assert x["model_type"] == "qwen3_5_text" and {x["kernel_fla"], x["kernel_causal_conv1d"]} <= {True, False}
    assert all(x[k] > 0 for k in ("ratio", "steady_ratio", "staged_ratio"))
    assert bench.SHAPES["qwen3.5-9b"] is bench.QWEN3_5_9B and bench.QWEN3_5_27B["num_hidden_layers"] == 64
    from typer.testing import CliRunner

    from cli.main import app

    r = CliRunner().invoke(app, ["bench", "extract", "--out", str(tmp_path / "no"), "--shape", "qwen3.5-4b"])
    assert r.exit_code == 1 and "error: --shape 'qwen3.5-4b': expected one of qwen3-8b, qwen3.5-9b" in r.output


def test_dspark_train_benchmark(tmp_path):
    """`bench extract --final-hidden` then `bench train --drafter dspark`: the GPU measurement of DSpark's
    step (MFU by the family's useful-FLOPs count), here at toy size."""
    out = tmp_path / "bx"
    x = bench.extract(out, config=TINY, num_tokens=8000, unit_mb=1, writers=1, final_hidden=True)
    spec = read_spec(out)
    assert spec.layers.final_hidden and verify(out) == {}
    assert x["raw_bytes_per_token"] == (len(spec.layers.ids) + 1) * 64 * 2  # the taps and the final state
    bench.write_random_frozen(out, TINY)
    t = bench.train(out, steps=2, warmup=1, token_budget=512, max_anchors=4, draft_layers=1, drafter="dspark")
    assert t["drafter"] == "dspark" and t["block_size"] == 7 and t["steps"] == 2 and t["memory_tflops"] > 0
