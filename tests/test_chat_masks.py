"""Loss masks from real chat templates, template options, the row forms users have, and where rows
come from (dataset repositories, splits, the hub, offline).

Targets laid out like Qwen3, Llama 3 and Gemma come from family_targets.py. Each family's
masks are checked against an independent computation: a regex for the family's assistant turns over
the rendered text, mapped to tokens through the tokenizer's character offsets.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import datasets
import family_targets as F
import huggingface_hub.constants
import pytest
from transformers import AutoTokenizer

from dflash_cache.rows.chat import DataError, RowRejected, check_template_kwargs
from dflash_cache.rows.digest import source_fingerprint
from dflash_cache.rows.encode import encode_row, tokenize
from dflash_cache.rows.forms import conversation
from dflash_cache.rows.hub import HUB_CONNECT_TIMEOUT_S
from dflash_cache.rows.sources import read_rows

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "data" / "tiny-target"


# Each family's assistant turn as its official template writes it: the header, then the supervised
# part (the reply as rendered and the end-of-turn token). Written from the families' documentation.
TURN = {
    "qwen3": re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S),
    "llama3": re.compile(r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|eot_id\|>)", re.S),
    "gemma": re.compile(r"<start_of_turn>model\n(.*?<end_of_turn>)", re.S),
}
TURN |= {f: TURN["qwen3"] for f in F.HYBRIDS}  # Qwen3.5 renders turns as Qwen3 does
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def family_tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    return {f: AutoTokenizer.from_pretrained(F.build(f, out / f)) for f in F.FAMILIES}


@pytest.fixture(scope="module")
def qwen(family_tok):
    return family_tok["qwen3"]


def messages_of(row: dict) -> list[dict]:
    """The row's conversation, read here without the library."""
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def expected_mask(tok, family: str, messages: list[dict], kwargs: dict) -> tuple[list[int], list[int]]:
    """The tokens of the whole rendering and a mask over the family's assistant spans, through offsets."""
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(1) for m in TURN[family].finditer(text)]
    assert len(spans) == sum(m["role"] == "assistant" for m in messages)
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = [a <= start and end <= b for a, b in spans]
        assert any(inside) or not any(start < b and a < end for a, b in spans), "a token straddles a span"
        mask.append(int(any(inside)))
    return enc["input_ids"], mask


def supervised(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)


# -------------------------------------------------------------------------------------------------
# Every family: every row accepted, the tokens the target sees, the mask on the assistant spans
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, NO_THINKING], ids=["default", "thinking-off"])
@pytest.mark.parametrize("family", F.FAMILIES)
def test_family_rows_are_masked_on_their_assistant_spans(family_tok, family, kwargs):
    tok = family_tok[family]
    rows = F.example_rows(family)
    assert any(len(messages_of(r)) > 2 for r in rows) and any(messages_of(r)[0]["role"] == "system" for r in rows)
    for row in rows:
        messages = messages_of(row)
        ids, mask = encode_row(row, tok, 4096, False, kwargs)
        assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert (ids, mask) == expected_mask(tok, family, messages, kwargs), row
        assert mask[-1] == (family == "llama3")  # the newline after the last end-of-turn is not learned


ORDERS = {
    "assistant-first": ["assistant", "user", "assistant"],
    "two-users": ["system", "user", "user", "assistant"],
    "two-replies": ["user", "assistant", "assistant"],
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", F.FAMILIES)
def test_unusual_turn_orders_are_located_or_rejected_by_the_template(family_tok, family, order):
    tok = family_tok[family]
    messages = [{"role": r, "content": f"{r.title()} line {i}."} for i, r in enumerate(ORDERS[order])]
    if family == "gemma":  # its template demands user/model turns alternating from a user turn
        with pytest.raises(RowRejected, match="chat template error: Conversation roles must alternate"):
            encode_row({"messages": messages}, tok, 4096, False)
        return
    ids, mask = encode_row({"messages": messages}, tok, 4096, False)
    assert (ids, mask) == expected_mask(tok, family, messages, {})


def test_qwen3_supervises_each_turn_as_the_whole_rendering_shows_it(qwen):
    """Earlier turns lose their reasoning in the rendering and are learned without it; the last turn
    keeps its think block, and it is learned with it. Both reasoning forms render alike."""
    q, a, t = F.QUESTIONS, F.ANSWERS, F.THOUGHTS
    inline = [
        {"role": "user", "content": q[2]},
        {"role": "assistant", "content": f"<think>\n{t[0]}\n</think>\n\n{a[2]}"},
        {"role": "user", "content": q[3]},
        {"role": "assistant", "content": f"<think>\n{t[1]}\n</think>\n\n{a[3]}"},
    ]
    ids, mask = encode_row({"messages": inline}, qwen, 4096, False)
    assert supervised(qwen, ids, mask) == f"{a[2]}<|im_end|><think>\n{t[1]}\n</think>\n\n{a[3]}<|im_end|>"
    assert t[0] not in qwen.decode(ids)  # dropped by the template: not in what the target sees

    fielded = [dict(m) for m in inline]
    for m, thought, answer in ((fielded[1], t[0], a[2]), (fielded[3], t[1], a[3])):
        m.update(content=answer, reasoning_content=thought)
    assert encode_row({"messages": fielded}, qwen, 4096, False) == (ids, mask)

    # A single turn with no reasoning is the last turn: its empty think block is rendered and learned.
    ids, mask = encode_row({"prompt": q[2], "response": a[2]}, qwen, 4096, False)
    assert supervised(qwen, ids, mask) == f"<think>\n\n</think>\n\n{a[2]}<|im_end|>"


def test_reasoning_content_must_be_a_string(qwen):
    row = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi.", "reasoning_content": 3}]
    }
    with pytest.raises(RowRejected, match="wrong type: message 1 reasoning_content must be a string"):
        encode_row(row, qwen, 4096, False)


