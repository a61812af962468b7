"""Validation: held-out units, the validation cache's checks, the metrics against a full-logits
computation, and the best export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import jsonl_rows

from dflash_cache.cache.spec import SpecError, read_spec
from dflash_cache.cache.store import read_frozen
from dflash_cache.drafters import Output
from dflash_cache.drafters.blocks import make_blocks
from dflash_cache.drafters.dflash.family import forward_blocks, load_serving, save_serving
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.train.config import TrainConfig, drafter_config
from dflash_cache.train.loader import CacheLoader
from dflash_cache.train.validate import (
    BestExport,
    Validator,
    ValSet,
    check_val_cache,
    held_out_units,
    open_loader,
    val_generator,
)

ITERS = 10
SEED, BUDGET, ANCHORS = 3, 1024, 16
VAL_UNIT = 5  # the plan's last unit: 101 short samples


def test_held_out_units_are_a_function_of_the_plan():
    assert held_out_units(1, 0.5) == frozenset() and held_out_units(40, 0.0) == frozenset()
    assert len(held_out_units(2, 0.01)) == 1 and len(held_out_units(3, 0.9)) == 2  # at least one, never all
    for n in (5, 100, 1000):
        held = held_out_units(n, 0.1)
        assert len(held) == max(1, round(0.1 * n)) and held <= set(range(n))
        assert held == held_out_units(n, 0.1)  # the same every time, in every process
    big = sorted(held_out_units(1000, 0.1))
    assert big[0] < 100 and big[-1] > 900  # spread over the plan (units go longest samples first)
    assert held_out_units(1000, 0.05) <= held_out_units(1000, 0.1)  # a larger fraction only adds units
    with pytest.raises(SpecError, match="val_fraction"):
        held_out_units(10, 1.0)


def _copy_cache(src: Path, dst: Path, units: list[int], **spec_changes) -> Path:
    """A real cache holding some of `src`'s units; `spec_changes` edits cache.json ("target.x": value)."""
    dst.mkdir(parents=True)
    shutil.copy(src / "frozen.safetensors", dst)
    for u in units:
        shutil.copytree(src / "units" / f"u{u:06d}", dst / "units" / f"u{u:06d}")
    spec = json.loads((src / "cache.json").read_text())
    for dotted, value in spec_changes.items():
        section, key = dotted.split(".")
        spec[section][key] = value
    (dst / "cache.json").write_text(json.dumps(spec))
    return dst


def test_val_cache_checks(tiny_cache, tmp_path):
    layers = read_spec(tiny_cache).layers.ids
    other = _copy_cache(tiny_cache, tmp_path / "other", [1], **{"data.fingerprint": "other-data", "plan.num_units": 1})
    assert check_val_cache(tiny_cache, other, layers).data.fingerprint == "other-data"
    with pytest.raises(SpecError, match="is the training cache"):
        check_val_cache(tiny_cache, tiny_cache, layers)
    with pytest.raises(SpecError, match="is the training cache"):  # a copy of it is too
        check_val_cache(tiny_cache, _copy_cache(tiny_cache, tmp_path / "copy", [1]), layers)
    weights = _copy_cache(tiny_cache, tmp_path / "w", [],
                          **{"data.fingerprint": "x", "target.weights_fingerprint": "z"})  # fmt: skip
    with pytest.raises(SpecError, match="target.weights_fingerprint"):
        check_val_cache(tiny_cache, weights, layers)
    tok = _copy_cache(tiny_cache, tmp_path / "t", [], **{"data.fingerprint": "x", "tokenizer.digest": "z"})
    with pytest.raises(SpecError, match="tokenizer.digest"):
        check_val_cache(tiny_cache, tok, layers)
    few = _copy_cache(tiny_cache, tmp_path / "l", [], **{"data.fingerprint": "x", "layers.ids": layers[:2]})
    with pytest.raises(SpecError, match="layers"):
        check_val_cache(tiny_cache, few, layers)
    assert check_val_cache(tiny_cache, few, layers[:2])  # a drafter on those layers may use it
    with pytest.raises(SpecError, match="choose one"):
        ValSet.choose(tiny_cache, read_spec(tiny_cache), fraction=0.2, val_cache=other, layer_ids=layers)
    chosen = ValSet.choose(tiny_cache, read_spec(tiny_cache), fraction=0.2, layer_ids=layers)
    assert chosen.units == held_out_units(read_spec(tiny_cache).plan.num_units, 0.2)
    assert chosen.train_units(min(chosen.units)) is False and chosen.train_units(max(set(range(6)) - chosen.units))


