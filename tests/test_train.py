"""The train stage against independent computations: replicas of each other, the cache's sample
list, the pre-export model (killed runs against an uninterrupted one: test_faults.py)."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import RecordingSink, jsonl_rows

from dflash_cache.cache.spec import read_spec
from dflash_cache.core.devices import Worker, flush_denormals
from dflash_cache.core.groups import process_group
from dflash_cache.core.launch import launch
from dflash_cache.core.threads import worker_threads
from dflash_cache.drafters.dflash.family import load_serving
from dflash_cache.train.checkpoint import Checkpointer
from dflash_cache.train.config import TrainConfig, TrainError
from dflash_cache.train.optimizer import clipped_step
from dflash_cache.train.stage import _data_parallel, export, run


def _cfg(cache, out, **kw):
    return TrainConfig(cache=cache, out=out, **{"epochs": 1, "token_budget": 1024, "max_anchors": 64,
                                                "log_every": 1, **kw})


def _metrics(run_dir):
    return jsonl_rows(Path(run_dir) / "metrics.jsonl")


@pytest.mark.slow  # three epochs of the whole cache
def test_training_learns(tiny_cache, tmp_path):
    run(_cfg(tiny_cache, tmp_path / "run", epochs=3, lr=3e-3, token_budget=2048, max_anchors=64, log_every=5,
             draft_layers=2))
    steps = [m for m in _metrics(tmp_path / "run") if "loss" in m]
    first, last = steps[0], steps[-1]
    # measured with these seeds (2 draft layers): loss 5.9 -> 4.1, slot-1 accuracy 0.06 -> 0.16 (a random drafter: ~0)
    assert last["loss"] < first["loss"] - 1.0, (first["loss"], last["loss"])
    assert last["slot_acc"][0] > 1.8 * first["slot_acc"][0], (first["slot_acc"][0], last["slot_acc"][0])
    assert last["accept_len"] > first["accept_len"]
    ends = [m for m in _metrics(tmp_path / "run") if "epoch_end" in m]
    assert [m["samples"] for m in ends] == [400, 400, 400]  # one process: every sample, every epoch
    cached = read_spec(tiny_cache).plan.num_tokens  # every epoch trains on every cached token
    assert [m["tokens"] for m in ends] == [cached, 2 * cached, 3 * cached]
    times = [m["time"] for m in _metrics(tmp_path / "run")]
    assert times == sorted(times) and times[-1] - times[0] > 0


def _state(run_dir):
    return Checkpointer(run_dir).load()["model"]


@pytest.mark.slow  # two gloo ranks
def test_ddp_two_processes(tiny_cache, tmp_path):
    out = tmp_path / "ddp"
    run(_cfg(tiny_cache, out, procs=2, epochs=2, token_budget=2048, max_anchors=8, trace=True))
    traces = [jsonl_rows(out / "trace" / f"rank{r}.jsonl") for r in (0, 1)]
    # replicas identical after every step
    sums = [[x["checksum"] for x in t if "step" in x] for t in traces]
    assert sums[0] == sums[1] and len(sums[0]) > 3
    spec = read_spec(tiny_cache)
    for epoch in (0, 1):
        per_rank = [[s for x in t if x.get("epoch") == epoch for s in x["samples"]] for t in traces]
        batches = [len([x for x in t if x.get("epoch") == epoch]) for t in traces]
        assert batches[0] == batches[1]
        seen = per_rank[0] + per_rank[1]
        assert len(seen) == len(set(seen)), "a sample was consumed twice in one epoch"
        assert len(seen) > 0.9 * spec.plan.num_samples  # only the leftover batch (< world) is dropped


def _reduce_grads(w, grad_reduce, out):
    with process_group(w):  # gloo on CPU; destroyed after the DDP model below is freed
        _save_grads(w, grad_reduce, out)


def _save_grads(w, grad_reduce, out):
    """One DDP backward on rank-dependent inputs; reports the reduced gradient and both ranks' local ones."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    x = torch.randn(w.world_size, 8, 64)
    model(x[w.rank]).square().sum().backward()  # this rank's own gradient, without DDP
    local = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    ddp = _data_parallel(model, w.device, grad_reduce)  # held: its reducer does the all-reduce in backward
    ddp(x[w.rank]).square().sum().backward()
    torch.save((local, model.weight.grad), out / f"rank{w.rank}.pt")


