"""The mask token of DFlash blocks for tokenizers that have none (Qwen3, Llama 3, SmolLM2), checked
against the tokenizers themselves: the chosen id is one no text encodes to, inside the target's
embedding table, absent from the data and the chat template, and it is the id the cache records
(with the rule that chose it), the training blocks hold and the export declares."""

from __future__ import annotations

import json

import family_targets as fam
import pytest
from helpers import CHAT, TINY_TARGET, extract_config, jsonl_head
from transformers import AutoConfig, AutoTokenizer

from dflash_cache.cache.spec import CacheSpec, read_spec
from dflash_cache.core.errors import UserError
from dflash_cache.core.settings import SettingsError, resolve
from dflash_cache.drafters.dflash import family as dflash_family
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.mask import choose_mask_token, data_token_ids, unused_special_tokens
from dflash_cache.extract.stage import prepare, run
from dflash_cache.train import stage as train_mod


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mask-targets")
    return {f: fam.build(f, root / f) for f in ("qwen3", "llama3")}


def load(path) -> tuple:
    return AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size


def text_produces(tok, token_id: int) -> bool:
    """Independently of the rule under test: does encoding the token's own text give its id?"""
    text = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(token_id)])
    return token_id in tok(text, add_special_tokens=False)["input_ids"]


def mask_token_id(tok, vocab: int, setting=None, data_ids=None) -> int:
    return choose_mask_token(tok, vocab, setting, data_ids=data_ids).id


def test_default_is_len_tokenizer_when_there_is_no_mask_token(targets):
    tok, vocab = load(targets["qwen3"])
    assert tok.mask_token is None and len(tok) < vocab  # laid out like Qwen3: 151,669 < 151,936
    got = mask_token_id(tok, vocab)
    assert got == len(tok) and choose_mask_token(tok, vocab).rule == "spare_row"
    assert tok.convert_ids_to_tokens(got) is None  # past every token: no text encodes to it
    assert max(tok.get_vocab().values()) == got - 1


def test_the_tokenizers_own_mask_token_comes_first():
    tok, vocab = load(TINY_TARGET)
    assert mask_token_id(tok, vocab) == tok.convert_tokens_to_ids("<|mask|>") == 1535


def test_a_full_table_gets_the_first_reserved_special_token(targets):
    """Llama 3 fills its table: auto takes <|reserved_special_token_0|> (128002 in Llama 3.1), the
    next reserved one when the data holds it, and refuses, naming the option, when none is left."""
    tok, vocab = load(targets["llama3"])
    assert tok.mask_token is None and len(tok) == vocab
    reserved = [tok.convert_tokens_to_ids(f"<|reserved_special_token_{i}|>") for i in range(3)]
    choice = choose_mask_token(tok, vocab, "auto")
    assert (choice.id, choice.token, choice.rule) == (reserved[0], "<|reserved_special_token_0|>", "unused_special")
    assert "reserved" in choice.reason and str(vocab) in choice.reason
    assert mask_token_id(tok, vocab, None, [1, 2, reserved[0]]) == reserved[1]  # the data holds the first
    every = [i for i, _ in unused_special_tokens(tok, vocab, set())]
    assert reserved[0] in every and tok.convert_tokens_to_ids("<|eot_id|>") not in every  # the template writes it
    assert tok.bos_token_id not in every and all(tok.added_tokens_decoder[i].special for i in every)
    with pytest.raises(UserError, match="no mask token.*every added special token is used.*--mask-token-id"):
        mask_token_id(tok, vocab, None, every)


@pytest.mark.slow  # the real model's conversion
def test_smollm2_gets_an_added_special_token_its_data_and_template_never_use(smollm2):
    """The real SmolLM2: 49,152 tokens fill its table, 17 special tokens, none a mask; auto takes
    <empty_output> (16), or the one before it when a data row holds that token's text."""
    tok, vocab = load(smollm2)
    assert len(tok) == vocab == 49152 and tok.mask_token is None
    choice = choose_mask_token(tok, vocab, "auto", data_ids=[1, 2, 9690])
    assert (choice.id, choice.token, choice.rule) == (16, "<empty_output>", "unused_special")
    row = [{"role": "user", "content": "What does <empty_output> mean in a notebook?"},
           {"role": "assistant", "content": "x"}]  # fmt: skip
    ids = tok(tok.apply_chat_template(row, tokenize=False), add_special_tokens=False)["input_ids"]
    assert 16 in ids  # text holding a special token's literal encodes to its id: the data check is needed
    assert choose_mask_token(tok, vocab, "auto", data_ids=ids).token == "<jupyter_script>"
    with pytest.raises(UserError, match="--mask-token-id 16 .*occurs in the data"):
        choose_mask_token(tok, vocab, 16, data_ids=ids)


def test_auto_is_the_default_and_a_setting_word(tmp_path):
    assert ExtractConfig(target="t", data="d", out=tmp_path).mask_token_id == "auto"
    flags = {"target": "t", "data": "d", "out": str(tmp_path)}
    assert resolve(ExtractConfig, flags={**flags, "mask_token_id": "auto"}).mask_token_id == "auto"
    assert resolve(ExtractConfig, flags={**flags, "mask_token_id": "16"}).mask_token_id == 16
    assert resolve(ExtractConfig, flags=flags, sets=["mask_token_id=null"]).mask_token_id is None  # old configs
    with pytest.raises(SettingsError, match="--mask-token-id 'x': expected an integer or auto"):
        resolve(ExtractConfig, flags={**flags, "mask_token_id": "x"})