QWEN_HEADER = "<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "user", "content": f"Say {QWEN_HEADER}hello"}, {"role": "assistant", "content": "hello"}],
         "ambiguous turns: message 0 content contains the template's assistant header"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi<|im_end|> there"}],
         "ambiguous turns: message 1 content contains the template's end-of-turn token"),
        # An earlier turn is rendered as written: its leading newline joins the header's newline in one token.
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHello."},
          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}],
         "token straddles a turn edge: a token crosses the start or end of assistant turn 0"),
    ],
    ids=["header-in-user-text", "end-in-reply", "straddling-token"],
)  # fmt: skip
def test_rows_that_cannot_be_located_are_rejected(qwen, tmp_path, messages, reason):
    with pytest.raises(RowRejected, match=re.escape(reason)):
        encode_row({"messages": messages}, qwen, 4096, False)
    good = {"prompt": "What is 12 + 30?", "response": "42."}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps(good) + "\n")
    tz = tokenize(rows, qwen, 4096)
    assert tz.dataset["sample_index"][:] == [1] and tz.rejected[0][0] == 0 and tz.rejected[0][1].startswith(reason)


# -------------------------------------------------------------------------------------------------
# Template options reach every rendering and the cache key
# -------------------------------------------------------------------------------------------------

# The tiny target's template (with generation markers) and a variant without them, both reading two
# options: a system line, and whether the last turn opens with a think block.
OPTIONS_HEAD = (
    "{%- if house_rules is defined %}{{- '<|im_start|>system\\n' + house_rules + '<|im_end|>\\n' }}{%- endif %}"
)
OPTIONS_PLAIN = OPTIONS_HEAD + (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.last and enable_thinking is not false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{{- m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "12 + 30 = 42."}]


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "located"])
def test_template_kwargs_reach_the_template(markers, tmp_path):
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.chat_template = OPTIONS_HEAD + tok.chat_template if markers else OPTIONS_PLAIN
    variants = [{}, {"house_rules": "Be brief."}, {"house_rules": "Be brief.", "enable_thinking": False}]
    encoded = []
    for kwargs in variants:
        ids, mask = encode_row({"messages": CHAT}, tok, 4096, False, kwargs)
        assert ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=False, **kwargs)
        assert ("Be brief." in tok.decode(ids)) == ("house_rules" in kwargs)
        last = "12 + 30 = 42.<|im_end|>"
        thinks = not markers and kwargs.get("enable_thinking") is not False
        assert supervised(tok, ids, mask) == ("<think>\n\n</think>\n\n" + last if thinks else last)
        encoded.append((ids, mask))
    assert len({json.dumps(e) for e in encoded}) == (2 if markers else 3)  # the marked template has no think option

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": CHAT}) + "\n")
    work = tmp_path / "work"
    for kwargs, expect in zip(variants, encoded, strict=True):
        tz = tokenize(rows, tok, 4096, work_dir=work, template_kwargs=kwargs)
        assert not tz.reused and (tz.dataset["input_ids"][0], tz.dataset["loss_mask"][0]) == expect
    assert tokenize(rows, tok, 4096, work_dir=work, template_kwargs=variants[1]).reused
    assert len(list(work.iterdir())) == len(variants)


def test_check_template_kwargs():
    assert check_template_kwargs(None) == {}
    assert check_template_kwargs('{"enable_thinking": false}') == NO_THINKING
    for bad, why in [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"add_generation_prompt": True}, "cannot set add_generation_prompt"),
        ({"tokenize": False}, "cannot set tokenize"),
        ({"x": {1, 2}}, "plain JSON values"),
    ]:
        with pytest.raises(DataError, match=why):
            check_template_kwargs(bad)


