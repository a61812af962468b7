"""Validation: held-out units, the validation cache's checks, the metrics against a full-logits
computation, and the best export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_cache.cache.spec import SpecError, read_spec
from dflash_cache.cache.store import read_frozen
from dflash_cache.train.config import TrainConfig, drafter_config
from dflash_cache.train.drafter import DFlashDrafter, load_serving, save_serving
from dflash_cache.train.loader import CacheLoader
from dflash_cache.train.objective import make_blocks
from dflash_cache.train.validate import (
    BestExport,
    Validator,
    ValSet,
    check_val_cache,
    forward_blocks,
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


def _reference(model, embed, head, loader, B, mask_id) -> dict:
    """Validation metrics the plain way: full logits, python loops over blocks and slots."""
    loss_w = weight = 0.0
    accepts, hits, counts = [], [0] * B, [0] * B
    for i, batch in enumerate(loader.epoch(0)):
        ids, mask, offsets = batch.host
        blocks = make_blocks(ids, mask, offsets, block_size=B, mask_token_id=mask_id, max_anchors=ANCHORS,
                             generator=val_generator(SEED, i, 0))  # fmt: skip
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
    validator = Validator(vset, every=5, block_size=8, mask_token_id=dcfg.mask_token_id, max_anchors=ANCHORS,
                          gamma=None, loss_chunk=512, seed=SEED, rank=0,
                          loader=lambda units: open_loader(vset, units, **common))  # fmt: skip
    objective = dict(validator.objective)
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