def _reference(model, embed, head, loader, B, mask_id, seed=SEED, anchors=ANCHORS) -> dict:
    """Validation metrics the plain way: full logits, python loops over blocks and slots."""
    loss_w = weight = 0.0
    accepts, hits, counts = [], [0] * B, [0] * B
    for i, batch in enumerate(loader.epoch(0)):
        ids, mask, offsets = batch.host
        blocks = make_blocks(ids, mask, offsets, block_size=B, mask_token_id=mask_id, max_anchors=anchors,
                             generator=val_generator(seed, i, 0))  # fmt: skip
        hidden = model(F.embedding(blocks.input_ids.flatten(), embed), batch.context.float(), blocks.layout)
        logits = hidden @ head.T
        ce = F.cross_entropy(logits, blocks.labels.flatten(), reduction="none").view_as(blocks.weights)
        loss_w += float((ce * blocks.weights).sum())
        weight += float(blocks.weights.sum())
        pred, labels, w = logits.argmax(-1).view_as(blocks.labels).tolist(), blocks.labels.tolist(), blocks.weights
        for b in range(len(labels)):
            run, broken = 0, False
            for k in range(1, B):
                if w[b, k] > 0:
                    counts[k] += 1
                    hits[k] += pred[b][k] == labels[b][k]
                if broken or w[b, k] == 0 or pred[b][k] != labels[b][k]:
                    broken = True
                else:
                    run += 1
            accepts.append(1 + run)
    return {"val_loss": loss_w / weight, "val_accept_len": sum(accepts) / len(accepts), "val_blocks": len(accepts),
            "val_slot_acc": [h / c if c else 0.0 for h, c in zip(hits[1:], counts[1:], strict=True)]}  # fmt: skip


