"""The target's final hidden state in the cache (`extract --final-hidden`), against the model's own
last_hidden_state; its accounting in info, verify and --dry-run; resume and fit refusals; the loader."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import CHAT, TINY_TARGET, extract_config
from transformers import AutoModelForCausalLM

from dflash_cache.cache.audit import info, verify
from dflash_cache.cache.spec import SpecError, read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.cache.unit.codec import decode_hidden
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.core.devices import flush_denormals
from dflash_cache.extract.stage import ExtractError, estimated_bytes, final_bytes, prepare, run
from dflash_cache.train.loader import CacheLoader

PICKS = 40  # samples compared with the model's own forward: every length bucket, in seconds


@pytest.fixture(scope="module")
def final_caches(tiny_cache, final_cache, tmp_path_factory):
    """The chat data's caches with the final hidden state, bf16 and fp8, and `tiny_cache` without it:
    the same rows, plan and units."""
    fp8 = tmp_path_factory.mktemp("final") / "fp8"
    run(extract_config(fp8, final_hidden=True, storage="fp8"))
    return {"bf16": final_cache, "fp8": fp8, "plain": tiny_cache}


def _samples(cache, wanted=None) -> dict[int, dict[str, np.ndarray]]:
    """sample_index -> its arrays (taps, ids, and the final state decoded to float32), of the
    `wanted` samples (all: None), read through the unit reader."""
    rows = {}
    for path in committed_units(cache).values():
        r = UnitReader(path)
        for i, s in enumerate(r.sample_index.tolist()):
            if wanted is not None and s not in wanted:
                continue
            a, b = int(r.offsets[i]), int(r.offsets[i + 1])
            got = {key: r.read(key, a, b) for key in r.arrays if key in ("hidden", "input_ids", "final_hidden",
                                                                         "final_scale")}  # fmt: skip
            if "final_hidden" in got:
                bits = torch.from_numpy(got["final_hidden"])
                scale = torch.from_numpy(got["final_scale"]) if "final_scale" in got else None
                got["final"] = decode_hidden(bits if scale is not None else bits.view(torch.int16), scale, 1).float()
            rows[s] = got
    return rows


def test_final_hidden_is_the_base_models_last_hidden_state(final_caches):
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    lengths = {s: n for s, n in zip(*_index(final_caches["plain"]), strict=True)}
    by_length = sorted(lengths, key=lengths.get)
    picks = set(by_length[:: len(by_length) // PICKS][:PICKS] + [by_length[-1]])  # short to the longest
    plain = _samples(final_caches["plain"], picks)
    reference = {}
    with torch.no_grad(), flush_denormals(torch.device("cpu")):  # denormals make a CPU forward 10x slower
        for s in picks:
            out = model(torch.from_numpy(plain[s]["input_ids"].astype(np.int64))[None], output_hidden_states=True)
            # after the final norm: what the LM head reads
            torch.testing.assert_close(out.hidden_states[-1][0] @ model.lm_head.weight.T, out.logits[0])
            reference[s] = out.hidden_states[-1][0]
    for storage in ("bf16", "fp8"):
        cache = final_caches[storage]
        spec = read_spec(cache)
        assert spec.layers.final_hidden and json.loads((cache / "cache.json").read_text())["layers"]["final_hidden"]
        assert sorted(_index(cache)[0]) == sorted(lengths)
        got = _samples(cache, picks)
        for s in picks:
            want = reference[s]
            if storage == "bf16":
                torch.testing.assert_close(got[s]["final"], want, rtol=2**-8, atol=1e-5)
                # the taps are those of a cache made without the option, bit for bit
                np.testing.assert_array_equal(got[s]["hidden"], plain[s]["hidden"])
            else:  # a per-token scale: e4m3's relative error, as for the taps
                assert ((got[s]["final"] - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.07
            assert want.abs().mean() > 1e-2


def _index(cache) -> tuple[list[int], list[int]]:
    """(sample_index, length) of every cached sample, from the manifests alone."""
    ids, lengths = [], []
    for path in committed_units(cache).values():
        r = UnitReader(path)
        ids += r.sample_index.tolist()
        lengths += r.lengths.tolist()
    return ids, lengths


def test_info_verify_and_dry_run_count_it(final_caches, tmp_path):
    H = read_spec(final_caches["bf16"]).target.hidden_size
    for storage, per_token in (("bf16", 2 * H), ("fp8", H + 4)):
        cache = final_caches[storage]
        got = info(cache)
        assert got["final_hidden"] and got["final_hidden_bytes_per_token"] == per_token
        assert 0 < got["final_hidden_bytes_on_disk_per_token"] < per_token  # compressed
        row = RowFormat.of(read_spec(cache))
        assert got["compression_ratio"] == pytest.approx(got["tokens"] * row.row_bytes / got["bytes_on_disk"])
        if storage == "fp8":  # (the bf16 one is verified, and damaged, below)
            assert verify(cache) == {}
    plain = info(final_caches["plain"])
    assert not plain["final_hidden"] and "final_hidden_bytes_per_token" not in plain
    assert "final_hidden" not in json.loads((final_caches["plain"] / "cache.json").read_text())["layers"]

    for storage, per_token in (("bf16", 2 * H), ("fp8", H + 4)):
        with_it, without = (prepare(extract_config(tmp_path / "dry", max_samples=48, storage=storage,
                                                   final_hidden=final), write=False) for final in (True, False))
        assert final_bytes(with_it.spec) == {"final_hidden_bytes_per_token": per_token}
        assert not final_bytes(without.spec)
        tokens = with_it.plan.num_tokens
        assert estimated_bytes(with_it.spec, tokens) - estimated_bytes(without.spec, tokens) == per_token * tokens
        # the same units: they are cut by the taps' bytes
        assert [u.num_tokens for u in with_it.plan.units] == [u.num_tokens for u in without.plan.units]
    env = {**os.environ, "PYTHONPATH": str(TINY_TARGET.parents[1])}
    argv = [sys.executable, "-m", "cli.main", "extract", "--target", str(TINY_TARGET), "--data", str(CHAT),
            "--out", str(tmp_path / "dry"), "--dry-run", "--max-samples", "48", "--final-hidden",
            "--storage", "fp8"]  # fmt: skip
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["final_hidden"] and plan["final_hidden_bytes_per_token"] == H + 4
    assert not (tmp_path / "dry").exists()


def test_damaged_final_state_is_named(final_caches, tmp_path):
    import shutil

    cache = tmp_path / "copy"
    shutil.copytree(final_caches["bf16"], cache)
    unit = sorted(committed_units(cache).values())[0]
    shard = next(p for p in (unit / "final_hidden").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = verify(cache)
    assert list(bad) == [unit.name] and "final_hidden" in " ".join(bad[unit.name])  # the other units are sound


def test_resume_with_another_choice_is_refused(final_caches):
    with pytest.raises(ExtractError, match=r"other settings.*layers\.final_hidden \(True vs False\)"):
        prepare(extract_config(final_caches["bf16"]), write=False)
    with pytest.raises(ExtractError, match=r"other settings.*layers\.final_hidden \(False vs True\)"):
        prepare(extract_config(final_caches["plain"], final_hidden=True), write=False)
    # the commands that made them resume them (nothing left to do)
    assert prepare(extract_config(final_caches["plain"]), write=False).done
    assert prepare(extract_config(final_caches["bf16"], final_hidden=True), write=False).done


def test_loader_hands_over_the_final_state_only_when_asked(final_caches):
    cache = final_caches["bf16"]
    final = {s: x["final"] for s, x in _samples(cache).items()}
    with CacheLoader(cache, token_budget=2048, device=torch.device("cpu"), final_hidden=True) as loader:
        seen = 0
        for batch in loader.epoch(0):
            starts = batch.offsets.tolist()
            for i, s in enumerate(batch.sample_index.tolist()):
                np.testing.assert_array_equal(batch.final[starts[i] : starts[i + 1]].float().numpy(), final[s].numpy())
                seen += 1
        assert seen == len(final)
    with CacheLoader(cache, token_budget=512, device=torch.device("cpu")) as loader:
        assert all(batch.final is None for batch in loader.epoch(0))
        assert "final_hidden" not in loader.host_slots[0].np  # a DFlash run never reads it
    with pytest.raises(SpecError, match="--final-hidden"):
        CacheLoader(final_caches["plain"], token_budget=512, device=torch.device("cpu"), final_hidden=True)
