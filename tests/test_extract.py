"""The extract stage against independent computations: the model's own output_hidden_states,
the source rows, a single-process run (killed runs against an uninterrupted one: test_faults.py)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import CHAT, TINY_TARGET, extract_config, jsonl_rows, read_cache
from transformers import AutoModelForCausalLM

from dflash_cache.cache.spec import read_spec, write_spec
from dflash_cache.cache.store import REJECTED, committed_units
from dflash_cache.cache.unit.codec import decode_hidden
from dflash_cache.core.errors import UserError
from dflash_cache.core.settings import resolve
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.stage import ExtractError, prepare, run


def test_hidden_states_match_output_hidden_states(tiny_cache):
    spec = read_spec(tiny_cache)
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    cached = read_cache(tiny_cache)
    lengths = {s: len(v[1]) for s, v in cached.items()}
    # samples from several buckets: the shortest, the longest and some in between
    picks = sorted(lengths, key=lengths.get)[:: max(1, len(lengths) // 12)] + [max(lengths, key=lengths.get)]
    H = spec.target.hidden_size
    for s in picks:
        bits, ids, mask, _ = cached[s]
        with torch.no_grad():
            ref = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
        for k, lid in enumerate(spec.layers.ids):
            want = ref[lid + 1][0]
            # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of itself,
            # plus float32 noise from running in a padded batch rather than alone
            torch.testing.assert_close(got[:, k * H : (k + 1) * H], want, rtol=2**-8, atol=1e-5)
            assert want.abs().mean() > 1e-3


def test_every_row_once_and_rejections_recorded(tmp_path):
    rows = jsonl_rows(CHAT, 60)
    bad = {3: {"messages": []}, 10: {"messages": [{"role": "wizard", "content": "hi"}]},
           20: {"prompt": "x" * 5000, "response": "y"}}  # fmt: skip
    lines = [json.dumps(bad.get(i, r)) for i, r in enumerate(rows)]
    lines.insert(30, "{not json")
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "cache"
    summary = run(extract_config(out, data=str(data), unit_mb=1))
    rejected = jsonl_rows(out / REJECTED)
    rejected_rows = sorted(r["row"] for r in rejected)
    assert rejected_rows == [3, 10, 20, 30]
    assert all(r["reason"] for r in rejected)
    cached = read_cache(out)
    assert sorted(cached) == [i for i in range(len(lines)) if i not in rejected_rows]
    assert summary["rejected"] == 4 and summary["samples"] == len(cached)
    assert len(committed_units(out)) > 1
    # the rate of the forward loop alone is faster than the whole run, start-up and drain included
    assert 0 < summary["startup_s"] < summary["seconds"]
    assert summary["forward_tokens_per_s"] > summary["tokens"] / summary["seconds"]
    assert summary["buffer_wait_s"] >= 0


@pytest.mark.slow  # two extract processes
def test_two_processes_equal_one(tmp_path, tiny_cache):
    out = tmp_path / "cache"
    run(extract_config(out, procs=2))
    a, b = read_cache(out), read_cache(tiny_cache)
    assert sorted(a) == sorted(b)
    for s in a:
        np.testing.assert_array_equal(a[s][0], b[s][0])
    assert sorted(committed_units(out)) == sorted(committed_units(tiny_cache))


def test_fp8_round_trip_error(tmp_path, tiny_cache):
    """fp8 storage: per-token, per-layer scales keep the relative error of every row under 7%
    (e4m3 has 3 mantissa bits: half an ulp is 1/16 of the value's binade)."""
    out = tmp_path / "cache"
    run(extract_config(out, storage="fp8"))
    spec = read_spec(out)
    H, K = spec.target.hidden_size, len(spec.layers.ids)
    a, b = read_cache(out), read_cache(tiny_cache)
    for s in list(a)[:50]:
        bits, _, _, scale = a[s]
        got = decode_hidden(torch.from_numpy(bits), torch.from_numpy(scale), K).view(-1, K, H)
        ref = torch.from_numpy(b[s][0].view(np.int16)).view(torch.bfloat16).float().view(-1, K, H)
        err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert err.max() < 0.07
        assert (got - ref).abs().max() <= (ref.abs().amax(-1, keepdim=True) / 16 + 1e-6).max()


def test_bad_requests_refused(tmp_path, tiny_cache):
    with pytest.raises(ExtractError, match="layers"):
        run(extract_config(tmp_path / "c", layers=[1, 99]))
    assert not (tmp_path / "c").exists()  # a refused run leaves nothing behind
    with pytest.raises(ExtractError, match="storage"):
        prepare(extract_config(tmp_path / "c", storage="int4"))
    with pytest.raises(ExtractError, match="layers.ids"):
        prepare(extract_config(tiny_cache, layers=[1, 2]))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    with pytest.raises(ExtractError, match="not a dflash cache"):
        prepare(extract_config(tmp_path / "junk"))


def test_dry_run_writes_no_units(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TINY_TARGET.parents[1])}
    out = tmp_path / "cache"
    argv = ["extract", "--target", str(TINY_TARGET), "--data", str(CHAT), "--out", str(out), "--dry-run"]
    res = subprocess.run([sys.executable, "-m", "cli.main", *argv], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["samples"] == 400 and plan["padding"] < 0.2 and plan["estimated_bytes_max"] > 0
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))  # nothing at all, not even .work/


