"""Rows -> (input_ids, loss_mask): the mask lands on assistant tokens, bad rows are rejected with a
reason, every input format gives the same tokens, and tokenized data is reused from work_dir."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from dflash_cache.rows.chat import DataError, has_generation_markers
from dflash_cache.rows.digest import chat_template_digest, source_fingerprint, tokenizer_digest
from dflash_cache.rows.encode import Tokenized, encode_row, tokenize
from dflash_cache.rows.sources import read_rows

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = ROOT / "data" / "tiny-target"
CHAT = ROOT / "data" / "chat.jsonl"
EOT = "<|im_end|>"
MARKERS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def load_tok():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


@pytest.fixture(scope="module")
def tok():
    return load_tok()


@pytest.fixture(scope="module")
def chat_rows() -> list[dict]:
    with open(CHAT) as f:
        return [json.loads(line) for line in f]


def chatml(messages: list[dict]) -> str:
    """The tiny target's template, written out independently of Jinja."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of supervised tokens."""
    out, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in out]


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def tokens(tz: Tokenized) -> list[tuple]:
    d = tz.dataset
    return list(zip(d["sample_index"], d["input_ids"], d["loss_mask"], d["length"], strict=True))


# -------------------------------------------------------------------------------------------------
# The mask lands on the assistant's tokens
# -------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Answer in capital letters."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42."},
    {"role": "user", "content": "Now spell 'lantern' backwards."},
    {"role": "assistant", "content": "'LANTERN' BACKWARDS IS 'NRETNAL'."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome.\n\nSafe travels!"},
]


def test_chat_mask_is_exactly_the_assistant_replies(tok):
    ids, mask = encode_row({"messages": CONVERSATION}, tok, 4096, False)
    assert ids == tok(chatml(CONVERSATION), add_special_tokens=False)["input_ids"]
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert runs(tok, ids, mask) == [r + EOT for r in replies]
    # The newline pre-token ends the header, so each reply tokenizes as it does alone.
    assert sum(mask) == sum(len(tok(r + EOT, add_special_tokens=False)["input_ids"]) for r in replies)
    assert mask[-1] == 0  # the newline after the last <|im_end|> is formatting, not learned


def test_bundled_chat_masks(tok, chat_rows):
    for row in chat_rows[:100]:
        ids, mask = encode_row(row, tok, 4096, False)
        msgs = row["messages"]
        assert ids == tok(chatml(msgs), add_special_tokens=False)["input_ids"]
        assert runs(tok, ids, mask) == [m["content"] + EOT for m in msgs if m["role"] == "assistant"]


def test_prompt_response_and_text_rows(tok):
    ids, mask = encode_row({"prompt": "Count from 1 to 3.", "response": "1, 2, 3."}, tok, 4096, False)
    pair = [{"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "1, 2, 3."}]
    assert (ids, mask) == encode_row({"messages": pair}, tok, 4096, False)
    assert runs(tok, ids, mask) == ["1, 2, 3." + EOT]

    text = "Bram the ferryman lived in Brindle."
    ids, mask = encode_row({"text": text, "messages": None}, tok, 4096, False)
    assert ids == tok(text)["input_ids"] and tok.decode(ids) == text
    assert mask == [1] * len(ids)


def strip_markers(tokenizer):
    tokenizer.chat_template = MARKERS.sub("", tokenizer.chat_template)
    assert not has_generation_markers(tokenizer) and "endgeneration" not in tokenizer.chat_template
    return tokenizer


def test_located_turns_equal_marker_path(tok, chat_rows):
    plain = strip_markers(load_tok())
    for row in [{"messages": CONVERSATION}, *chat_rows]:
        assert encode_row(row, plain, 4096, False) == encode_row(row, tok, 4096, False)
    # An opening assistant turn is located like any other, in the one rendering of the row.
    opening = encode_row({"messages": CONVERSATION[2:]}, plain, 4096, False)
    assert opening == encode_row({"messages": CONVERSATION[2:]}, tok, 4096, False)
    assert runs(tok, *opening) == [m["content"] + EOT for m in CONVERSATION[2:] if m["role"] == "assistant"]


THINK_ON_PROMPT = (  # the generation prompt opens an empty think block that turns never hold
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
)
LAST_TURN_DIFFERS = (  # only the final assistant turn is rendered with a think block
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("template", [THINK_ON_PROMPT, LAST_TURN_DIFFERS], ids=["think-on-prompt", "last-turn"])
def test_template_that_is_not_prefix_stable_supervises_turns_as_rendered(template, tmp_path):
    """Rendering up to an assistant turn differs from the whole row here: each turn is supervised
    as the whole rendering shows it, and the row's tokens are the whole rendering's."""
    t = load_tok()
    t.chat_template = template
    ids, mask = encode_row({"messages": CONVERSATION}, t, 4096, False)
    assert ids == t.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    replies = [m["content"] + EOT for m in CONVERSATION if m["role"] == "assistant"]
    if template is LAST_TURN_DIFFERS:
        replies[-1] = "<think>\n\n</think>\n\n" + replies[-1]
    assert runs(t, ids, mask) == replies
    tz = tokenize(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 3), t, 4096)
    assert not tz.rejected and tz.dataset["input_ids"][:] == [ids] * 3 and tz.dataset["loss_mask"][:] == [mask] * 3


NO_ASSISTANT_HEADER = (  # Mistral-like: the reply follows the user turn with nothing a probe can see
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
)


def test_template_whose_turns_cannot_be_located_is_a_data_error(tmp_path):
    t = load_tok()
    t.chat_template = NO_ASSISTANT_HEADER
    with pytest.raises(
        DataError, match="cannot locate assistant turns .* generation prompt adds no assistant header"
    ):
        encode_row({"messages": CONVERSATION[1:]}, t, 4096, False)
    with pytest.raises(DataError, match="cannot locate assistant turns"):
        tokenize(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION[1:]}]), t, 4096)
    text_only = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain words"}])  # text rows need no template
    assert tokenize(text_only, t, 128).num_rows == 1


