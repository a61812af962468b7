"""The target's final hidden state in the cache (`extract --final-hidden`), against the model's own
last_hidden_state; its accounting in info, verify and --dry-run; resume and fit refusals; the loader."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import CHAT, TINY_TARGET, extract_config, read_cache
from transformers import AutoModelForCausalLM

from dflash_cache.cache.audit import info, verify
from dflash_cache.cache.format import RowFormat, UnitReader, decode_hidden
from dflash_cache.cache.spec import SpecError, read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.devices import flush_denormals
from dflash_cache.extract.stage import ExtractError, estimated_bytes, final_bytes, prepare, run
from dflash_cache.train.loader import CacheLoader

ROWS = 48  # a few units' worth of the chat data: enough for every bucket shape, fast to extract


@pytest.fixture(scope="module")
def final_caches(tmp_path_factory):
    """bf16 and fp8 caches with the final hidden state, and a bf16 one without, of the same rows."""
    root = tmp_path_factory.mktemp("final")
    out = {}
    for name, opts in (("bf16", {"final_hidden": True}), ("fp8", {"final_hidden": True, "storage": "fp8"}),
                       ("plain", {})):  # fmt: skip
        out[name] = root / name
        run(extract_config(out[name], max_samples=ROWS, unit_mb=1, **opts))
    return out


def _final_rows(cache) -> dict[int, torch.Tensor]:
    """sample_index -> its cached final hidden state, decoded to float32."""
    rows = {}
    for path in committed_units(cache).values():
        r = UnitReader(path)
        fp8 = "final_scale" in r.arrays
        for i, s in enumerate(r.sample_index.tolist()):
            a, b = int(r.offsets[i]), int(r.offsets[i + 1])
            bits = torch.from_numpy(r.read("final_hidden", a, b))
            scale = torch.from_numpy(r.read("final_scale", a, b)) if fp8 else None
            rows[s] = decode_hidden(bits.view(torch.int16) if not fp8 else bits, scale, 1).float()
    return rows


def test_final_hidden_is_the_base_models_last_hidden_state(final_caches):
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    plain = read_cache(final_caches["plain"])
    reference = {}
    with torch.no_grad(), flush_denormals(torch.device("cpu")):  # denormals make a CPU forward 10x slower
        for s, (_, ids, _, _) in plain.items():
            out = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True)
            # after the final norm: what the LM head reads
            torch.testing.assert_close(out.hidden_states[-1][0] @ model.lm_head.weight.T, out.logits[0])
            reference[s] = out.hidden_states[-1][0]
    for storage in ("bf16", "fp8"):
        cache = final_caches[storage]
        spec = read_spec(cache)
        assert spec.layers.final_hidden and json.loads((cache / "cache.json").read_text())["layers"]["final_hidden"]
        final, taps = _final_rows(cache), read_cache(cache)
        assert sorted(final) == sorted(plain) and len(final) == ROWS
        for s, got in final.items():
            want = reference[s]
            if storage == "bf16":
                torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-5)
                # the taps are those of a cache made without the option, bit for bit
                np.testing.assert_array_equal(taps[s][0], plain[s][0])
            else:  # a per-token scale: e4m3's relative error, as for the taps
                assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.07
            assert want.abs().mean() > 1e-2


def test_info_verify_and_dry_run_count_it(final_caches, tmp_path):
    H = read_spec(final_caches["bf16"]).target.hidden_size
    for storage, per_token in (("bf16", 2 * H), ("fp8", H + 4)):
        cache = final_caches[storage]
        got = info(cache)
        assert got["final_hidden"] and got["final_hidden_bytes_per_token"] == per_token
        assert 0 < got["final_hidden_bytes_on_disk_per_token"] < per_token  # compressed
        row = RowFormat.of(read_spec(cache))
        assert got["compression_ratio"] == pytest.approx(got["tokens"] * row.row_bytes / got["bytes_on_disk"])
        assert verify(cache) == {}
    plain = info(final_caches["plain"])
    assert not plain["final_hidden"] and "final_hidden_bytes_per_token" not in plain
    assert "final_hidden" not in json.loads((final_caches["plain"] / "cache.json").read_text())["layers"]

    for storage, per_token in (("bf16", 2 * H), ("fp8", H + 4)):
        with_it, without = (prepare(extract_config(tmp_path / "dry", max_samples=ROWS, storage=storage,
                                                   final_hidden=final), write=False) for final in (True, False))
        assert final_bytes(with_it.spec) == {"final_hidden_bytes_per_token": per_token}
        assert not final_bytes(without.spec)
        tokens = with_it.plan.num_tokens
        assert estimated_bytes(with_it.spec, tokens) - estimated_bytes(without.spec, tokens) == per_token * tokens
        # the same units: they are cut by the taps' bytes
        assert [u.num_tokens for u in with_it.plan.units] == [u.num_tokens for u in without.plan.units]
    env = {**os.environ, "PYTHONPATH": str(TINY_TARGET.parents[1])}
    argv = [sys.executable, "-m", "cli.main", "extract", "--target", str(TINY_TARGET), "--data", str(CHAT),
            "--out", str(tmp_path / "dry"), "--dry-run", "--max-samples", str(ROWS), "--final-hidden",
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
    assert list(bad) == [unit.name] and "final_hidden" in " ".join(bad[unit.name])


def test_resume_with_another_choice_is_refused(final_caches):
    with pytest.raises(ExtractError, match=r"other settings.*layers\.final_hidden \(True vs False\)"):
        prepare(extract_config(final_caches["bf16"], max_samples=ROWS, unit_mb=1))
    with pytest.raises(ExtractError, match=r"other settings.*layers\.final_hidden \(False vs True\)"):
        prepare(extract_config(final_caches["plain"], max_samples=ROWS, unit_mb=1, final_hidden=True))
    # the commands that made them resume them (nothing left to do)
    assert prepare(extract_config(final_caches["plain"], max_samples=ROWS, unit_mb=1)).done
    assert prepare(extract_config(final_caches["bf16"], max_samples=ROWS, unit_mb=1, final_hidden=True)).done


def test_loader_hands_over_the_final_state_only_when_asked(final_caches):
    cache = final_caches["bf16"]
    final = _final_rows(cache)
    with CacheLoader(cache, token_budget=512, device=torch.device("cpu"), final_hidden=True) as loader:
        seen = 0
        for batch in loader.epoch(0):
            starts = batch.offsets.tolist()
            for i, s in enumerate(batch.sample_index.tolist()):
                np.testing.assert_array_equal(batch.final[starts[i] : starts[i + 1]].float().numpy(), final[s].numpy())
                seen += 1
        assert seen == ROWS
    with CacheLoader(cache, token_budget=512, device=torch.device("cpu")) as loader:
        assert all(batch.final is None for batch in loader.epoch(0))
        assert "final_hidden" not in loader.host_slots[0].np  # a DFlash run never reads it
    with pytest.raises(SpecError, match="--final-hidden"):
        CacheLoader(final_caches["plain"], token_budget=512, device=torch.device("cpu"), final_hidden=True)