@pytest.mark.slow  # two trainings of ITERS steps
def test_validator_matches_a_full_logits_computation(tiny_cache, tmp_path):
    """On a second cache (one unit of short samples), a drafter fitted to those very blocks, so
    that many slots are right: the validator's loss, slot accuracy and acceptance equal a
    full-logits computation, the same on every call, and the global RNG is left untouched."""
    spec = read_spec(tiny_cache)
    val_dir = _copy_cache(tiny_cache, tmp_path / "val", [VAL_UNIT], **{"data.fingerprint": "v"})
    dcfg = drafter_config(TrainConfig(cache=tiny_cache, out=tmp_path, draft_layers=1, block_size=8), spec)
    torch.manual_seed(0)
    model = DFlashDrafter(dcfg)
    embed, head = (t.float() for t in read_frozen(tiny_cache))
    vset = ValSet(val_dir)
    common = {"layer_ids": dcfg.target_layer_ids, "token_budget": BUDGET, "seed": SEED, "rank": 0, "world_size": 1,
              "device": torch.device("cpu"), "readers": 2}  # fmt: skip
    objective = {"block_size": 8, "mask_token_id": dcfg.mask_token_id, "max_anchors": ANCHORS, "gamma": None,
                 "loss_chunk": 512}  # fmt: skip

    def dflash_objective(model, embed, head, batch, generator):
        return Output(*forward_blocks(model, embed, head, batch, **objective, generator=generator))

    validator = Validator(vset, every=5, objective=dflash_objective, seed=SEED, rank=0,
                          loader=lambda units: open_loader(vset, units, **common))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_loader = CacheLoader(val_dir, follow=False, prefetch=0, **{k: v for k, v in common.items() if k != "rank"})
    batches = list(ref_loader.epoch(0))
    for _ in range(ITERS):  # overfit the blocks, so that accuracy and acceptance are far from 0
        for i, batch in enumerate(batches):
            loss, _, _ = forward_blocks(model, embed, head, batch, **objective, generator=val_generator(SEED, i, 0))
            loss.backward()
            opt.step()
            opt.zero_grad()
    rng = torch.get_rng_state()
    got = validator.run(model, embed, head, step=5)
    assert torch.equal(torch.get_rng_state(), rng)
    with torch.no_grad():
        want = _reference(model, embed, head, ref_loader, 8, dcfg.mask_token_id)
    assert got["val_blocks"] == want["val_blocks"] > 100
    assert got["val_accept_len"] == pytest.approx(want["val_accept_len"], abs=1e-9) and got["val_accept_len"] > 1.1
    assert got["val_slot_acc"] == pytest.approx(want["val_slot_acc"], abs=1e-9) and got["val_slot_acc"][0] > 0.1
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    manifest = json.loads((val_dir / "units" / f"u{VAL_UNIT:06d}" / "zarr.json").read_text())
    assert got["val_units"] == 1 and got["val_samples"] == manifest["attributes"]["dflash_unit"]["n_samples"]
    again = validator.run(model, embed, head, step=10)
    assert {k: v for k, v in again.items() if k not in ("step", "time", "val_seconds")} == {
        k: v for k, v in got.items() if k not in ("step", "time", "val_seconds")}  # the same blocks each time
    assert validator.due(10) and not validator.due(11)
    shutil.copytree(tiny_cache / "units" / "u000001", val_dir / "units" / "u000001")  # the cache grows
    grown = validator.run(model, embed, head, step=15)
    assert grown["val_units"] == 2 and grown["val_blocks"] > got["val_blocks"]  # the loader was opened anew
    validator.close()
    ref_loader.close()


def test_best_export_keeps_the_best_and_the_last(tiny_cache, tmp_path):
    spec = read_spec(tiny_cache)
    dcfg = drafter_config(TrainConfig(cache=tiny_cache, out=tmp_path, draft_layers=1), spec)
    model = DFlashDrafter(dcfg)
    best = BestExport(tmp_path, lambda where: save_serving(model, dcfg, where))

    def at(step: float, accept: float, samples: int = 70) -> dict:
        with torch.no_grad():
            model.fc.weight.fill_(step)  # the weights say which step they are
        return {"step": step, "val_accept_len": accept, "val_blocks": 10, "val_units": 1, "val_samples": samples}

    def exported(where: str) -> float:
        return float(load_serving(tmp_path / where, dtype=torch.float32)[0].fc.weight[0, 0].detach())

    assert best.update(at(1, 1.2)) and exported("export") == 1
    assert best.update(at(2, 1.5)) and not best.update(at(3, 1.4)) and not best.update(at(4, 1.5))
    assert exported("export") == 2
    resumed = BestExport(tmp_path, best.save)
    resumed.load_state_dict(best.state_dict())  # as a checkpoint restores it
    assert not resumed.update(at(5, 1.45))
    assert resumed.update(at(6, 1.3, samples=90)) and exported("export") == 6  # a larger set: compared anew
    assert not resumed.update({**at(7, 9.0), "val_blocks": 0})  # nothing validated
    at(8, 0.0)
    assert resumed.finish() == tmp_path / "export-last" and exported("export-last") == 8 and exported("export") == 6
    plain = BestExport(tmp_path / "plain", lambda where: save_serving(model, dcfg, where))
    assert plain.finish() == tmp_path / "plain" / "export"  # without validation, export/ is the last
    assert not (tmp_path / "plain" / "export-last").exists()


# ----------------------------------------------------------------------------- in the training loop