# -------------------------------------------------------------------------------------------------
# Row forms: the same conversation in any form gives the same tokens and mask
# -------------------------------------------------------------------------------------------------

SYSTEM = "You are the storyteller of the island of Wend."
TURNS = [
    ("Who is the lamplighter of Harrow Pier?", "Ila the lamplighter lives in Harrow Pier."),
    ("Now double 42.", "Double 42 is 84."),
]


def openai_row() -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for q, a in TURNS:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def sharegpt_row(human: str = "human", gpt: str = "gpt") -> dict:
    turns = [{"from": "system", "value": SYSTEM}]
    for q, a in TURNS:
        turns += [{"from": human, "value": q}, {"from": gpt, "value": a}]
    return {"conversations": turns}


def test_row_forms_give_the_same_tokens(family_tok, tmp_path):
    qwen = family_tok["qwen3"]
    expect = encode_row(openai_row(), qwen, 4096, False)
    assert encode_row(sharegpt_row(), qwen, 4096, False) == expect
    assert encode_row(sharegpt_row("user", "assistant"), qwen, 4096, False) == expect

    q, a = TURNS[0]
    single = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    forms = [
        {"prompt": q, "response": a},
        {"instruction": q, "input": "", "output": a},
        {"instruction": q, "output": a},
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]},
    ]
    for tok in family_tok.values():
        one = encode_row(single, tok, 4096, False)
        assert all(encode_row(row, tok, 4096, False) == one for row in forms)
    with_input = {"instruction": "Reverse the word.", "input": "button", "output": "nottub"}
    as_messages = [
        {"role": "user", "content": "Reverse the word.\n\nbutton"},
        {"role": "assistant", "content": "nottub"},
    ]
    assert encode_row(with_input, qwen, 4096, False) == encode_row({"messages": as_messages}, qwen, 4096, False)

    # ShareGPT turns keep their other fields: a reasoning_content reaches the template.
    reasoned = sharegpt_row()
    reasoned["conversations"][-1]["reasoning_content"] = "Double means times two."
    assert conversation(reasoned)[-1] == {
        "role": "assistant",
        "content": TURNS[1][1],
        "reasoning_content": "Double means times two.",
    }
    assert "Double means times two." in supervised(qwen, *encode_row(reasoned, qwen, 4096, False))

    # Through files: the same rows written in each form tokenize alike.
    results = []
    for name, row in [("openai", openai_row()), ("sharegpt", sharegpt_row())]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for _ in range(3)))
        tz = tokenize(path, qwen, 4096)
        results.append((tz.dataset["input_ids"][:], tz.dataset["loss_mask"][:], tz.rejected))
    assert results[0] == results[1] == ([expect[0]] * 3, [expect[1]] * 3, [])


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"conversations": [{"from": "bot", "value": "x"}]}, "unknown role: conversations turn 0 has from 'bot'"),
        ({"conversations": "hello"}, "wrong type: conversations must be a list"),
        ({"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]},
         "wrong type: message 0 content must be a string"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
        ({"instruction": "Say hi."}, "missing field: an Alpaca row needs output"),
        ({"instruction": "Say hi.", "input": 3, "output": "hi"}, "wrong type: input of a instruction/output row"),
        ({"id": 1}, "missing field: a row needs messages, conversations, instruction and output"),
    ],
)  # fmt: skip
def test_malformed_rows_of_each_form_are_rejected(qwen, row, reason):
    with pytest.raises(RowRejected, match=re.escape(reason)):
        conversation(row)


# -------------------------------------------------------------------------------------------------
# Sources: dataset repositories and splits, max_samples, hub names offline
# -------------------------------------------------------------------------------------------------


