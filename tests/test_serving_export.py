"""The export loads through z-lab's documented route, AutoModel.from_pretrained(export,
trust_remote_code=True), in a fresh process that never imports dflash_cache, and the modeling file
it carries computes the same function as DFlashDrafter: the same weights, the same hidden states
for a block (with and without the KV cache between calls), and greedy spec_generate reproduces
the target's own greedy decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY_TARGET, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dflash.config import AUTO_MAP, MODELING_FILE, DrafterConfig
from dflash_cache.drafters.dflash.family import load_serving, save_serving
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.target.load import stop_token_ids

B = 4
CTX = 13  # context positions before the first block; the cached case continues to CTX2
CTX2 = 19
MAX_NEW = 24
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
WINDOW = 6  # shorter than either context

# Runs in a clean interpreter: transformers' module cache in a fresh directory, no dflash_cache.
REMOTE = r"""
import json, sys
import torch
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

job = json.loads(sys.argv[1])
inputs = torch.load(job["inputs"])
results = {}
for name, path in job["exports"].items():
    draft = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(draft).__name__ == "DFlashDraftModel", type(draft)
    assert type(draft).__module__.startswith("transformers_modules"), type(draft).__module__
    ctx, noise, noise2 = inputs["context"], inputs["noise"], inputs["noise2"]
    c1, c2, B = ctx.shape[1] - job["extra"], ctx.shape[1], noise.shape[1]
    with torch.no_grad():
        whole = draft(position_ids=torch.arange(c2 + B)[None], noise_embedding=noise2, target_hidden=ctx)
        cache = DynamicCache()
        first = draft(position_ids=torch.arange(c1 + B)[None], noise_embedding=noise, target_hidden=ctx[:, :c1],
                      past_key_values=cache, use_cache=True)
        cache.crop(-B)  # drop the block's keys and values, keep the context's
        second = draft(position_ids=torch.arange(c1, c2 + B)[None], noise_embedding=noise2,
                       target_hidden=ctx[:, c1:], past_key_values=cache, use_cache=True)
    results[name] = {
        "state": {k: v.clone() for k, v in draft.state_dict().items()},
        "attrs": [draft.block_size, draft.target_layer_ids, draft.mask_token_id],
        "whole": whole, "first": first, "second": second,
    }
    if name == "tiny":
        target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
        prompt = torch.tensor([inputs["prompt"]])
        out = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=job["max_new"],
                                  stop_token_ids=job["stops"], temperature=0.0)
        results[name]["generated"] = out[0, prompt.shape[1]:].tolist()