MARKS_USER_TURNS = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'user' %}{% generation %}{{- m['content'] }}{% endgeneration %}"
    "{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
)
MARKS_LAST_TURN_ONLY = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.last %}{% generation %}{{- m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{%- else %}{{- m['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
)


@pytest.mark.parametrize("template", [MARKS_USER_TURNS, MARKS_LAST_TURN_ONLY], ids=["user-turns", "last-turn-only"])
def test_markers_that_miss_the_replies_are_a_data_error(template, tmp_path):
    t = load_tok()
    t.chat_template = template
    with pytest.raises(DataError, match="generation %} markers"):
        tokenize(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}]), t, 4096)
    with pytest.raises(DataError, match="cannot be trusted"):
        encode_row({"messages": CONVERSATION}, t, 4096, False)


# -------------------------------------------------------------------------------------------------
# Bad rows are rejected with a reason; good rows keep their source row number
# -------------------------------------------------------------------------------------------------

GOOD_CHAT = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}
LONG_REPLY = " ".join(["lantern"] * 80)
BAD_CORPUS: list[tuple[bytes, str | None]] = [  # (line, expected rejection category or None)
    (json.dumps(GOOD_CHAT).encode(), None),  # row 0
    (b'{"messages": [{"role": "user", "content": "unfinished', "invalid JSON"),
    (b'{"text": "caf\xe9 au lait"}', "invalid UTF-8"),
    (b"", None),  # blank lines are not rows
    (json.dumps({"messages": "hello"}).encode(), "wrong type"),
    (
        json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}).encode(),
        "wrong type",
    ),
    (json.dumps({"prompt": "hi", "response": ["a"]}).encode(), "wrong type"),
    (json.dumps({"id": 7}).encode(), "missing field"),
    (
        json.dumps({"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}).encode(),
        "missing field",
    ),
    (json.dumps({"prompt": "a prompt and no response"}).encode(), "missing field"),
    (
        json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}).encode(),
        "unknown role",
    ),
    (json.dumps({"messages": []}).encode(), "empty conversation"),  # row 10
    (json.dumps({"messages": [{"role": "user", "content": "anyone there?"}]}).encode(), "no assistant turn"),
    (json.dumps([1, 2, 3]).encode(), "not a JSON object"),
    (json.dumps({"text": ""}).encode(), "empty text"),
    (json.dumps({"prompt": "Say lantern many times.", "response": LONG_REPLY}).encode(), "too long"),  # row 14
    (json.dumps({"prompt": LONG_REPLY, "response": "No."}).encode(), "too long"),  # row 15
    (json.dumps({"prompt": "Spell 'ferry' backwards.", "response": "'ferry' backwards is 'yrref'."}).encode(), None),
    (json.dumps({"text": "Oona is the baker of Mossfield."}).encode(), None),  # row 17
]
MAX_LEN = 64


@pytest.fixture
def bad_corpus(tmp_path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in BAD_CORPUS) + b"\n")
    return path


def expected_rows() -> list[tuple[int, str | None]]:
    rows = [expect for line, expect in BAD_CORPUS if line]
    return list(enumerate(rows))


