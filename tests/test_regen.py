"""dflash regen against independent computations: the target's own unbatched greedy generation,
the source prompts, and an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import CHAT, ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.regen import RegenConfig, parts_dir, run


def _source(n):
    return [json.loads(x) for x in CHAT.read_text().splitlines()[:n]]


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
        k = next(i for i, m in enumerate(new["messages"]) if m["role"] == "assistant")
        ids = tok.apply_chat_template(new["messages"][:k], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]  # fmt: skip
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=stop,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()  # fmt: skip
        cut = next((j for j, t in enumerate(ref) if t in stop), len(ref))
        assert new["messages"][k]["content"] == tok.decode(ref[:cut], skip_special_tokens=True)
    assert got[12]["messages"][1]["content"] != "human answer"


def test_killed_regen_resumes_to_the_same_output(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _source(24)))

    def cmd(out: Path):
        code = ("from pathlib import Path; from dflash_cache.regen import RegenConfig, run; "
                f"run(RegenConfig(target={str(TINY_TARGET)!r}, data={str(data)!r}, out=Path({str(out)!r}), "
                "max_new_tokens=24, part_rows=4, batch_size=4, temperature=0.8, seed=3))")  # fmt: skip
        return [sys.executable, "-c", code]

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
