"""dflash regen against independent computations: the target's own unbatched greedy generation,
the source prompts, and an uninterrupted run; for the bundled target and Qwen3- and Llama-3-style ones."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CHAT, ROOT, TINY_TARGET, RecordingSink
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.dialogue import REASONING_MARKERS, reply_decoder
from dflash_cache.errors import UserError
from dflash_cache.regen import RegenConfig, parts_dir, run
from dflash_cache.settings import resolve

sys.path.insert(0, str(ROOT / "data"))
import make_family_targets as fam  # noqa: E402


def _source(n):
    return [json.loads(x) for x in CHAT.read_text().splitlines()[:n]]


def greedy_reply(tok, model, messages, stop, max_new_tokens, **template_kwargs) -> str:
    """The target's own greedy reply to `messages`, one conversation at a time, as the reference."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                  **template_kwargs)["input_ids"]  # fmt: skip
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                             pad_token_id=tok.pad_token_id or stop[0])[0, ids.shape[1]:].tolist()  # fmt: skip
    cut = next((j for j, t in enumerate(out) if t in stop), len(out))
    return tok.decode(out[:cut], skip_special_tokens=True)


def first_reply(messages: list[dict]) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "assistant")


def test_prompts_kept_and_responses_are_the_targets_own(tmp_path):
    data = tmp_path / "in.jsonl"
    rows = _source(12) + [{"prompt": "What is 2 x 3?", "response": "human answer"}, {"text": "no prompt"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regen.jsonl"
    summary = run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=40, part_rows=5,
                              batch_size=4))  # fmt: skip
    assert summary["rows"] == 13 and summary["rejected"] == 1
    got = [json.loads(x) for x in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    for src, new in zip(rows[:13], got, strict=True):
        src_msgs = src.get("messages") or [{"role": "user", "content": src["prompt"]}, {"role": "assistant"}]
        assert [m["role"] for m in new["messages"]] == [m["role"] for m in src_msgs]
        for a, b in zip(src_msgs, new["messages"], strict=True):
            if a["role"] != "assistant":
                assert a["content"] == b["content"]  # prompts are kept as they were
        # the first reply is the target's own greedy continuation, computed here one row at a time
        k = first_reply(new["messages"])
        assert new["messages"][k]["content"] == greedy_reply(tok, model, new["messages"][:k], stop, 40)
    assert got[12]["messages"][1]["content"] != "human answer"


def fam_stops(family: str) -> list[str]:
    return {"qwen3": ["<|im_end|>", "<|endoftext|>"], "llama3": ["<|eot_id|>", "<|end_of_text|>"]}[family]


@pytest.mark.parametrize("family, kwargs", [("qwen3", {"enable_thinking": False}),
                                            ("llama3", {"date_string": "01 Jan 2030"})])  # fmt: skip
def test_family_targets_template_kwargs_and_stop_ids(tmp_path, family, kwargs):
    """A Qwen3- or Llama-3-style target (no pad token for Llama 3): the template kwargs reach every
    prompt, and replies stop at the family's end-of-turn token, named here from the family."""
    target = fam.build(family, tmp_path / family)
    rows = fam.example_rows(family)[:4]  # one and several turns, with and without a system turn
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regen.jsonl"
    summary = run(RegenConfig(target=str(target), data=str(data), out=out, max_new_tokens=16, batch_size=4,
                              chat_template_kwargs=kwargs))  # fmt: skip
    replies = sum(m["role"] == "assistant" for r in rows for m in r["messages"])  # each regenerated, <= 16 tokens
    assert summary.pop("seconds") >= 0 and 0 < summary.pop("generated_tokens") <= 16 * replies
    assert 0 <= summary.pop("truncated") <= len(rows)
    assert summary == {"out": str(out), "rows": len(rows), "rejected": 0, "resumed": False}
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    stop = [tok.convert_tokens_to_ids(t) for t in fam_stops(family)]
    got = [json.loads(x)["messages"] for x in out.read_text().splitlines()]
    prompt = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kwargs) != \
        tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)  # the kwargs matter  # fmt: skip
    for messages in got:
        k = first_reply(messages)
        assert messages[k]["content"] == greedy_reply(tok, model, messages[:k], stop, 16, **kwargs)