def test_bad_rows_rejected_with_reasons(tok, bad_corpus):
    tz = tokenize(bad_corpus, tok, MAX_LEN)
    exp = expected_rows()
    assert tz.num_rows == len(exp) == 18
    assert tz.dataset["sample_index"][:] == [i for i, e in exp if e is None] == [0, 16, 17]
    assert [i for i, _ in tz.rejected] == [i for i, e in exp if e is not None]
    for (i, reason), (j, category) in zip(tz.rejected, [x for x in exp if x[1] is not None], strict=True):
        assert i == j and reason.startswith(category + ":"), (i, reason)
    reasons = dict(tz.rejected)
    assert "(line 2)" in reasons[1] and "(line 3)" in reasons[2]
    assert reasons[14].startswith(f"too long: {len(encode_row(json.loads(BAD_CORPUS[15][0]), tok, 10**6, False)[0])}")
    # Each accepted row is what encode_row makes of its source line.
    good = [json.loads(line) for line, e in BAD_CORPUS if line and e is None]
    for row, ids, mask, length in zip(
        good, tz.dataset["input_ids"], tz.dataset["loss_mask"], tz.dataset["length"], strict=True
    ):
        assert (ids, mask) == encode_row(row, tok, MAX_LEN, False) and length == len(ids)


def test_truncate_keeps_long_rows_that_still_have_a_supervised_token(tok, bad_corpus):
    tz = tokenize(bad_corpus, tok, MAX_LEN, truncate=True)
    assert tz.dataset["sample_index"][:] == [0, 14, 16, 17]
    row = tz.dataset[1]
    full_ids, full_mask = encode_row(json.loads(BAD_CORPUS[15][0]), tok, 10**6, False)
    assert len(full_ids) > MAX_LEN
    assert row["length"] == MAX_LEN
    assert row["input_ids"] == full_ids[:MAX_LEN] and row["loss_mask"] == full_mask[:MAX_LEN]
    assert any(row["loss_mask"])
    # The long prompt leaves no reply token within max_length: rejected even when truncating.
    assert dict(tz.rejected)[15].startswith("no supervised token:")


def test_every_row_rejected_is_a_data_error(tok, tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"messages": []}, {"messages": []}, {"nothing": 1}])
    with pytest.raises(DataError, match=r"every row .* \(3 rows\): 2 x empty conversation.*1 x missing field"):
        tokenize(path, tok, 128)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        tokenize(tmp_path / "empty.jsonl", tok, 128)


def test_input_errors(tok, tmp_path):
    with pytest.raises(DataError, match="not found"):
        tokenize(tmp_path / "missing.jsonl", tok, 128)
    with pytest.raises(DataError, match="not found"):
        read_rows(tmp_path / "missing.parquet")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported"):
        read_rows(tmp_path / "rows.csv")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match="save_to_disk"):
        read_rows(tmp_path / "plain_dir")
    (tmp_path / "broken.json").write_text('[{"text": "a"} {"text": "b"}]')  # no comma: invalid, not cut short
    with pytest.raises(DataError, match=r"not valid JSON \(Expecting ',' or ']' at byte 15"):
        read_rows(tmp_path / "broken.json")


def test_chat_rows_need_a_chat_template(tmp_path):
    t = load_tok()
    t.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [GOOD_CHAT, {"text": "plain"}])
    with pytest.raises(DataError, match="no chat template"):
        tokenize(path, t, 128)
    with pytest.raises(DataError, match="no chat template"):
        tokenize(path, t, 128, num_proc=2)  # raised in a worker, still a DataError
    text_only = write_jsonl(tmp_path / "t.jsonl", [{"text": "plain words"}])
    assert tokenize(text_only, t, 128).dataset["input_ids"][0] == t("plain words")["input_ids"]


# -------------------------------------------------------------------------------------------------
# Every input format gives the same tokens
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_rows(chat_rows) -> list[dict]:
    """Chat rows with a system prompt, prompt/response rows and text rows, one schema-compatible list."""
    rows = [dict(r) for r in chat_rows[:40]]
    rows += [{"prompt": f"What is {i} + {i}?", "response": f"{i} + {i} = {2 * i}."} for i in range(5)]
    rows += [{"text": f"The bell of Tallow Hill rang {i} times."} for i in range(5)]
    return rows