def test_source_options_recorded_and_a_changed_one_refused(tmp_path):
    """--data-split, --max-samples and --chat-template-kwargs shape the rows, so cache.json records
    them and a rerun with other values is refused, naming the field."""
    import datasets

    rows = jsonl_rows(CHAT, 40)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:10]),
                          "train_sft": datasets.Dataset.from_list(rows[10:])}).save_to_disk(saved)  # fmt: skip
    out = tmp_path / "cache"
    options = {"data": str(saved), "data_split": "train_sft", "max_samples": 20,
               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    prep = prepare(extract_config(out, **options))
    spec = prep.spec
    assert (spec.data.split, spec.data.max_samples, spec.data.num_rows) == ("train_sft", 20, 20)
    assert spec.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    assert sorted(prep.tokens.dataset["sample_index"]) == list(range(20))
    first = prep.tokens.dataset.filter(lambda r: r["sample_index"] == 0)["input_ids"][0]
    assert first == prepare(extract_config(tmp_path / "other", data=str(CHAT))).tokens.dataset.filter(
        lambda r: r["sample_index"] == 10)["input_ids"][0]  # row 0 of train_sft is row 10 of the source  # fmt: skip
    write_spec(out, spec)
    assert prepare(extract_config(out, **options)).spec.differences(spec) == []  # the same command resumes
    for change, field in (({"chat_template_kwargs": {"enable_thinking": True}}, "tokenizer.chat_template_kwargs"),
                          ({"chat_template_kwargs": None}, "tokenizer.chat_template_kwargs"),
                          ({"max_samples": 25}, "data.max_samples"),
                          ({"data_split": "train"}, "data.split")):  # fmt: skip
        with pytest.raises(ExtractError, match=f"other settings.*{re.escape(field)}") as refused:
            prepare(extract_config(out, **{**options, **change}))
        assert f"rerun with --config {out}" in str(refused.value)
    assert prepare(resolve(ExtractConfig, files=[out])).spec.differences(spec) == []  # what that rerun reads


def test_cache_json_without_the_new_fields_still_reads(tmp_path, tiny_cache):
    """A cache written before chat_template_kwargs, split and max_samples were recorded reads as
    their defaults, and the command that made it resumes it."""
    old = json.loads((tiny_cache / "cache.json").read_text())
    del old["tokenizer"]["chat_template_kwargs"], old["data"]["split"], old["data"]["max_samples"]
    copy = tmp_path / "old-cache"
    copy.mkdir()
    (copy / "cache.json").write_text(json.dumps(old))
    spec = read_spec(copy)
    assert (spec.tokenizer.chat_template_kwargs, spec.data.split, spec.data.max_samples) == ({}, None, None)
    assert prepare(extract_config(copy)).spec.differences(spec) == []
    with pytest.raises(ExtractError, match="tokenizer.chat_template_kwargs"):
        prepare(extract_config(copy, chat_template_kwargs={"enable_thinking": False}))


def test_out_that_is_a_file_is_refused_and_kept(tmp_path):
    out = tmp_path / "cache"
    out.write_text("not a cache")
    with pytest.raises(UserError, match="--out .* is a file"):
        run(extract_config(out))
    assert out.read_text() == "not a cache"
