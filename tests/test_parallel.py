"""`dflash extract --tp`: copies of the target sharded over several processes by transformers' own
tensor- and expert-parallel loading, run for real over gloo on the CPU.

A sharded extraction is checked against the one-process extraction of the same target and rows
(the same samples, tokens and masks; hidden states equal up to bf16 rounding, since the sharded
forward sums its partial products in another order) and against `output_hidden_states` of the
model loaded whole; two sharded copies must write every sample exactly once. The families are the
tiny random targets of family_targets.py laid out like the real ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import family_targets as fam
import numpy as np
import pytest
import torch
from helpers import ROOT, TINY_TARGET, extract_cmd, extract_config, jsonl_head, read_cache
from transformers import AutoModelForCausalLM, GPT2Config

from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.layout import TOKEN_ARRAYS
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.extract.stage import run
from dflash_cache.target.config import text_config
from dflash_cache.target.load import TargetError, load_config
from dflash_cache.target.parallel import check_fits, layout, running_bytes
from dflash_cache.target.taps import load_target

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
# dense (Qwen3), and the MoE layouts that transformers shards by heads and by experts
SHARDED = ("qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_vl", "deepseek_v3", "gpt_oss")


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    return {f: fam.build(f, root / f) for f in SHARDED}


def _rows(family: str, path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in fam.example_rows(family)))
    return path


def _layers(target: Path) -> list[int]:
    """The first two layers and the last but one (the last one's output is in the final hidden state,
    after the final norm, which `output_hidden_states` puts in its place)."""
    return [0, 1, int(text_config(load_config(str(target)))["num_hidden_layers"]) - 2]


def _samples(cache: Path) -> dict[int, dict[str, np.ndarray]]:
    """sample_index -> each per-token array of the sample (hidden, final_hidden, input_ids, loss_mask);
    a sample cached twice fails."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for path in committed_units(cache).values():
        r = UnitReader(path)
        for i, s in enumerate(r.sample_index.tolist()):
            a, b = int(r.offsets[i]), int(r.offsets[i + 1])
            assert s not in out, f"sample {s} cached twice"
            out[s] = {k: r.read(k, a, b) for k in TOKEN_ARRAYS if k in r.arrays}
    return out


def _floats(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float()


def _assert_within_bf16_rounding(a: np.ndarray, b: np.ndarray) -> None:
    """Two bf16 arrays (uint16 bits) at most one bf16 step apart (a relative 2**-7 at most): the
    fp32 values behind them agreed to far better than bf16 resolves, and some rounded to neighbours."""
    torch.testing.assert_close(_floats(a), _floats(b), rtol=2**-7, atol=1e-5)


def _sharded(data: Path, out: Path, target: Path, procs: int = 2, tp: int = 2, *extra: str) -> None:
    cmd = extract_cmd(data, out, "--procs", str(procs), "--tp", str(tp), "--tokenize-procs", "1", *extra,
                      target=target)  # fmt: skip
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_moe_targets_are_laid_out_like_their_families(targets):
    """What makes the tiny MoE targets stand-ins for the real ones: the modules their families'
    plans shard, and the features that set them apart."""
    names = {f: {n for n, _ in AutoModelForCausalLM.from_pretrained(targets[f]).named_parameters()}
             for f in fam.MOE if f in targets}  # fmt: skip
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.gate.weight"} <= names["qwen3_moe"]
    for f in ("qwen3_5_moe", "qwen3_5_moe_vl"):  # gated delta-net layers, routed and shared experts
        assert {
            "model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.layers.3.self_attn.q_proj.weight",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.shared_expert.up_proj.weight",
        } <= names[f]
    vl = json.loads((targets["qwen3_5_moe_vl"] / "config.json").read_text())
    assert vl["model_type"] == "qwen3_5_moe" and vl["text_config"]["model_type"] == "qwen3_5_moe_text"
    ds = names["deepseek_v3"]  # latent attention; layer 0 dense, then shared and routed experts
    assert {
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
    } <= ds and "model.layers.0.mlp.experts.gate_up_proj" not in ds
    oss = json.loads((targets["gpt_oss"] / "config.json").read_text())
    assert oss["layer_types"][:2] == ["sliding_attention", "full_attention"] and oss["sliding_window"] == 32
    assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.experts.gate_up_proj_bias"} <= names["gpt_oss"]


@pytest.mark.slow  # about 25 s each on 2 busy cores (two processes start and import transformers)
@pytest.mark.parametrize("family", SHARDED)
def test_sharded_extraction_is_the_one_process_cache(targets, family, tmp_path):
    """`--procs 2 --tp 2` against the same extraction in one process, and against the whole model's
    `output_hidden_states`: the taps and the final hidden state (so every layer runs)."""
    target, data = targets[family], _rows(family, tmp_path / "rows.jsonl")
    layers = _layers(target)
    one, two = tmp_path / "one", tmp_path / "two"
    run(extract_config(one, target=str(target), data=str(data), unit_mb=1, token_budget=512, layers=layers,
                       final_hidden=True))  # fmt: skip
    _sharded(data, two, target, 2, 2, "--layers", ",".join(map(str, layers)), "--final-hidden")

    spec, ref_spec = read_spec(two), read_spec(one)
    assert spec.differences(ref_spec) == []  # the same cache, whatever the layout
    assert spec.parallel["tp"] == 2 and ref_spec.parallel == {"tp": 1}
    assert spec.parallel["expert_parallel"] == (family != "qwen3")
    a, b = _samples(two), _samples(one)
    assert sorted(a) == sorted(b) == list(range(len(fam.example_rows(family))))
    for s in b:
        assert sorted(a[s]) == ["final_hidden", "hidden", "input_ids", "loss_mask"]
        np.testing.assert_array_equal(a[s]["input_ids"], b[s]["input_ids"])
        np.testing.assert_array_equal(a[s]["loss_mask"], b[s]["loss_mask"])
        _assert_within_bf16_rounding(a[s]["hidden"], b[s]["hidden"])
        _assert_within_bf16_rounding(a[s]["final_hidden"], b[s]["final_hidden"])
    assert (two / "frozen.safetensors").read_bytes() == (one / "frozen.safetensors").read_bytes()

    # independently: the model loaded whole by its own class, all its hidden states, on the first rows
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for s in (0, 1, 2):
        ids = torch.from_numpy(a[s]["input_ids"].astype(np.int64))[None]
        with torch.no_grad():
            hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in layers], dim=-1)
        for got, want in ((a[s]["hidden"], taps), (a[s]["final_hidden"], hs[-1][0])):
            torch.testing.assert_close(_floats(got).reshape(want.shape), want.to(torch.bfloat16).float(),
                                       rtol=2**-7, atol=1e-5)  # fmt: skip