@pytest.mark.slow  # two gloo ranks a precision
@pytest.mark.parametrize("grad_reduce", ["fp32", "bf16"])
def test_ddp_gradient_is_the_mean_of_the_ranks(grad_reduce, tmp_path):
    launch(_reduce_grads, (grad_reduce, tmp_path), procs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    mean = (got[0][0] + got[1][0]) / 2
    for _, reduced in got:
        if grad_reduce == "fp32":
            torch.testing.assert_close(reduced, mean)
        else:  # sent as bf16: each rank's share and the sum rounded to 8 bits, so every value is a bf16 one
            assert ((reduced - mean).abs() <= 2**-8 * (got[0][0].abs() + got[1][0].abs())).all()
            assert torch.equal(reduced, reduced.bfloat16().float()) and not torch.equal(reduced, mean)
    assert torch.equal(got[0][1], got[1][1])


def test_fused_clipped_step_is_clip_grad_norm_then_step(device: str = "cpu"):
    """The fused optimizer's step (the CUDA path; torch fuses AdamW on the CPU too) takes the
    clipping's divisor into its kernel: the same parameters as clip_grad_norm_ then the unfused
    AdamW, over steps whose gradients are clipped and steps whose are not. (The GPU suite runs it
    on CUDA.)"""
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.SiLU(), torch.nn.Linear(96, 48)).to(device)
    models = [first, copy.deepcopy(first)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
            for m, fused in zip(models, (True, False), strict=True)]  # fmt: skip
    norms = []
    for step in range(6):
        x = torch.randn(32, 48, device=device) * (30.0 if step % 2 else 0.01)  # clipped, then left alone
        for m, opt in zip(models, opts, strict=True):
            m(x).square().mean().backward()
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item())
            clipped_step(opt, max_norm=1.0)
            opt.zero_grad(set_to_none=True)
        for fused, plain in zip(*(m.parameters() for m in models), strict=True):
            torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
    assert min(norms[2::4]) > 10 and max(norms[::4]) < 1  # both kinds of step were taken
    assert not hasattr(opts[0], "grad_scale")  # nothing left for a later step or a GradScaler


def test_cpu_inference_flushes_denormals_and_restores_the_setting():
    """eval and regen run their CPU decoding with denormals flushed to zero (x86 arithmetic on them
    is about ten times slower), and the process-wide setting is back afterwards."""
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 denormal
    assert (tiny * 1.0).item() != 0.0
    with flush_denormals(torch.device("cpu")):
        assert (tiny * 1.0).item() == 0.0
    assert (tiny * 1.0).item() != 0.0
    with flush_denormals(torch.device("meta")):  # not a CPU: untouched
        assert (tiny * 1.0).item() != 0.0


def test_worker_threads_split_the_cores_and_are_restored():
    before = torch.get_num_threads()
    all_idle = lambda: float(os.cpu_count())  # noqa: E731 (a machine with every core idle)
    with worker_threads(Worker(0, 2, torch.device("cpu")), idle=all_idle):
        assert torch.get_num_threads() == min(max(1, os.cpu_count() // 2), before)
    with worker_threads(Worker(0, 2, torch.device("cuda", 0)), per_gpu=1):  # no CUDA call is made
        assert torch.get_num_threads() == 1
    with worker_threads(Worker(0, 1, torch.device("cpu")), per_gpu=1, idle=all_idle):  # one process keeps them all
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_export_and_refusals(tiny_cache, tmp_path):
    out = tmp_path / "run"
    run(_cfg(tiny_cache, out, max_steps=3, max_anchors=8))
    model, dcfg = load_serving(out / "export")
    record = json.loads((out / "train.json").read_text())
    record["config"]["cache"] = str(tmp_path / "moved-away")  # export needs only the run directory
    (out / "train.json").write_text(json.dumps(record))
    again, again_cfg = load_serving(export(out, tmp_path / "again"))
    assert again_cfg == dcfg
    for (k, v), (k2, v2) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == read_spec(tiny_cache).layers.ids
    with pytest.raises(TrainError, match="other settings"):
        run(_cfg(tiny_cache, out, max_steps=3, lr=1e-3))
    with pytest.raises(TrainError, match="layers"):
        run(_cfg(tiny_cache, tmp_path / "bad", layers=[0, 7]))


def _warnings(sink: RecordingSink) -> list[str]:
    return [d["warning"] for d in sink.deltas if "warning" in d]


def test_a_run_of_few_optimizer_steps_is_warned(tiny_cache, tmp_path):
    """A fresh run whose epochs hold fewer than FEW_STEPS optimizer steps says so, with the step
    count from the loader's own batches; a --max-steps run (asked to be short) and a resumed run
    do not repeat it."""
    from dflash_cache.train.stage import FEW_STEPS

    cfg = _cfg(tiny_cache, tmp_path / "run", epochs=2, draft_layers=1, max_anchors=8, log_every=100)
    sink = RecordingSink()
    summary = run(cfg, sink)
    # the warning counts the first epoch's batches twice; a later epoch may pack one more or fewer
    first = next(r["step"] for r in _metrics(tmp_path / "run") if r.get("epoch_end") == 0)
    assert summary["steps"] < FEW_STEPS and abs(summary["steps"] - 2 * first) <= 2
    few = [w for w in _warnings(sink) if "optimizer steps" in w]
    assert few == [few[0]] and f"takes {2 * first} optimizer steps (2 epochs of {first})" in few[0], _warnings(sink)
    again = RecordingSink()
    run(_cfg(tiny_cache, tmp_path / "run", epochs=2, draft_layers=1, max_anchors=8, log_every=100), again)  # resumes
    short = RecordingSink()
    run(_cfg(tiny_cache, tmp_path / "short", epochs=2, draft_layers=1, max_anchors=8, max_steps=2), short)
    later = _warnings(again) + _warnings(short)
    assert not [w for w in later if "optimizer steps" in w], later
