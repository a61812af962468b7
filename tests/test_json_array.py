"""A JSON array cut short (the PyPI ShareGPT file's shape) keeps every whole record before the cut,
with one warning that names the file, the cut's byte offset and the records kept; nothing else is
dropped silently. Checked at every cut point of a file written here, through the row reader, extract,
regen and eval. Also ShareGPT's other assistant roles, and MT-Bench's `turns` rows as training rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from helpers import ROOT, TINY_TARGET, jsonl_rows
from transformers import AutoTokenizer

from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.rows.chat import DataError, DataWarning, RowRejected
from dflash_cache.rows.encode import encode_row, tokenize
from dflash_cache.rows.forms import SHAREGPT_ROLES, conversation, user_turns
from dflash_cache.rows.json_array import read_json_array
from dflash_cache.rows.sources import read_rows


def sharegpt_records(n: int) -> list:
    """ShareGPT V3's shape: ids, conversations of human and gpt turns, text outside ASCII and escapes."""
    out = []
    for i in range(n):
        turns = [{"from": "human", "value": f"Question {i}: what is {i} + {i}? \u00e9\u4e2d\U0001f600 \"quoted\"\n"},
                 {"from": "gpt", "value": f"{2 * i}, with a tab\tand a backslash \\ ({i / 3:.3f})"}]  # fmt: skip
        out.append({"id": f"conv{i}_0", "conversations": turns, "score": i * 1.5e-3, "ok": i % 2 == 0, "x": None})
    return out


def write_array(path, records: list) -> list[tuple[int, int]]:
    """The file ShareGPT ships (indented, one record after another), and each record's byte span in
    it, computed from how it was written."""
    head, sep, spans, chunks = b"[\n", b",\n", [], []
    at = len(head)
    for i, r in enumerate(records):
        body = json.dumps(r, ensure_ascii=False, indent=2).encode()
        if i:
            chunks.append(sep)
            at += len(sep)
        spans.append((at, at + len(body)))
        chunks.append(body)
        at += len(body)
    path.write_bytes(head + b"".join(chunks) + b"\n]\n")
    return spans


def test_every_cut_point_keeps_the_whole_records_before_it(tmp_path):
    """Cut at every byte (inside strings, escapes, multi-byte characters, numbers, literals, between
    records): the records kept are exactly those that end before the cut, each its own bytes, and the
    cut is at the first record not kept (or at the end, when the file stops between records). A
    64-byte buffer makes every record span buffer refills."""
    records = sharegpt_records(6)
    whole = tmp_path / "whole.json"
    spans = write_array(whole, records)
    data = whole.read_bytes()
    full = read_json_array(whole, chunk=64)
    assert full.cut_at is None and [json.loads(r) for r in full.records] == records
    assert full.records == [data[a:b] for a, b in spans]
    cut = tmp_path / "cut.json"
    for n in range(2, len(data) - 2):  # from after "[" to before the closing "]"
        cut.write_bytes(data[:n])
        got = read_json_array(cut, chunk=64)
        kept = sum(1 for _, end in spans if end <= n)
        assert got.records == [data[a:b] for a, b in spans[:kept]], n
        start = spans[kept][0] if kept < len(spans) else n
        assert got.cut_at == (start if n > start else n) and got.size == n, n
        assert got.cut_message(cut).startswith(f"{cut} is a JSON array cut short: the file ends at byte {n:,}")
        assert f"the {kept:,} whole records before it are read" in got.cut_message(cut)


def test_a_json_file_that_is_invalid_before_its_end_is_refused(tmp_path):
    """Only a file that stops inside a record is cut short: an error anywhere else is invalid JSON,
    refused with its byte offset (and a byte-order mark is skipped, counted in the offsets)."""
    f = tmp_path / "bad.json"
    for text in (b'[{"a": 1}, {"a" 2}]', b'[{"a": 1},]', b'[{"a": 1}] [', b'[{"a": tru }]', b'[{"a": 1}, 2 3]',
                 b'\xef\xbb\xbf[{"a": 1} {"a": 2}]'):  # fmt: skip
        with pytest.raises(json.JSONDecodeError) as stdlib:
            json.loads(text.decode("utf-8-sig"))
        offset = stdlib.value.pos + 3 * text.startswith(b"\xef\xbb\xbf")  # ASCII: characters are bytes
        f.write_bytes(text)
        with pytest.raises(DataError, match=rf"{f} is not valid JSON \((.*) at byte {offset}\)"):
            read_rows(f)
    f.write_bytes(b'[{"a": "\xff"}]')
    with pytest.raises(DataError, match="not valid UTF-8 \\(byte 8"):
        read_rows(f)
    f.write_bytes(b'{"a": 1}\n{"a": 2}\n')  # JSON Lines in a .json file: read as lines, as before
    assert len(read_rows(f)) == 2


def cut_sharegpt(tmp_path, n_whole: int = 5):
    """A ShareGPT-like array of `n_whole` conversations, a whole record that is no object, and a
    record cut in the middle of a string; returns (path, cut offset)."""
    records = [*sharegpt_records(n_whole), ["a", "whole record that is no object"], sharegpt_records(1)[0]]
    path = tmp_path / "ShareGPT_cut.json"
    spans = write_array(path, records)
    start = spans[-1][0]
    path.write_bytes(path.read_bytes()[: start + 60])  # inside the last record's first value
    return path, start