@pytest.mark.slow  # four processes: about 50 s on 2 cores
def test_two_sharded_copies_write_each_sample_once(small_cache, tmp_path):
    """`--procs 4 --tp 2`: two copies of two ranks each; units are dealt to the copies, and every
    row of the data is cached exactly once, equal to the one-process cache (`small_cache`: the same
    rows and settings)."""
    data = tmp_path / "rows.jsonl"
    data.write_text(jsonl_head(ROOT / "data" / "chat.jsonl", 60))
    one, four = small_cache, tmp_path / "four"
    _sharded(data, four, TINY_TARGET, 4, 2)
    assert len(committed_units(four)) == len(committed_units(one)) >= 4  # both copies had units
    a, b = read_cache(four), read_cache(one)  # no sample twice
    assert sorted(a) == sorted(b) == list(range(60))
    for s in b:
        _assert_within_bf16_rounding(a[s][0], b[s][0])


@pytest.mark.slow  # two sharded extracts of two processes
def test_caches_of_any_layout_resume_each_other(tmp_path):
    """A unit lost from a one-process cache is extracted again by `--tp 2`, and one lost after
    that by one process: the cache ends whole, the one-process cache's up to bf16 rounding."""
    data = tmp_path / "rows.jsonl"
    data.write_text(jsonl_head(ROOT / "data" / "chat.jsonl", 40))
    ref, out = tmp_path / "ref", tmp_path / "out"
    run(extract_config(ref, data=str(data), unit_mb=1, token_budget=512))
    shutil.copytree(ref, out)
    units = sorted(committed_units(out))
    shutil.rmtree(committed_units(out)[units[0]])
    _sharded(data, out, TINY_TARGET)  # resumes the cache that one process made
    shutil.rmtree(committed_units(out)[units[1]])
    run(extract_config(out, data=str(data), unit_mb=1, token_budget=512))  # and one process resumes that
    assert sorted(committed_units(out)) == units and read_spec(out).parallel == {"tp": 1}
    a, b = read_cache(out), read_cache(ref)
    assert sorted(a) == sorted(b)
    for s in b:
        _assert_within_bf16_rounding(a[s][0], b[s][0])