RUN = {"epochs": 1, "max_steps": 10, "save_every": 5, "log_every": 5, "val_fraction": 0.2, "token_budget": 1024,
       "max_anchors": 32, "draft_layers": 1, "lr": 3e-3, "seed": 1}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_cache, tmp_path_factory):
    """Two runs on the same held-out units: A validates at steps 5 and 10 (and reports to
    TensorBoard, and traces its batches), B only at its end."""
    from dflash_cache.train.stage import run

    root = tmp_path_factory.mktemp("val-runs")
    a = run(TrainConfig(cache=tiny_cache, out=root / "a", val_every=5, report_to="tensorboard", trace=True, **RUN))
    b = run(TrainConfig(cache=tiny_cache, out=root / "b", val_every=1000, **RUN))
    return Path(a["run"]), Path(b["run"])


def _records(run_dir):
    lines = jsonl_rows(run_dir / "metrics.jsonl")
    return [r for r in lines if "val_accept_len" in r], [r for r in lines if "loss" in r]


def _same(a: dict, b: dict) -> bool:
    skip = ("time", "val_seconds")
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def _weights(ckpt_state, dcfg, where):
    model = DFlashDrafter(dcfg)
    model.load_state_dict(ckpt_state["model"])
    save_serving(model, dcfg, where)
    return _safetensors(where)


def _safetensors(export_dir):
    from safetensors.torch import load_file

    return load_file(str(export_dir / "model.safetensors"))