def test_rows_of_a_cut_short_file_warn_once_and_reject_the_invalid_one(tmp_path):
    """read_rows twice and tokenize: one DataWarning in the process; the whole records are the rows,
    the one that is no object a rejected row with its reason. A rerun that reuses the tokenized data
    warns again (the run still reads a cut file)."""
    path, start = cut_sharegpt(tmp_path)
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert len(read_rows(path)) == 6 and len(read_rows(path, max_samples=2)) == 2
        result = tokenize(path, tok, 512, work_dir=tmp_path / "work")
    cuts = [w for w in seen if issubclass(w.category, DataWarning)]
    assert len(cuts) == 1
    assert str(cuts[0].message) == (f"{path} is a JSON array cut short: the file ends at byte {start + 60:,} inside "
                                    f"the record that starts at byte {start:,}; the 6 whole records before it "
                                    "are read")  # fmt: skip
    assert result.num_rows == 6 and len(result.dataset) == 5
    assert result.rejected == [(5, "not a JSON object: got array")]
    with pytest.warns(DataWarning, match="JSON array cut short") as again:
        reused = tokenize(path, tok, 512, work_dir=tmp_path / "work")
    assert reused.reused and reused.num_rows == 6 and len(again) == 1


def test_sharegpt_roles_of_other_chats_are_assistant_turns():
    """chatgpt, bing and bard turns (ShareGPT V3 has 14) are the conversation's replies: read as
    assistant turns, they render and are supervised exactly as gpt turns are."""
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    for role in ("chatgpt", "bing", "bard"):
        assert SHAREGPT_ROLES[role] == "assistant"
        row = {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": role, "value": "Teal."}]}
        gpt = {"conversations": [row["conversations"][0], {"from": "gpt", "value": "Teal."}]}
        assert [m["role"] for m in conversation(row)] == ["user", "assistant"]
        ids, mask = encode_row(row, tok, 512, False)
        assert (ids, mask) == encode_row(gpt, tok, 512, False) and any(mask)
    with pytest.raises(RowRejected, match="unknown role: conversations turn 1 has from 'claude'"):
        conversation({"conversations": [{"from": "human", "value": "a"}, {"from": "claude", "value": "b"}]})


def test_turns_rows_are_prompts_not_training_rows(tmp_path):
    """MT-Bench's rows: as prompts, each user turn with an empty reply for regen to fill; as training
    rows, refused with the reason (nothing to learn before regen answers them); malformed, named."""
    row = {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]}
    assert user_turns(row) == row["turns"] and user_turns({"prompt": "x"}) is None
    assert conversation(row, reply_required=False) == [
        {"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now make it rhyme."}, {"role": "assistant", "content": ""}]  # fmt: skip
    with pytest.raises(RowRejected, match="no assistant turn: a turns row holds the user's turns only"):
        conversation(row)
    for bad, reason in (({"turns": "hi"}, "wrong type: turns must be a list of strings, got string"),
                        ({"turns": []}, "empty conversation: turns is an empty list"),
                        ({"turns": ["a", 3]}, "wrong type: turn 1 must be a string, got number")):  # fmt: skip
        with pytest.raises(RowRejected, match=reason):
            conversation(bad, reply_required=False)
    f = tmp_path / "question.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="every row of .* was rejected .*a turns row holds the user's turns"):
        tokenize(f, AutoTokenizer.from_pretrained(TINY_TARGET), 512)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # a CLI extract and regen
def test_extract_and_regen_read_a_cut_short_file_with_one_warning(tmp_path):
    """`dflash extract` and `dflash regen` on the cut file: each prints the one warning line and
    uses every whole record (the invalid one rejected with its reason, as any bad row)."""
    path, start = cut_sharegpt(tmp_path, n_whole=3)
    want = f"warning: {path} is a JSON array cut short"
    x = run_cli("extract", "--target", str(TINY_TARGET), "--data", str(path), "--out", str(tmp_path / "cache"),
                "--max-length", "256", "--json")  # fmt: skip
    assert x.returncode == 0, x.stderr
    assert x.stderr.count("warning:") == 1 and want in x.stderr and f"starts at byte {start:,}" in x.stderr
    spec = json.loads((tmp_path / "cache" / "cache.json").read_text())
    assert spec["data"]["num_rows"] == 4 and spec["data"]["num_rejected"] == 1
    out = tmp_path / "regen.jsonl"
    r = run_cli("regen", "--target", str(TINY_TARGET), "--data", str(path), "--out", str(out), "--max-new-tokens", "4",
                "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("warning:") == 1 and want in r.stderr
    summary = json.loads(r.stdout)
    assert summary["rows"] == 3 and summary["rejected"] == 1
    rejected = jsonl_rows(tmp_path / "regen.rejected.jsonl")
    assert rejected == [{"rejected": "not a JSON object: got array", "row": 3}]


def test_eval_prompts_of_a_cut_short_file_are_its_whole_records(tmp_path):
    """`dflash eval`'s prompts from a cut file: one per whole record, each the prompt that record
    gives when written alone as JSON Lines; one warning."""

    records = sharegpt_records(4)
    path = tmp_path / "cut.json"
    spans = write_array(path, records)
    path.write_bytes(path.read_bytes()[: spans[-1][0] + 30])
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    with pytest.warns(DataWarning, match=f"the file ends at byte {spans[-1][0] + 30:,}") as seen:
        got = load_prompts(path, tok)
    assert len(seen) == 1 and got == load_prompts(whole, tok) and len(got) == 3
