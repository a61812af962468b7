"""Text that holds the characters `str.splitlines()` also cuts at (U+2028, U+2029, U+0085, \\x0b,
\\x0c, \\x1c-\\x1e) through every JSON Lines writer and reader of the program, and through the
stages that write and read them: regen (its parts, a resumed run, its output), extract and eval.

ShareGPT's own rows hold U+2028 (and \\x0b, \\x0c): `dflash sets` writes them, the recipe reads
them back, regen writes what the target answered to them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY_TARGET, jsonl_rows, read_cache
from test_evaluate import PROMPTS, export_random_drafter
from transformers import AutoTokenizer

from dflash_cache.cache.store import write_rejected
from dflash_cache.core.damage import read_jsonl
from dflash_cache.core.jsonl import dumps_line
from dflash_cache.eval.benchsets import write_rows
from dflash_cache.pipelines.recipe import _first
from dflash_cache.pipelines.regen import RegenConfig, parts_dir, run
from dflash_cache.pipelines.report import read_metrics
from dflash_cache.rows.sources import read_rows, source_row
from dflash_cache.train.metrics import MetricsLog, Trace

BREAKS = ("\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")


def rows_with_breaks() -> list[dict]:
    """A row of every form, each break in a user turn, a reply, a system turn and a prompt."""
    rows = []
    for i, ch in enumerate(BREAKS):
        rows.append({"messages": [{"role": "system", "content": f"Be{ch}brief."},
                                  {"role": "user", "content": f"What is {i} plus{ch}{i}?"},
                                  {"role": "assistant", "content": f"It is{ch}{2 * i}."}]})  # fmt: skip
        rows.append({"prompt": f"Count to {i + 2}{ch}please.", "response": f"1{ch}2"})
    return rows


def test_every_json_lines_writer_and_reader_keeps_every_break(tmp_path):
    rows = rows_with_breaks()
    for ch in BREAKS:  # a line this program writes is one line to any reader, splitlines() too
        line = dumps_line({"t": f"a{ch}b"})
        assert line.endswith("\n") and len(line.splitlines()) == 1 and json.loads(line) == {"t": f"a{ch}b"}

    sets = tmp_path / "set.jsonl"  # dflash sets -> the recipe's first rows, and every rows reader
    write_rows(rows, sets)
    assert _first(sets, len(rows), "the set") == rows
    assert read_jsonl(sets, "") == rows
    assert [source_row(r) for r in read_rows(sets)] == rows

    raw = tmp_path / "raw.jsonl"  # another tool's file: the breaks raw inside its strings, CRLF line ends
    raw.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    assert "\u2028" in raw.read_text(encoding="utf-8") and len(raw.read_text(encoding="utf-8").splitlines()) > len(rows)
    assert read_jsonl(raw, "") == rows == _first(raw, len(rows), "the file")
    assert [source_row(r) for r in read_rows(raw)] == rows

    cache = tmp_path / "cache"  # an extract's rejected rows
    cache.mkdir()
    write_rejected(cache, [(i, f"reason{ch}{i}") for i, ch in enumerate(BREAKS)])
    assert read_jsonl(cache / "rejected.jsonl", "") == [{"row": i, "reason": f"reason{ch}{i}"}
                                                        for i, ch in enumerate(BREAKS)]  # fmt: skip

    run_dir = tmp_path / "run"  # metrics: written, read by the report, trimmed on resume
    run_dir.mkdir()
    log = MetricsLog(run_dir, None)
    records = [{"step": s, "loss": 1.0, "note": f"x{ch}y"} for s, ch in enumerate(BREAKS, 1)]
    for r in records:
        log.log(r)
    assert read_metrics(run_dir)["steps"] == records
    MetricsLog(run_dir, 3)
    assert read_metrics(run_dir)["steps"] == records[:3]
    trace = Trace(run_dir, 0, 1, 0)
    trace.batch(0, 0, torch.arange(3))
    trace.step(1, torch.nn.Linear(2, 2))
    assert [list(r) for r in jsonl_rows(run_dir / "trace" / "rank0.jsonl")] == [["epoch", "batch", "samples"],
                                                                                ["step", "checksum"]]  # fmt: skip


def test_regen_resume_extract_and_eval_take_rows_with_breaks(tmp_path):
    data = tmp_path / "in.jsonl"
    rows = rows_with_breaks()
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    settings = {"target": str(TINY_TARGET), "data": str(data), "max_new_tokens": 8, "part_rows": 4, "batch_size": 4}
    whole = tmp_path / "whole.jsonl"
    summary = run(RegenConfig(out=whole, **settings))
    assert summary["rows"] == len(rows) and summary["rejected"] == 0
    got = jsonl_rows(whole)
    for src, row in zip(rows, got, strict=True):  # what was asked, breaks and all, then the target's reply
        asked = src["messages"][:-1] if "messages" in src else [{"role": "user", "content": src["prompt"]}]
        assert row["messages"][:-1] == asked and row["messages"][-1]["role"] == "assistant"

    # A run stopped after its first two parts: the rerun reads them back and writes the same output.
    out = tmp_path / "resumed.jsonl"
    parts = parts_dir(out)
    parts.mkdir()
    shutil.copy(whole.with_name(f".{whole.name}.regen.json"), parts / "settings.json")
    lines = whole.read_bytes().split(b"\n")
    for part in range(2):
        (parts / f"part-{part:05d}.jsonl").write_bytes(b"".join(ln + b"\n" for ln in lines[part * 4 : part * 4 + 4]))
    again = run(RegenConfig(out=out, **settings))
    assert again["rows"] == len(rows) and out.read_bytes() == whole.read_bytes()

    # extract: every row cached, its tokens the template's rendering of the row as regen wrote it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "cli.main", "extract", "--target", str(TINY_TARGET), "--data", str(out),
           "--out", str(cache), "--project", "none"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    cached = read_cache(cache)
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    assert sorted(cached) == list(range(len(rows)))
    for i, row in enumerate(got):
        want = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert cached[i][1].tolist() == list(want)

    # eval: prompts with every break (the bundled held-out prompts hold them too)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say{ch}hi"}, ensure_ascii=False) + "\n" for ch in BREAKS),
                       encoding="utf-8")  # fmt: skip
    assert any(ch in PROMPTS.read_text(encoding="utf-8") for ch in BREAKS[:3])
    drafter = export_random_drafter(tmp_path / "drafter", 8)
    result = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--target", str(TINY_TARGET), "--drafter",
                           str(drafter), "--data", str(prompts), "--max-new-tokens", "6", "--json-out", str(result)],
                          cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text())["settings"]["prompts"] == len(BREAKS)


@pytest.mark.parametrize("ch", BREAKS)
def test_the_bundled_rows_hold_every_break(ch):
    """The everyday tests read data/chat.jsonl: it holds each break in a row among its first 40."""
    rows = jsonl_rows(ROOT / "data" / "chat.jsonl", 40)
    assert any(ch in m["content"] for r in rows for m in r["messages"])