MEASURE = """
import json, sys, torch
from pathlib import Path
from dflash_cache.core.groups import Group, process_group
from dflash_cache.core.launch import torchrun_worker
from dflash_cache.target.load import load_causal_lm, load_config
from dflash_cache.target.parallel import distributed_config, layout, local_bytes

w = torchrun_worker()
out = {}
with process_group(w, Group.of(w, w.world_size)):
    for family, path in json.loads(sys.argv[1]).items():
        sharding = distributed_config(layout(path, None, load_config(path), 2))
        model = load_causal_lm(path, torch.float32, None, sharding)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor counts its whole shape
        out[family] = {"local": local_bytes(model), "global": whole}
Path(sys.argv[2], f"rank{w.rank}.json").write_text(json.dumps(out))
"""


@pytest.mark.slow  # torchrun ranks measuring their weights
def test_each_rank_holds_its_share_of_the_weights(targets, tmp_path):
    """Under torchrun, each of 2 ranks holds its shards: well under the whole model's parameter
    bytes (counted from the model loaded whole), the routed experts halved."""
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           json.dumps({f: str(p) for f, p in targets.items()}), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for family, path in targets.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        for r in ranks:
            assert r[family]["global"] == whole
            assert r[family]["local"] < 0.75 * whole, (family, r[family]["local"], whole)


@pytest.mark.slow  # sharded CLI extracts
def test_layout_refusals(targets, tmp_path):
    """`--tp` where transformers has no plan, or where neither the heads nor experts split evenly,
    is refused with one line before anything runs; a process count that is no multiple of --tp too."""
    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    with pytest.raises(TargetError, match="no tensor-parallel plan for gpt2"):
        layout(str(gpt2), None, load_config(str(gpt2)), 2)
    qwen3 = str(targets["qwen3"])  # 4 heads, 2 key-value heads
    with pytest.raises(TargetError, match=r"its heads \(4 query, 2 key-value\) do not split evenly over 4"):
        layout(qwen3, None, load_config(qwen3), 4)
    moe = str(targets["qwen3_moe"])  # its 4 experts shard 4 ways, its attention stays whole
    assert layout(moe, None, load_config(moe), 4) == {"tp": 4, "tensor_parallel": False, "expert_parallel": True}
    with pytest.raises(TargetError, match="4 experts do not split evenly over 8"):
        layout(moe, None, load_config(moe), 8)
    assert layout(qwen3, None, load_config(qwen3), 1) == {"tp": 1}

    rows = _rows("qwen3", tmp_path / "rows.jsonl")
    for procs, want in ((3, "3 processes do not split into copies of 2"), (1, "1 processes do not split")):
        cmd = extract_cmd(rows, tmp_path / f"c{procs}", "--procs", str(procs), "--tp", "2", target=Path(qwen3))
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in done.stdout.splitlines() + done.stderr.splitlines() if ln.strip()]
        assert done.returncode == 1 and lines == [lines[0]] and want in lines[0], done.stdout + done.stderr
    cmd = extract_cmd(rows, tmp_path / "g", "--procs", "2", "--tp", "2", target=gpt2)
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no tensor-parallel plan for gpt2" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_target_too_big_for_the_gpu_is_refused_before_loading(targets):
    """The weights that extraction puts on a GPU, from the safetensors headers, are those of the
    loaded and cut model; a share over the free memory is refused with the --tp that fits."""
    path = str(targets["qwen3_moe"])
    for last, final in ((1, False), (3, True)):
        tapped, _, _ = load_target(path, [0, last], torch.device("cpu"), final=final)
        on_device = sum(p.numel() * 2 for p in tapped.base.parameters())  # in bf16, as on a GPU
        assert running_bytes(path, None, None if final else last, torch.bfloat16) == on_device
    whole = AutoModelForCausalLM.from_pretrained(path)  # generation loads it all, LM head included
    assert running_bytes(path, None, None, torch.bfloat16, head=True) == sum(p.numel() * 2 for p in whole.parameters())
    gib = 2**30
    check_fits(70 * gib, 80 * gib, 1, "cuda:0")  # fits
    check_fits(None, 0, 1, "cuda:0")  # not local safetensors: nothing to estimate, the load decides
    with pytest.raises(TargetError) as e:
        check_fits(800 * gib, 140 * gib, 1, "cuda:0")
    assert str(e.value) == ("the target's weights need 800.0 GiB on the device (800.0 GiB a process) and cuda:0 "
                            "has 140.0 GiB free: shard it over more GPUs with --tp 8")  # fmt: skip
    with pytest.raises(TargetError, match=r"its 1/4 share, 200.0 GiB, a process.*--tp 8"):
        check_fits(800 * gib, 140 * gib, 4, "cuda:3")