def test_validation_never_changes_training_and_export_keeps_the_best(runs, tiny_cache, tmp_path):
    from dflash_cache.train.checkpoint import Checkpointer

    a, b = runs
    val_a, _ = _records(a)
    val_b, _ = _records(b)
    assert [r["step"] for r in val_a] == [5, 10] and [r["step"] for r in val_b] == [10]
    assert _same(val_a[1], val_b[0])  # the same blocks every time: equal weights give equal figures
    spec = read_spec(tiny_cache)
    held = held_out_units(spec.plan.num_units, 0.2)
    assert val_a[0]["val_units"] == len(held) == 1 and val_a[0]["val_blocks"] > 100
    # validating at step 5 changed nothing of the training: B (no validation until its end) ends bitwise equal
    ckpt_a, ckpt_b = Checkpointer(a), Checkpointer(b)
    final_a, final_b = ckpt_a.load(), ckpt_b.load()
    assert final_a["step"] == final_b["step"] == 10
    assert all(torch.equal(final_a["model"][k], final_b["model"][k]) for k in final_b["model"])

    dcfg = drafter_config(TrainConfig(cache=tiny_cache, out=a, draft_layers=1), spec)
    best = max(val_a, key=lambda r: r["val_accept_len"])  # the first of equals stays
    at_best = ckpt_b.load(ckpt_b.dir / f"step_{best['step']:08d}.pt")  # B keeps steps 5 and 10
    want = _weights(at_best, dcfg, tmp_path / "best")
    got = _safetensors(a / "export")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    last = _weights(final_b, dcfg, tmp_path / "last")
    got = _safetensors(a / "export-last")
    assert all(torch.equal(got[k], last[k]) for k in last)
    assert _safetensors(b / "export").keys() == last.keys()  # B's best is its only validation: the last weights

    # the validation figures at step 10 equal a full-logits computation on the same weights
    model = DFlashDrafter(dcfg)
    model.load_state_dict(final_b["model"])
    embed, head = (t.float() for t in read_frozen(tiny_cache))
    loader = CacheLoader(tiny_cache, layer_ids=dcfg.target_layer_ids, token_budget=RUN["token_budget"],
                         seed=RUN["seed"], device=torch.device("cpu"), prefetch=0, follow=False,
                         units=lambda u: u in held)  # fmt: skip
    with torch.no_grad():
        want = _reference(model, embed, head, loader, dcfg.block_size, dcfg.mask_token_id, seed=RUN["seed"],
                          anchors=RUN["max_anchors"])  # fmt: skip
    loader.close()
    assert val_b[0]["val_blocks"] == want["val_blocks"]
    assert val_b[0]["val_accept_len"] == pytest.approx(want["val_accept_len"], abs=1e-9)
    assert val_b[0]["val_slot_acc"] == pytest.approx(want["val_slot_acc"], abs=1e-9)
    assert val_b[0]["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


def test_training_never_reads_held_out_units(runs, tiny_cache):
    a, _ = runs
    held = held_out_units(read_spec(tiny_cache).plan.num_units, 0.2)

    def samples(unit: int) -> set[int]:
        meta = json.loads((tiny_cache / "units" / f"u{unit:06d}" / "zarr.json").read_text())
        return set(meta["attributes"]["dflash_unit"]["index"]["sample_index"])

    held_rows = set().union(*(samples(u) for u in held))
    trained = [s for r in jsonl_rows(a / "trace" / "rank0.jsonl") for s in r.get("samples", [])]
    assert len(trained) > 50 and not held_rows & set(trained)
    assert set(trained) <= set().union(*(samples(u) for u in range(6) if u not in held))


def test_tensorboard_and_report_of_a_real_run(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_report import png_size

    from dflash_cache.pipelines.report import report

    a, _ = runs
    val, steps = _records(a)
    acc = EventAccumulator(str(a / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert [(e.step, e.value) for e in acc.Scalars("val/accept_len")] == [
        (r["step"], pytest.approx(r["val_accept_len"], rel=1e-6)) for r in val]
    assert len(acc.Scalars("perf/tokens_per_s")) == len(steps) and "train/slot_acc/15" in acc.Tags()["scalars"]
    r = report(a)
    assert r["best_val"]["step"] == max(val, key=lambda x: x["val_accept_len"])["step"]
    assert all(png_size(a / "report" / f"{name}.png")[0] == 750 for name in r["plots"])


def test_rerun_of_a_finished_run_changes_nothing(runs, tiny_cache):
    from dflash_cache.train.stage import run

    a, _ = runs
    before = (a / "metrics.jsonl").read_text(), _safetensors(a / "export")
    run(TrainConfig(cache=tiny_cache, out=a, val_every=5, report_to="tensorboard", trace=True, **RUN))
    assert (a / "metrics.jsonl").read_text() == before[0]  # no second validation of the last step
    assert all(torch.equal(v, before[1][k]) for k, v in _safetensors(a / "export").items())


def test_refusals_before_anything_is_written(tiny_cache, tmp_path):
    from dflash_cache.train.stage import run
    from dflash_cache.train.tracking import TrackingError

    for bad, error, match in (({"val_cache": tiny_cache}, SpecError, "is the training cache"),
                              ({"val_fraction": 1.0}, SpecError, "val_fraction"),
                              ({"report_to": "mlflow"}, TrackingError, "unknown mlflow")):  # fmt: skip
        with pytest.raises(error, match=match):
            run(TrainConfig(cache=tiny_cache, out=tmp_path / "run", **bad))
        assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two gloo ranks
def test_validation_under_ddp(tiny_cache, tmp_path):
    """Two gloo ranks share the validation batches and sum their figures: every held-out sample is
    validated (at most one left out by the deal), and the run ends as usual."""
    from dflash_cache.train.stage import run

    out = tmp_path / "ddp"
    run(TrainConfig(cache=tiny_cache, out=out, procs=2, val_every=2, **{**RUN, "max_steps": 4, "save_every": 4}))
    val, _ = _records(out)
    held = held_out_units(read_spec(tiny_cache).plan.num_units, 0.2)
    n = sum(json.loads((tiny_cache / "units" / f"u{u:06d}" / "zarr.json").read_text())["attributes"]["dflash_unit"]
            ["n_samples"] for u in held)  # fmt: skip
    assert [r["step"] for r in val] == [2, 4] and all(n - 1 <= r["val_samples"] <= n for r in val)
    assert val[0]["val_samples"] == val[1]["val_samples"] and val[1]["val_blocks"] > 100
    assert (out / "export" / "model.safetensors").is_file() and (out / "export-last" / "model.safetensors").is_file()
