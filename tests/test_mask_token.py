"""The mask token of DFlash blocks for tokenizers that have none (Qwen3, Llama 3), checked against
the tokenizers themselves: the chosen id is one no text encodes to, inside the target's embedding
table, and it is the id the cache records, the training blocks hold and the export declares."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import CHAT, ROOT, TINY_TARGET, extract_config
from transformers import AutoConfig, AutoTokenizer

from dflash_cache.cache.spec import read_spec
from dflash_cache.errors import UserError
from dflash_cache.extract.stage import mask_token_id, run
from dflash_cache.train import objective
from dflash_cache.train import stage as train_mod

sys.path.insert(0, str(ROOT / "data"))
import make_family_targets as fam  # noqa: E402


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


def test_default_is_len_tokenizer_when_there_is_no_mask_token(targets):
    tok, vocab = load(targets["qwen3"])
    assert tok.mask_token is None and len(tok) < vocab  # laid out like Qwen3: 151,669 < 151,936
    got = mask_token_id(tok, vocab)
    assert got == len(tok)
    assert tok.convert_ids_to_tokens(got) is None  # past every token: no text encodes to it
    assert max(tok.get_vocab().values()) == got - 1


def test_the_tokenizers_own_mask_token_comes_first():
    tok, vocab = load(TINY_TARGET)
    assert mask_token_id(tok, vocab) == tok.convert_tokens_to_ids("<|mask|>") == 1535


def test_no_spare_row_is_refused_naming_the_option(targets):
    tok, vocab = load(targets["llama3"])
    assert tok.mask_token is None and len(tok) == vocab  # Llama 3 fills its table
    with pytest.raises(UserError, match="no mask token.*--mask-token-id"):
        mask_token_id(tok, vocab)


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
    ],
    ids=["len-tokenizer", "last-row", "added-special", "past-table", "negative", "think", "word"],
)
def test_override_is_checked(targets, pick, ok, why):
    tok, vocab = load(targets["qwen3"])
    chosen = pick(tok, vocab)
    if ok:
        assert mask_token_id(tok, vocab, chosen) == chosen
        assert chosen >= len(tok) or chosen in tok.all_special_ids or tok.added_tokens_decoder[chosen].special
        return
    if 0 <= chosen < len(tok):
        assert text_produces(tok, chosen)  # the case is what it claims: text does encode to it
    with pytest.raises(UserError, match=f"--mask-token-id {chosen}.*{why}"):
        mask_token_id(tok, vocab, chosen)


def test_override_rescues_a_full_table(targets):
    tok, vocab = load(targets["llama3"])
    reserved = tok.convert_tokens_to_ids("<|reserved_special_token_2|>")
    assert mask_token_id(tok, vocab, reserved) == reserved


def test_mask_id_reaches_cache_blocks_and_export(tmp_path, targets, monkeypatch):
    """extract -> train -> export with a Qwen3-style target: one id all the way through."""
    target = targets["qwen3"]
    tok, vocab = load(target)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:40]))
    cache = tmp_path / "cache"
    run(extract_config(cache, target=str(target), data=str(data)))
    assert read_spec(cache).tokenizer.mask_token_id == len(tok)
    assert json.loads((cache / "cache.json").read_text())["tokenizer"]["mask_token_id"] == len(tok)

    blocks = []
    real = objective.make_blocks

    def spy(*args, **kwargs):
        b = real(*args, **kwargs)
        blocks.append(b)
        return b

    monkeypatch.setattr(objective, "make_blocks", spy)  # forward_blocks builds every batch's blocks
    cfg = train_mod.TrainConfig(cache=cache, out=tmp_path / "run", epochs=1, max_steps=2, token_budget=1024,
                                max_anchors=8, draft_layers=1, log_every=1)  # fmt: skip
    summary = train_mod.run(cfg)
    assert len(blocks) == 2
    for b in blocks:
        assert b.input_ids.shape[0] > 0
        assert (b.input_ids[:, 1:] == len(tok)).all()  # every slot after the anchor holds the mask id
        assert not (b.labels[:, 1:] == len(tok)).any()  # and no real token is that id
    exported = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert summary["export"] == str(tmp_path / "run" / "export")
    assert exported["dflash_config"]["mask_token_id"] == len(tok) < exported["vocab_size"] == vocab