def test_formats_give_the_same_tokens(tok, mixed_rows, tmp_path):
    ref = tokenize(write_jsonl(tmp_path / "rows.jsonl", mixed_rows), tok, 512)
    assert ref.num_rows == len(mixed_rows) and not ref.rejected
    expect = tokens(ref)
    assert [i for i, *_ in expect] == list(range(len(mixed_rows)))

    (tmp_path / "rows.json").write_text(json.dumps(mixed_rows, indent=1))
    keys = ("messages", "prompt", "response", "text")  # one schema: absent fields become nulls
    ds = datasets.Dataset.from_list([{k: r.get(k) for k in keys} for r in mixed_rows])
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "saved_dict"))
    datasets.DatasetDict({"only": ds}).save_to_disk(str(tmp_path / "saved_one"))
    for name in ["rows.json", "rows.parquet", "saved", "saved_dict", "saved_one"]:
        assert tokens(tokenize(tmp_path / name, tok, 512)) == expect, name
    for name in ["rows.jsonl", "rows.parquet"]:  # read through Arrow files in work_dir
        assert tokens(tokenize(tmp_path / name, tok, 512, work_dir=tmp_path / "work")) == expect, name
    # Reading a saved dataset (and mapping over it) writes nothing into the source directory.
    before = sorted(p.name for p in (tmp_path / "saved").iterdir())
    tokenize(tmp_path / "saved", tok, 512, work_dir=tmp_path / "work")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == before
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "saved_two"))
    with pytest.raises(DataError, match="train"):
        read_rows(tmp_path / "saved_two")


def test_num_proc_gives_the_same_result(tok, bad_corpus, tmp_path):
    one = tokenize(bad_corpus, tok, MAX_LEN)
    two = tokenize(bad_corpus, tok, MAX_LEN, num_proc=2, work_dir=tmp_path / "work")
    assert tokens(one) == tokens(two) and one.rejected == two.rejected and one.num_rows == two.num_rows


# -------------------------------------------------------------------------------------------------
# Tokenize once: the work_dir copy is reused, keyed by everything that decides the tokens
# -------------------------------------------------------------------------------------------------


def snapshot(work: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(work)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(work.rglob("*"))}


def test_work_dir_is_reused(tok, bad_corpus, tmp_path, monkeypatch):
    work = tmp_path / "work"
    first = tokenize(bad_corpus, tok, MAX_LEN, work_dir=work)
    assert not first.reused
    saved = [p for p in work.iterdir()]
    assert len(saved) == 1 and saved[0].name.startswith("tokenized-")  # no scratch left behind
    before = snapshot(work)

    def no_encoding(*args, **kwargs):
        raise AssertionError("re-tokenized instead of reusing the work_dir copy")

    monkeypatch.setattr("dflash_cache.rows.encode.encode_row", no_encoding)
    again = tokenize(bad_corpus, tok, MAX_LEN, work_dir=work)
    assert again.reused
    assert tokens(again) == tokens(first) and again.rejected == first.rejected and again.num_rows == first.num_rows
    assert snapshot(work) == before
    monkeypatch.undo()

    # Another max_length, truncation, template or source content is another key.
    tokenize(bad_corpus, tok, MAX_LEN, truncate=True, work_dir=work)
    t = strip_markers(load_tok())
    tokenize(bad_corpus, t, MAX_LEN, work_dir=work)
    with open(bad_corpus, "ab") as f:
        f.write(json.dumps({"text": "one more row"}).encode() + b"\n")
    grown = tokenize(bad_corpus, tok, MAX_LEN, work_dir=work)
    assert not grown.reused and grown.num_rows == first.num_rows + 1
    assert len(list(work.iterdir())) == 4


# -------------------------------------------------------------------------------------------------
# Digests
# -------------------------------------------------------------------------------------------------


def test_digests(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tokenizer_digest(reloaded) == tokenizer_digest(tok)
    assert chat_template_digest(reloaded) == chat_template_digest(tok) is not None
    tok("padded", padding="max_length", max_length=16, truncation=True)  # per-call state
    assert tokenizer_digest(tok) == tokenizer_digest(reloaded)
    changed = strip_markers(load_tok())
    assert chat_template_digest(changed) != chat_template_digest(tok)
    assert tokenizer_digest(changed) == tokenizer_digest(tok)
    changed.chat_template = None
    assert chat_template_digest(changed) is None
    changed.add_tokens(["<|extra|>"], special_tokens=True)
    assert tokenizer_digest(changed) != tokenizer_digest(tok)

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(CHAT.read_bytes())
    b.write_bytes(CHAT.read_bytes())
    assert source_fingerprint(a) == source_fingerprint(b) == source_fingerprint(CHAT)
    b.write_bytes(CHAT.read_bytes() + b"\n")
    assert source_fingerprint(b) != source_fingerprint(a)