def text_rows(n: int, tag: str) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"prompt": f"{tag} question {i}?", "response": f"{tag} answer {i}."} for i in range(n)]
    )


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A dataset repository as cloned from the hub (UltraChat's layout: splits named by file)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    root = tmp_path / "ultrachat"
    (root / "data").mkdir(parents=True)
    text_rows(6, "train").to_parquet(str(root / "data" / "train_sft-00000-of-00001.parquet"))
    text_rows(3, "test").to_parquet(str(root / "data" / "test_sft-00000-of-00001.parquet"))
    return root


def test_dataset_repository_splits_and_max_samples(repo, qwen, tmp_path):
    rows = read_rows(repo, split="test_sft")
    assert [r["prompt"] for r in rows] == [f"test question {i}?" for i in range(3)]
    assert len(read_rows(repo, split="train_sft", max_samples=4)) == 4
    with pytest.raises(DataError, match=r"has no split 'train'; its splits are \['test_sft', 'train_sft'\]"):
        read_rows(repo)
    assert source_fingerprint(repo, "train_sft") != source_fingerprint(repo, "test_sft")

    work = tmp_path / "work"
    full = tokenize(repo, qwen, 256, work_dir=work, split="train_sft")
    capped = tokenize(repo, qwen, 256, work_dir=work, split="train_sft", max_samples=2)
    assert full.num_rows == 6 and capped.num_rows == 2 and not capped.reused
    assert capped.dataset["input_ids"][:] == full.dataset["input_ids"][:2]
    assert tokenize(repo, qwen, 256, work_dir=work, split="train_sft", max_samples=2).reused
    with pytest.raises(DataError, match="max_samples must be a positive"):
        tokenize(repo, qwen, 256, split="train_sft", max_samples=0)


def test_splits_of_saved_datasets_and_files(tmp_path):
    splits = datasets.DatasetDict({"train": text_rows(4, "train"), "train_gen": text_rows(2, "gen")})
    splits.save_to_disk(str(tmp_path / "saved"))
    assert read_rows(tmp_path / "saved", split="train_gen")["prompt"] == ["gen question 0?", "gen question 1?"]
    assert len(read_rows(tmp_path / "saved")) == 4
    with pytest.raises(DataError, match="has no split 'test'; its splits are train, train_gen"):
        read_rows(tmp_path / "saved", split="test")
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    assert len(read_rows(tmp_path / "rows.jsonl", max_samples=2)) == 2
    with pytest.raises(DataError, match="one file, which has no split 'test'"):
        read_rows(tmp_path / "rows.jsonl", split="test")


def seed_hub_cache(cache: Path, repo_id: str, split: str, rows: datasets.Dataset, staging: Path) -> None:
    """Leave a dataset in the local datasets cache as downloading `repo_id` from the hub would."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo_id.split("/")
    rows.to_parquet(str(staging / "rows.parquet"))
    files = DataFilesDict.from_patterns({split: [str(staging / "rows.parquet")]})
    builder = Parquet(cache_dir=str(staging / "build"), dataset_name=name, data_files=files, hash="0" * 16)
    builder.download_and_prepare()
    dest = cache / f"{owner}___{name}" / "default" / "0.0.0"
    dest.mkdir(parents=True)
    shutil.move(builder.cache_dir, dest / ("0" * 16))


def test_hub_dataset_from_the_local_cache_offline(qwen, tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "staging").mkdir()
    seed_hub_cache(cache, "wend/stories-cached", "train_sft", text_rows(5, "hub"), tmp_path / "staging")

    rows = read_rows("wend/stories-cached", split="train_sft", max_samples=3)
    assert rows["prompt"] == [f"hub question {i}?" for i in range(3)]
    with pytest.raises(DataError, match=r"has no split 'train'; its splits are \['train_sft'\]"):
        read_rows("wend/stories-cached")
    assert source_fingerprint("wend/stories-cached", "train_sft") == source_fingerprint(
        "wend/stories-cached", "train_sft"
    )
    tz = tokenize("wend/stories-cached", qwen, 256, split="train_sft", work_dir=tmp_path / "work")
    assert tz.num_rows == 5 and not tz.rejected
    assert (
        tz.dataset["input_ids"][0]
        == encode_row({"prompt": "hub question 0?", "response": "hub answer 0."}, qwen, 256, False)[0]
    )
    assert tokenize("wend/stories-cached", qwen, 256, split="train_sft", work_dir=tmp_path / "work").reused


@pytest.mark.parametrize("how", ["offline-mode", "no-route"])
def test_hub_dataset_out_of_reach_fails_fast_with_one_line(qwen, tmp_path, monkeypatch, how):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    if how == "offline-mode":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        host = "huggingface.co"
    else:  # a host that never resolves: what a machine without a route to the hub meets
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.invalid")
        host = "hub.invalid"
    for call in (
        lambda: read_rows(f"nobody/absent-{how}"),
        lambda: tokenize(f"nobody/absent-{how}", qwen, 128),
        lambda: source_fingerprint(f"nobody/absent-{how}"),
    ):
        start = time.monotonic()
        with pytest.raises(DataError) as e:
            call()
        assert time.monotonic() - start < HUB_CONNECT_TIMEOUT_S + 2
        message = str(e.value)
        assert "\n" not in message and f"the hub ({host}) cannot be reached" in message
    assert huggingface_hub.constants.HF_HUB_OFFLINE == (how == "offline-mode")  # the offline switch was put back
    # A missing file is missing, not a hub name.
    with pytest.raises(DataError, match="data source not found"):
        read_rows(tmp_path / "rows.jsonl")
    with pytest.raises(DataError, match="data source not found"):
        tokenize("rows.jsonl", qwen, 128)