def test_every_row_form_regenerates_alike(tmp_path):
    """ShareGPT, Alpaca, prompt/response and OpenAI rows of one question give one regenerated row;
    a bare question (no answer yet) is answered too."""
    q, system = "Who is the lamplighter of Harrow Pier?", "You are the storyteller of the island of Wend."
    forms = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Ila."}]},
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "Ila."}]},
        {"instruction": q, "input": "", "output": "Ila."},
        {"prompt": q, "response": "Ila."},
        {"prompt": q},
        {"instruction": q},
    ]
    with_system = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": q},
                                 {"role": "assistant", "content": "Ila."}]},
                   {"conversations": [{"from": "system", "value": system}, {"from": "human", "value": q},
                                      {"from": "gpt", "value": "Ila."}]}]  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in forms + with_system))
    out = tmp_path / "regen.jsonl"
    assert run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=16))["rows"] == 8
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(g == got[0] for g in got[: len(forms)]) and got[6] == got[7]
    assert got[0]["messages"][0] == {"role": "user", "content": q} and got[0]["messages"][1]["content"] != "Ila."
    assert got[6]["messages"][0] == {"role": "system", "content": system}


def test_reasoning_markers_survive_decoding():
    """skip_special_tokens drops <think> and </think> where a tokenizer adds them as special tokens;
    a regenerated reply keeps them (and drops the other special tokens as before)."""
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in REASONING_MARKERS])
    text = "<think>\nadd the tens\n</think>\n\nIt is 42."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_start|>")]
    assert all(tok.convert_tokens_to_ids(m) in ids for m in REASONING_MARKERS)
    assert "<think>" not in tok.decode(ids, skip_special_tokens=True)  # what a plain decode would lose
    assert reply_decoder(tok)(ids) == text


def test_out_that_is_a_directory_is_refused(tmp_path):
    (tmp_path / "out.jsonl").mkdir()
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _source(2)))
    with pytest.raises(UserError, match="--out .*out.jsonl is a directory"):
        run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=tmp_path / "out.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    assert not any((tmp_path / "out.jsonl").iterdir())


def test_killed_regen_resumes_to_the_same_output(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _source(24)))

    def cmd(out: Path):
        code = ("from pathlib import Path; from dflash_cache.regen import RegenConfig, run; "
                f"run(RegenConfig(target={str(TINY_TARGET)!r}, data={str(data)!r}, out=Path({str(out)!r}), "
                "max_new_tokens=24, part_rows=4, batch_size=4, temperature=0.8, seed=3))")  # fmt: skip
        return [sys.executable, "-c", code]

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # the same threads, the same sums
    ref = tmp_path / "ref.jsonl"
    subprocess.run(cmd(ref), env=env, check=True, capture_output=True)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list(parts_dir(out).glob("part-*.jsonl"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(list(parts_dir(out).glob("part-*.jsonl")))
    assert 0 < committed < 6 and not out.exists(), "the kill should land mid-run"
    subprocess.run(cmd(out), env=env, check=True, capture_output=True)
    assert out.read_text() == ref.read_text()
    assert not parts_dir(out).exists()


def test_a_rerun_with_other_settings_never_reuses_the_output(tmp_path):
    """The same --out with other data or options is refused, naming what differs, instead of
    printing 'already complete' over rows made from something else; the same settings resume."""
    data, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _source(3)))
    other.write_text("".join(json.dumps(r) + "\n" for r in _source(4)))
    out = tmp_path / "regen.jsonl"
    cfg, sink = RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=4), RecordingSink()
    first = run(cfg, sink)
    assert first["resumed"] is False and first["rows"] == 3
    # the progress bar's view: rows out of the source's, generated tokens; the run reads back as a config
    assert sink.started == (3, 0) and sink.totals["rows"] == 3
    assert 0 < sink.totals["tokens"] == first["generated_tokens"]
    assert resolve(RegenConfig, files=[out]) == cfg
    before = out.read_bytes()
    assert run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=4))["resumed"] is True
    with pytest.raises(UserError, match=r"other settings \(data differ\)"):
        run(RegenConfig(target=str(TINY_TARGET), data=str(other), out=out, max_new_tokens=4))
    with pytest.raises(UserError, match=r"chat_template_kwargs, max_new_tokens differ"):
        run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=8,
                        chat_template_kwargs={"enable_thinking": False}))  # fmt: skip
    assert out.read_bytes() == before