assert not any(m == "dflash_cache" or m.startswith("dflash_cache.") for m in sys.modules), "imported dflash_cache"
torch.save(results, job["out"])
"""


def tiny_drafter(rope_scaling: dict | None = None, window: int | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """A random drafter for the tiny target with bf16-representable weights (the export is then
    lossless) and norms away from 1, so that every weight matters. `window`: its first layer slides
    with that window, its second keeps full attention."""
    cfg = json.loads((TINY_TARGET / "config.json").read_text())
    if rope_scaling is not None:
        cfg["rope_parameters"] = {**cfg["rope_parameters"], **rope_scaling}
    types = None if window is None else ["sliding_attention", "full_attention"]
    dcfg = DrafterConfig.from_target(cfg, target_layer_ids=[1, 4, 6], mask_token_id=1535, num_draft_layers=2,
                                     block_size=B, sliding_window=window, layer_types=types)  # fmt: skip
    assert (dcfg.rope_scaling is None) == (rope_scaling is None)
    torch.manual_seed(0)
    model = DFlashDrafter(dcfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
    return model, dcfg


def one_block(model: DFlashDrafter, context: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Our drafter's hidden states for one block (`noise` [B, H]) anchored right after `context` [C, K*H]."""
    c = context.shape[0]
    layout = BlockLayout.build(torch.tensor([0, c]), torch.zeros(1, dtype=torch.long), torch.tensor([c]),
                               noise.shape[0])  # fmt: skip
    with torch.no_grad():
        return model(noise, context, layout)


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """Export three drafters (plain, YaRN RoPE, a sliding window shorter than the context), load them
    in a clean process, run them there."""
    tmp = tmp_path_factory.mktemp("remote")
    models, exports = {}, {}
    for name, scaling, window in (("tiny", None, None), ("yarn", YARN, None), ("window", None, WINDOW)):
        model, dcfg = tiny_drafter(scaling, window)
        save_serving(model, dcfg, tmp / name)
        models[name], exports[name] = (model, dcfg), str(tmp / name)
    dcfg = models["tiny"][1]
    g = torch.Generator().manual_seed(3)
    inputs = {
        "context": torch.randn(1, CTX2, dcfg.num_context_layers * dcfg.hidden_size, generator=g),
        "noise": torch.randn(1, B, dcfg.hidden_size, generator=g),
        "noise2": torch.randn(1, B, dcfg.hidden_size, generator=g),
    }
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    stops = stop_token_ids(tokenizer, target)
    inputs["prompt"] = load_prompts(ROOT / "data" / "prompts.jsonl", tokenizer, limit=1)[0]
    torch.save(inputs, tmp / "inputs.pt")
    job = {"inputs": str(tmp / "inputs.pt"), "exports": exports, "extra": CTX2 - CTX, "target": str(TINY_TARGET),
           "max_new": MAX_NEW, "stops": sorted(stops), "out": str(tmp / "results.pt")}  # fmt: skip
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", REMOTE, json.dumps(job)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = hf_greedy(target, inputs["prompt"], MAX_NEW, stops)
    return models, inputs, torch.load(tmp / "results.pt"), reference


def test_export_carries_auto_map_and_modeling_file(tmp_path):
    model, dcfg = tiny_drafter()
    save_serving(model, dcfg, tmp_path / "d")
    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert conf["auto_map"] == AUTO_MAP == {"AutoModel": "dflash.DFlashDraftModel"}
    source = (tmp_path / "d" / MODELING_FILE).read_text()
    imports = {line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert {m.split(".")[0] for m in imports} == {"__future__", "inspect", "torch", "transformers"}
    loaded, loaded_cfg = load_serving(tmp_path / "d", dtype=torch.float32)  # the strict load still works
    assert loaded_cfg == dcfg
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["tiny", "yarn", "window"])
def test_remote_weights_equal_ours(remote, name):
    models, _, results, _ = remote
    model, dcfg = models[name]
    theirs, ours = results[name]["state"], model.state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert results[name]["attrs"] == [dcfg.block_size, dcfg.target_layer_ids, dcfg.mask_token_id]


@pytest.mark.parametrize("name", ["tiny", "yarn", "window"])
def test_remote_forward_equals_ours(remote, name):
    """One call over the whole context, and the same context split over two calls with the KV
    cache in between, give DFlashDrafter's hidden states for the block (a sliding layer's window
    too: there, full attention would give other states)."""
    models, inputs, results, _ = remote
    model, _ = models[name]
    ctx, r = inputs["context"][0], results[name]
    want_whole = one_block(model, ctx, inputs["noise2"][0])
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(r["whole"][0], want_whole, **tol)
    torch.testing.assert_close(r["first"][0], one_block(model, ctx[:CTX], inputs["noise"][0]), **tol)
    torch.testing.assert_close(r["second"][0], want_whole, **tol)
    if name == "window":
        full, _ = tiny_drafter()
        full.load_state_dict(model.state_dict())
        assert (one_block(full, ctx, inputs["noise2"][0]) - want_whole).abs().max() > 1e-3


def test_remote_spec_generate_is_the_targets_greedy_decoding(remote):
    _, _, results, reference = remote
    assert results["tiny"]["generated"] == reference
