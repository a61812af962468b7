"""The family-shaped fixture targets (family_targets.py) are laid out like the real families.

Other tests rely on these targets standing in for Qwen3, Llama 3 and Gemma, so this checks what
makes them stand-ins: they load through the Auto classes, carry no mask token, have the real
families' vocabulary sizes relative to the tokenizer, and render chats as the official templates
do (expected strings written out by hand below).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import family_targets as fam
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # make_bench_inputs, a benchmarks/ script

STOPS = {"qwen3": ["<|im_end|>", "<|endoftext|>"], "llama3": ["<|eot_id|>", "<|end_of_text|>"],
         "gemma": ["<end_of_turn>", "<eos>"]}  # fmt: skip
BOS = {"qwen3": None, "llama3": "<|begin_of_text|>", "gemma": "<bos>"}
for _f in fam.HYBRIDS:  # Qwen3.5's tokens are Qwen3's (and its vision markers)
    STOPS[_f], BOS[_f] = STOPS["qwen3"], BOS["qwen3"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: fam.build(f, root / f) for f in fam.FAMILIES}


def messages(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


@pytest.mark.parametrize("family", fam.FAMILIES)
def test_loads_like_a_real_target(built, family):
    tok = AutoTokenizer.from_pretrained(built[family])
    model = AutoModelForCausalLM.from_pretrained(built[family])
    vocab = model.config.vocab_size

    assert tok.mask_token is None and not any("mask" in t for t in tok.get_vocab())
    if family == "llama3":  # Llama 3 fills its table with reserved specials: no spare row
        assert vocab == len(tok)
    else:
        assert vocab > len(tok)
    stop_ids = [tok.convert_tokens_to_ids(t) for t in STOPS[family]]
    assert model.generation_config.eos_token_id == stop_ids
    assert tok.eos_token_id == stop_ids[0 if family != "gemma" else 1]
    for t in STOPS[family]:  # each special token is one id, never split
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)]

    plain = tok("Ila the lamplighter")["input_ids"]
    assert (plain[0] == tok.convert_tokens_to_ids(BOS[family])) if BOS[family] else (tok.bos_token is None)
    chat = tok.apply_chat_template(messages(fam.example_rows(family)[2]))["input_ids"]
    if BOS[family]:  # the template writes bos itself; rendering must not add a second one
        assert chat[0] == tok.bos_token_id and chat.count(tok.bos_token_id) == 1

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([chat])).logits
    assert logits.shape == (1, len(chat), vocab) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", fam.FAMILIES)
def test_example_rows_render_losslessly(built, family):
    tok = AutoTokenizer.from_pretrained(built[family])
    rows = fam.example_rows(family)
    assert len(rows) >= 10
    convs = [messages(r) for r in rows]
    assert any(sum(m["role"] == "assistant" for m in c) >= 2 for c in convs)
    assert any(c[0]["role"] == "system" for c in convs) and any("prompt" in r for r in rows)
    if family in fam.THINKING:
        assert any("reasoning_content" in m for c in convs for m in c)
        assert any("</think>" in m["content"] for c in convs for m in c)
    for conv in convs:
        text = tok.apply_chat_template(conv, tokenize=False)
        ids = tok.apply_chat_template(conv)["input_ids"]
        assert tok.decode(ids) == text  # byte-level BPE and whole special tokens lose nothing
        assert len(text) / len(ids) > 2  # the fixed sentences tokenize into words, not bytes
        assert json.loads(json.dumps(conv)) == conv  # rows are plain JSON, writable to a .jsonl


def test_qwen3_template_drops_earlier_reasoning(built):
    tok = AutoTokenizer.from_pretrained(built["qwen3"])
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6.", "reasoning_content": "Add again."},
    ]
    head = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
    )
    assert tok.apply_chat_template(conv, tokenize=False) == (
        head + "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6.<|im_end|>\n"
    )
    # Without reasoning the last turn still gets an (empty) think block; earlier turns never do.
    plain = [*conv[:4], {"role": "assistant", "content": "6."}]
    assert tok.apply_chat_template(plain, tokenize=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n6.<|im_end|>\n"
    )
    # A prefix of the conversation keeps the first turn's think block: not prefix-stable.
    assert tok.apply_chat_template(conv[:3], tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4.<|im_end|>\n"
    )
    think = tok.convert_tokens_to_ids("<think>")
    assert think not in tok.all_special_ids  # a plain added token, as in Qwen3
    assert tok.apply_chat_template(conv)["input_ids"].count(think) == 1

    ask = conv[:4]
    assert tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True) == (
        head + "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True, enable_thinking=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_llama3_and_gemma_templates(built):
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": " 4.\n"},
    ]
    llama = AutoTokenizer.from_pretrained(built["llama3"])
    system = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief."
    assert llama.apply_chat_template(conv, tokenize=False) == (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
    )
    assert llama.apply_chat_template(conv[:2], tokenize=False, add_generation_prompt=True).endswith(
        "What is 2 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )

    gemma = AutoTokenizer.from_pretrained(built["gemma"])
    assert gemma.apply_chat_template(conv, tokenize=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n4.<end_of_turn>\n"
    )
    assert gemma.apply_chat_template(conv[:2], tokenize=False, add_generation_prompt=True).endswith(
        "What is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_build_is_deterministic_and_vocab_overridable(tmp_path, built):
    out = fam.build("llama3", tmp_path / "roomy", vocab_size=1024)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 1024 > len(AutoTokenizer.from_pretrained(out))
    again = fam.build("qwen3", tmp_path / "again")
    for name in ("tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (built["qwen3"] / name).read_bytes()
    with pytest.raises(ValueError, match="unknown family"):
        fam.build("mistral", tmp_path / "nope")


def test_bench_inputs_qwen3_rows_fit_the_length_mix(built):
    import make_bench_inputs

    from dflash_cache.bench.shapes import lognormal_lengths

    tok = AutoTokenizer.from_pretrained(built["qwen3"])
    rows = make_bench_inputs.qwen3_rows(30, tok)
    convs = [r["messages"] for r in rows]
    assert sum(len(c) > 2 for c in convs) == 10 and sum("reasoning_content" in c[-1] for c in convs) == 10
    assert sum("</think>" in c[-1]["content"] for c in convs) == 10
    think = tok.convert_tokens_to_ids("<think>")
    for conv, n in zip(convs, lognormal_lengths(30), strict=True):
        ids = tok.apply_chat_template(conv)["input_ids"]
        assert ids.count(think) == 1  # an earlier turn's reasoning is dropped, the last turn's kept
        last = conv[-1].get("reasoning_content", "") + " " + conv[-1]["content"]
        assert 0.8 < len(tok(last)["input_ids"]) / n < 1.25  # the last reply follows the length mix