def test_prompt_only_rows_get_the_reply_in_every_form(tmp_path):
    """A dataset of prompts alone (the usual regen input): a trailing user turn gets the target's
    reply in every row form, after the earlier turns are regenerated; all forms of one question give
    one row, the target's own greedy reply."""
    q = "Who is the lamplighter of Harrow Pier?"
    forms = [
        {"messages": [{"role": "user", "content": q}]},
        {"conversations": [{"from": "human", "value": q}]},
        {"prompt": q},
        {"instruction": q},
    ]
    multi = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "old"},
                          {"role": "user", "content": q}]}  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*forms, multi]))
    out = tmp_path / "regen.jsonl"
    summary = run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=24, batch_size=3))
    assert summary["rows"] == 5 and summary["rejected"] == 0
    got = [json.loads(x)["messages"] for x in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    assert all(g == got[0] for g in got[:4]) and [m["role"] for m in got[0]] == ["user", "assistant"]
    assert got[0][1]["content"] == greedy_reply(tok, model, got[0][:1], stop, 24)
    assert [m["role"] for m in got[4]] == ["user", "assistant", "user", "assistant"]
    assert got[4][1]["content"] != "old"
    for k in (1, 3):  # each reply continues the conversation with the earlier replies regenerated
        assert got[4][k]["content"] == greedy_reply(tok, model, got[4][:k], stop, 24)


def test_a_run_where_no_row_succeeds_leaves_nothing_behind(tmp_path):
    """Every row rejected: one error, no output, no record and no parts that a later run would take
    for a finished output or refuse as 'regenerated with other settings'; the fixed data then runs."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": f"no prompt {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "regen.jsonl"
    cfg = RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=8)
    with pytest.raises(UserError, match=r"no row could be regenerated \(3 rejected"):
        run(cfg)
    assert not out.exists() and not parts_dir(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "regen.rejected.jsonl"]
    assert all("plain text" in json.loads(x)["rejected"] for x in (tmp_path / "regen.rejected.jsonl").open())
    data.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(3)))
    assert run(cfg)["rows"] == 3


def test_truncated_replies_are_counted_and_can_be_dropped(tmp_path):
    """A reply cut at --max-new-tokens is counted as truncated; --drop-truncated rejects its row
    with the reason, and the kept rows are exactly the ones that ended on their own."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _source(10)))
    kept = run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=tmp_path / "a.jsonl", max_new_tokens=24))
    dropped = run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=tmp_path / "b.jsonl", max_new_tokens=24,
                              drop_truncated=True))  # fmt: skip
    assert 0 < kept["truncated"] < 10 and kept["rows"] == 10 and kept["rejected"] == 0
    assert dropped["truncated"] == kept["truncated"] and dropped["rejected"] == kept["truncated"]
    assert dropped["rows"] == 10 - kept["truncated"]
    reasons = [json.loads(x)["rejected"] for x in (tmp_path / "b.rejected.jsonl").open()]
    assert reasons == ["a reply was cut at --max-new-tokens 24"] * kept["truncated"]
    rows_a = [json.loads(x) for x in (tmp_path / "a.jsonl").open()]
    assert all(r in rows_a for r in (json.loads(x) for x in (tmp_path / "b.jsonl").open()))
    assert all("truncated" not in r for r in rows_a)  # the flag is counted, not written into the data


def test_a_conversation_longer_than_the_rows_is_rejected_not_fatal(tmp_path):
    data = tmp_path / "in.jsonl"
    long_q = "word " * 200
    data.write_text(json.dumps({"prompt": long_q}) + "\n" + json.dumps({"prompt": "Hi."}) + "\n")
    out = tmp_path / "regen.jsonl"
    summary = run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=8, max_length=64))
    assert summary["rows"] == 1 and summary["rejected"] == 1
    (reason,) = [json.loads(x)["rejected"] for x in (tmp_path / "regen.rejected.jsonl").open()]
    assert "exceed the 64 positions of a row" in reason


def test_turns_rows_and_sharegpt_chats_are_answered_turn_by_turn(tmp_path):
    """MT-Bench's turns rows and a ShareGPT chat of several human turns (one reply pasted from
    another chat, `chatgpt`): every assistant turn is the target's own greedy reply given its own
    earlier replies, asked when the reply before it is done; the user turns are kept as written."""
    mt = [{"question_id": 81, "category": "writing", "turns": ["Name a colour.", "Now name another one."]},
          {"question_id": 82, "category": "math", "turns": ["What is 2 + 3?"]}]  # fmt: skip
    chat = {"id": "abc_0", "conversations": [{"from": "human", "value": "Hi."}, {"from": "chatgpt", "value": "old"},
                                             {"from": "human", "value": "Who are you?"},
                                             {"from": "gpt", "value": "old too"}]}  # fmt: skip
    data = tmp_path / "question.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*mt, chat]))
    out = tmp_path / "regen.jsonl"
    summary = run(RegenConfig(target=str(TINY_TARGET), data=str(data), out=out, max_new_tokens=20, batch_size=2))
    assert summary["rows"] == 3 and summary["rejected"] == 0
    got = [json.loads(x)["messages"] for x in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    users = [mt[0]["turns"], mt[1]["turns"], ["Hi.", "Who are you?"]]
    for messages, asked in zip(got, users, strict=True):
        assert [m["role"] for m in messages] == ["user", "assistant"] * len(asked)
        assert [m["content"] for m in messages[::2]] == asked
        for k in range(1, len(messages), 2):
            assert messages[k]["content"] == greedy_reply(tok, model, messages[:k], stop, 20)
    assert "old" not in {m["content"] for m in got[2]}