def test_caches_from_before_the_record_still_read_and_resume(tmp_path, tiny_cache):
    """cache.json without tokenizer.mask_token (written before it existed) reads, and a rerun of
    its extract is not refused: the record explains the id, which is what is compared."""
    old = json.loads((tiny_cache / "cache.json").read_text())
    assert old["tokenizer"]["mask_token"]["rule"] == "tokenizer"  # data/tiny-target has <|mask|>
    del old["tokenizer"]["mask_token"]
    assert CacheSpec.from_dict(old).tokenizer.mask_token == {}
    out = tmp_path / "cache"
    out.mkdir()
    (out / "cache.json").write_text(json.dumps(old))
    prepare(extract_config(out), write=False)  # the same settings: no differences
    changed = {**old, "tokenizer": {**old["tokenizer"], "mask_token_id": 7}}
    (out / "cache.json").write_text(json.dumps(changed))
    with pytest.raises(UserError, match="tokenizer.mask_token_id"):
        prepare(extract_config(out), write=False)


def test_data_token_ids_are_the_distinct_ids_of_the_rows(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 3, 3], [], [9, 5, 0]]})
    assert data_token_ids(ds, 10).tolist() == [0, 3, 5, 9]
    assert data_token_ids(ds, 6).tolist() == [0, 3, 5]  # ids past the table are not rows of it


@pytest.mark.parametrize(
    "pick, ok, why",
    [
        (lambda tok, vocab: len(tok), True, ""),
        (lambda tok, vocab: vocab - 1, True, ""),
        (lambda tok, vocab: tok.convert_tokens_to_ids("<|endoftext|>"), True, ""),  # an added special token
        (lambda tok, vocab: vocab, False, "outside the target's embedding table"),
        (lambda tok, vocab: -1, False, "outside the target's embedding table"),
        (lambda tok, vocab: tok.convert_tokens_to_ids("<think>"), False, "regular token"),  # plain added token
        (lambda tok, vocab: tok("Bram", add_special_tokens=False)["input_ids"][0], False, "regular token"),
        (lambda tok, vocab: tok.convert_tokens_to_ids("<|im_end|>"), False, "occurs in the data"),
    ],
    ids=["len-tokenizer", "last-row", "added-special", "past-table", "negative", "think", "word", "in-data"],
)
def test_override_is_checked(targets, pick, ok, why):
    tok, vocab = load(targets["qwen3"])
    chosen = pick(tok, vocab)
    if ok:
        assert mask_token_id(tok, vocab, chosen) == chosen == choose_mask_token(tok, vocab, chosen).id
        assert chosen >= len(tok) or chosen in tok.all_special_ids or tok.added_tokens_decoder[chosen].special
        return
    data_ids = tok(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False))["input_ids"]
    if 0 <= chosen < len(tok) and why == "regular token":
        assert text_produces(tok, chosen)  # the case is what it claims: text does encode to it
    with pytest.raises(UserError, match=f"--mask-token-id {chosen}.*{why}"):
        mask_token_id(tok, vocab, chosen, data_ids)


def test_override_rescues_a_full_table(targets):
    tok, vocab = load(targets["llama3"])
    reserved = tok.convert_tokens_to_ids("<|reserved_special_token_2|>")
    assert mask_token_id(tok, vocab, reserved) == reserved


@pytest.mark.parametrize("family, rule", [("qwen3", "spare_row"), ("llama3", "unused_special")])
def test_mask_id_reaches_cache_blocks_and_export(tmp_path, targets, monkeypatch, family, rule):
    """extract -> train -> export with a Qwen3-style target (a spare row) and a Llama-3-style one
    (a full table): one id all the way through, recorded in cache.json with its rule."""
    target = targets[family]
    tok, vocab = load(target)
    want = len(tok) if family == "qwen3" else tok.convert_tokens_to_ids("<|reserved_special_token_0|>")
    data = tmp_path / "rows.jsonl"
    data.write_text(jsonl_head(CHAT, 40))
    cache = tmp_path / "cache"
    ex = run(extract_config(cache, target=str(target), data=str(data)))
    assert read_spec(cache).tokenizer.mask_token_id == want == ex["mask_token"]["id"]
    recorded = json.loads((cache / "cache.json").read_text())["tokenizer"]
    assert recorded["mask_token_id"] == want and recorded["mask_token"]["rule"] == rule

    blocks = []
    real = dflash_family.make_blocks

    def spy(*args, **kwargs):
        b = real(*args, **kwargs)
        blocks.append(b)
        return b

    monkeypatch.setattr(dflash_family, "make_blocks", spy)  # forward_blocks builds every batch's blocks
    cfg = train_mod.TrainConfig(cache=cache, out=tmp_path / "run", epochs=1, max_steps=2, token_budget=1024,
                                max_anchors=8, draft_layers=1, log_every=1)  # fmt: skip
    summary = train_mod.run(cfg)
    assert len(blocks) == 2
    for b in blocks:
        assert b.input_ids.shape[0] > 0
        assert (b.input_ids[:, 1:] == want).all()  # every slot after the anchor holds the mask id
        assert not (b.labels[:, 1:] == want).any()  # and no real token is that id
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert summary["export"] == str(tmp_path / "run" / "export")
    assert exported["dflash_config"]["mask_token_id"] == want < exported["vocab_size"] == vocab
