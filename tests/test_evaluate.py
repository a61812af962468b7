"""Speculative decoding (dflash eval): greedy output identical to the target's own, full blocks
accepted from an oracle drafter, the speculative-sampling rule's distribution, tau pooled and per
prompt, prompts in every row form with chat-template kwargs, the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache import evaluate as ev
from dflash_cache.cache.spec import default_layer_ids
from dflash_cache.train.drafter import DFlashDrafter, DrafterConfig, load_serving, save_serving
from dflash_cache.train.objective import BlockLayout

PROMPTS = ROOT / "data" / "prompts.jsonl"
MASK_ID = 1535
MAX_NEW = 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Batch-1 decoding of a tiny model is op-overhead bound: one thread is fastest, and it keeps
    this file's time steady on a shared machine (two threads stall whenever a core is busy)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stop_ids(tokenizer, target):
    ids = ev.stop_token_ids(tokenizer, target)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    return ids


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # Answers of several lengths: some end in <|im_end|>, some run into max_new_tokens.
    return [p for i, p in enumerate(ev.load_prompts(PROMPTS, tokenizer, limit=7)) if i in (0, 1, 2, 3, 6)]


@pytest.fixture(scope="module")
def references(target, prompts, stop_ids):
    return [ev.target_generate(target, p, max_new_tokens=MAX_NEW, stop_ids=stop_ids) for p in prompts]


def export_random_drafter(out, block_size: int, seed: int = 0):
    """A random-init drafter for the tiny target, exported and loaded back in float32."""
    cfg = json.loads((TINY_TARGET / "config.json").read_text())
    dcfg = DrafterConfig.from_target(
        cfg, target_layer_ids=default_layer_ids(8), mask_token_id=MASK_ID, num_draft_layers=2, block_size=block_size
    )
    torch.manual_seed(seed)
    save_serving(DFlashDrafter(dcfg), dcfg, out)
    return out


def test_stops_and_references(references, stop_ids):
    stopped = [r[-1] in stop_ids and len(r) < MAX_NEW for r in references]
    assert stopped == [len(r) != MAX_NEW for r in references]
    assert 0 < sum(stopped) < len(references)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_greedy_matches_target_with_random_drafter(tmp_path, target, prompts, references, stop_ids, block_size):
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", block_size), dtype=torch.float32)
    for p, ref in zip(prompts, references, strict=True):
        out, lengths = ev.speculative_generate(
            target, drafter, dcfg, p, max_new_tokens=MAX_NEW, block_size=block_size, stop_ids=stop_ids
        )
        assert out == ref
        assert all(1 <= n <= block_size for n in lengths)
        assert sum(lengths) == len(out) - 1  # the prefill gives the first token, each step the rest


@pytest.mark.parametrize("block_size", [4, 16])
def test_oracle_drafter_accepts_whole_blocks(tmp_path, monkeypatch, target, prompts, references, stop_ids, block_size):
    """A drafter that proposes the target's own greedy continuation: every step commits B tokens
    (the last one fewer, where max_new_tokens or <|im_end|> cuts it) and the output is unchanged."""
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", block_size), dtype=torch.float32)
    for p, ref in zip(prompts, references, strict=True):
        # The continuation past any stop token, so that every block can be filled.
        cont = ev.target_generate(target, p, max_new_tokens=MAX_NEW + block_size, stop_ids=set())
        calls = []

        def oracle(drafter, dcfg, context, last_token, position, *, block_size, p=p, cont=cont, calls=calls, **_):
            assert context.shape[0] == position  # the context is every position before the block
            assert last_token == cont[position - len(p)]
            calls.append(position)
            return cont[position - len(p) + 1 : position - len(p) + block_size], None

        monkeypatch.setattr(ev, "propose", oracle)
        out, lengths = ev.speculative_generate(
            target, drafter, dcfg, p, max_new_tokens=MAX_NEW, block_size=block_size, stop_ids=stop_ids
        )
        assert out == ref
        assert lengths[:-1] == [block_size] * (len(lengths) - 1)
        assert 1 <= lengths[-1] <= block_size
        assert len(lengths) == -(-(len(ref) - 1) // block_size)  # ceil: as few steps as possible
        assert calls == [len(p) + k * block_size for k in range(len(lengths))]
        if (len(ref) - 1) % block_size == 0:
            assert ev.tau(lengths) == block_size


def test_partly_wrong_drafts_accept_their_correct_prefix(tmp_path, monkeypatch, target, prompts, references,
                                                         stop_ids):  # fmt: skip
    """Drafts right up to a wrong slot that moves from step to step: each step commits exactly the
    right prefix plus the bonus, so the cache crop and context bookkeeping are exercised at every
    cut point, and the output is still the target's. The context handed to the drafter is the
    target's hidden_states[l+1] of every committed position, as one full forward computes it."""
    B = 8
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", B), dtype=torch.float32)
    for p, ref in zip(prompts, references, strict=True):
        cont = ev.target_generate(target, p, max_new_tokens=MAX_NEW + B, stop_ids=set())
        wrong_at, contexts = [], []

        def half_oracle(drafter, dcfg, context, last_token, position, *, block_size, p=p, cont=cont,
                        wrong_at=wrong_at, contexts=contexts, **_):  # fmt: skip
            contexts.append(context.clone())
            drafts = list(cont[position - len(p) + 1 : position - len(p) + block_size])
            j = len(wrong_at) % (block_size - 1)
            drafts[j] = (drafts[j] + 1) % dcfg.vocab_size
            wrong_at.append(j)
            return drafts, None

        monkeypatch.setattr(ev, "propose", half_oracle)
        out, lengths = ev.speculative_generate(
            target, drafter, dcfg, p, max_new_tokens=MAX_NEW, block_size=B, stop_ids=stop_ids
        )
        assert out == ref
        assert lengths[:-1] == [j + 1 for j in wrong_at[:-1]]
        assert 1 <= lengths[-1] <= wrong_at[-1] + 1
        with torch.inference_mode():
            hs = target(torch.tensor([p + out]), output_hidden_states=True).hidden_states
        expected = torch.cat([hs[lid + 1][0] for lid in dcfg.target_layer_ids], dim=-1)
        for ctx in contexts:
            torch.testing.assert_close(ctx, expected[: ctx.shape[0]], rtol=1e-4, atol=1e-4)


def test_proposals_match_the_training_forward(tmp_path, target, prompts, references):
    """propose() (one block, the context cut at the anchor) gives the argmax of the drafter's
    training-time forward over the whole sequence's context with several blocks at once."""
    B = 8
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", B), dtype=torch.float32)
    seq = prompts[0] + references[0]
    with torch.inference_mode():
        hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        context = torch.cat([hs[lid + 1][0] for lid in dcfg.target_layer_ids], dim=-1)
        anchors = [len(prompts[0]), len(prompts[0]) + 5, len(seq) - B]
        ids = torch.full((len(anchors), B), MASK_ID)
        ids[:, 0] = torch.tensor([seq[a] for a in anchors])
        layout = BlockLayout.build(torch.tensor([0, len(seq)]), torch.zeros(len(anchors), dtype=torch.long),
                                   torch.tensor(anchors), B)  # fmt: skip
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        hidden = drafter(embed(ids.flatten()), context, layout).view(len(anchors), B, -1)
        want = head(hidden[:, 1:]).argmax(-1).tolist()
        got = [ev.propose(drafter, dcfg, context[:a], seq[a], a, block_size=B, embed=embed, head=head)
               for a in anchors]  # fmt: skip
    assert [g[0] for g in got] == want and all(g[1] is None for g in got)


def test_sampling_is_seeded_and_bounded(tmp_path, target, prompts, stop_ids):
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", 8), dtype=torch.float32)

    def run(seed):
        return ev.speculative_generate(target, drafter, dcfg, prompts[0], max_new_tokens=24, block_size=8,
                                       temperature=0.8, generator=torch.Generator().manual_seed(seed),
                                       stop_ids=stop_ids)  # fmt: skip

    out, lengths = run(1)
    assert (out, lengths) == run(1)
    assert 1 <= len(out) <= 24 and sum(lengths) == len(out) - 1


def test_speculative_sampling_rule_keeps_target_distribution():
    """The first committed token of a step is distributed as the target's p, whatever q is."""
    g = torch.Generator().manual_seed(0)
    V, T, n = 5, 0.7, 20000
    logits = torch.randn(2, V, generator=g) * 2
    q = torch.softmax(torch.randn(1, V, generator=g) * 2, dim=-1)
    p0 = torch.softmax(logits[0] / T, dim=-1)
    counts = torch.zeros(V)
    accepted = 0
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()
    for d in drafts:
        a, bonus = ev._verify([d], q, logits, T, g)
        counts[d if a == 1 else bonus] += 1
        accepted += a
    assert torch.allclose(counts / n, p0, atol=0.015)
    expected_accept = torch.minimum(p0, q[0]).sum()  # P(accept) = sum_x min(p, q)
    assert abs(accepted / n - float(expected_accept)) < 0.015


def test_tau_and_histogram():
    assert ev.tau([1, 3, 4, 2, 5]) == 3.0
    assert ev.tau([16, 16, 7]) == 13.0
    assert ev.tau([]) == 0.0
    assert ev.histogram([1, 3, 4, 2, 5, 1], 5) == [2, 1, 1, 1, 1]


def test_tau_per_prompt():
    per_prompt = [[1, 3, 4], [16, 16, 7], [], [2]]  # the empty one: the first token ended the generation
    want = statistics.fmean(statistics.fmean(lengths) for lengths in per_prompt if lengths)
    assert ev.tau_per_prompt(per_prompt) == pytest.approx(want)
    assert ev.tau_per_prompt([[], []]) == 0.0


def test_evaluate_reports_tau_per_prompt(tmp_path, monkeypatch):
    """evaluate() on the tiny target with drafts that are right up to a slot that depends on the
    prompt, so prompts differ in tau and in length: tau_per_prompt is the mean of the prompts'
    own means of the acceptance lengths returned, tau the pooled mean, and the two differ."""
    B = 8
    drafter_dir = export_random_drafter(tmp_path / "d", B)
    current = {}
    real_generate = ev.speculative_generate

    def spec_generate(model, drafter, dcfg, ids, **kw):
        current["prompt"] = len(ids)
        current["cont"] = ev.target_generate(model, ids, max_new_tokens=MAX_NEW + B, stop_ids=set())
        return real_generate(model, drafter, dcfg, ids, **kw)

    def wrong_at_one_slot(drafter, dcfg, context, last_token, position, *, block_size, **_):
        at = position - current["prompt"]
        drafts = list(current["cont"][at + 1 : at + block_size])
        j = current["prompt"] % (block_size - 1)
        drafts[j] = (drafts[j] + 1) % dcfg.vocab_size
        return drafts, None

    monkeypatch.setattr(ev, "speculative_generate", spec_generate)
    monkeypatch.setattr(ev, "propose", wrong_at_one_slot)
    r = ev.evaluate(str(TINY_TARGET), drafter_dir, PROMPTS, max_new_tokens=MAX_NEW, limit=6)
    lengths = [s["acceptance_lengths"] for s in r.samples]
    assert len(lengths) == 6 and all(s["same_as_target"] for s in r.samples)
    assert r.tau_per_prompt == pytest.approx(statistics.fmean(statistics.fmean(n) for n in lengths if n))
    assert r.tau == pytest.approx(statistics.fmean(n for sample in lengths for n in sample))
    assert r.tau_per_prompt != pytest.approx(r.tau)
    assert len({round(statistics.fmean(n), 6) for n in lengths if n}) > 1
    assert r.to_dict()["tau_per_prompt"] == r.tau_per_prompt


def _qwen3_tokenizer():
    """The Qwen3-style fixture tokenizer (data/make_family_targets.py): no generation markers, and
    a template that honours enable_thinking."""
    families = sys.modules.get("make_family_targets")
    if families is None:
        spec = importlib.util.spec_from_file_location("make_family_targets", ROOT / "data" / "make_family_targets.py")
        families = importlib.util.module_from_spec(spec)
        sys.modules["make_family_targets"] = families  # its dataclasses look their module up there
        spec.loader.exec_module(families)
    return families.build_tokenizer("qwen3")


def test_prompts_in_every_row_form_with_thinking_off(tmp_path):
    """Every row form dflash extract reads gives the same prompt as the equivalent messages row,
    rendered with the chat-template kwargs: with a Qwen3-style template, thinking off adds the
    empty think block to the generation prompt."""
    tok = _qwen3_tokenizer()
    ask = "Add 2 and 3."
    rows = [
        {"messages": [{"role": "user", "content": ask}]},
        {"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": "5"}]},
        {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "5"}]},
        {"conversations": [{"from": "human", "value": ask}]},
        {"instruction": ask, "output": "5"},
        {"instruction": ask},
        {"prompt": ask, "response": "5"},
        {"prompt": ask},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = [{"role": "user", "content": ask}]
    off = ev.load_prompts(f, tok, chat_template_kwargs={"enable_thinking": False})
    want = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False),
               add_special_tokens=False)["input_ids"]  # fmt: skip
    assert off == [want] * len(rows)
    assert tok.decode(want).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    default = ev.load_prompts(f, tok)
    assert default == [tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]] * 8
    assert default[0] != off[0]


def test_bad_prompt_rows_and_template_kwargs(tmp_path, tokenizer):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n" + '{"conversations": 3}\n')
    with pytest.raises(ev.DataError, match=r"line 2: wrong type: conversations must be a list"):
        ev.load_prompts(f, tokenizer)
    with pytest.raises(ev.DataError, match="JSON object"):
        ev.load_prompts(f, tokenizer, chat_template_kwargs=["enable_thinking"])


def test_prompts_drop_the_reply(tmp_path, tokenizer):
    f = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "Add 2 and 3."}]
    rows = [{"messages": [*chat, {"role": "assistant", "content": "5"}]}, {"messages": chat}, {"text": "hello"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = ev.load_prompts(f, tokenizer)
    assert a == b == tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert c == tokenizer("hello")["input_ids"]
    assert ev.load_prompts(f, tokenizer, limit=1) == [a]


def test_drafter_for_another_target_is_refused():
    cfg = json.loads((TINY_TARGET / "config.json").read_text())
    dcfg = DrafterConfig.from_target({**cfg, "hidden_size": 32}, target_layer_ids=None, mask_token_id=MASK_ID)
    with pytest.raises(ev.EvalError, match="hidden_size"):
        ev.check_fits(dcfg, cfg)


def test_cli_end_to_end(tmp_path):
    drafter = export_random_drafter(tmp_path / "export", 8)
    out = tmp_path / "eval.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cli.main", "eval", "--target", str(TINY_TARGET), "--drafter", str(drafter),
           "--data", str(PROMPTS), "--limit", "2", "--max-new-tokens", "16", "--json-out", str(out),
           "--chat-template-kwargs", '{"enable_thinking": false}']  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tau/prompt" in proc.stdout and "tau (pooled)" in proc.stdout and "speedup" in proc.stdout
    result = json.loads(out.read_text())
    assert result["settings"]["prompts"] == 2 and result["settings"]["block_size"] == 8
    assert result["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert len(result["histogram"]) == 8 and sum(result["histogram"]) == result["steps"]
    assert result["tau"] == pytest.approx(sum((i + 1) * c for i, c in enumerate(result["histogram"])) / result["steps"])
    taus = [statistics.fmean(s["acceptance_lengths"]) for s in result["samples"] if s["acceptance_lengths"]]
    assert result["tau_per_prompt"] == pytest.approx(statistics.fmean(taus))
    assert f"{result['tau_per_prompt']:.3f}" in proc.stdout
    assert all(s["same_as_target"] for s in result["samples"])

    for bad in ("{enable_thinking: false}", "[1]"):  # not JSON; not an object
        cmd[-1] = bad
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: --chat-template-kwargs")
    cmd[-1] = "{}"

    cmd[cmd.index("--drafter") + 1] = str(tmp_path)  # a directory that is no exported drafter
    bad = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "error:" in bad.stderr and "Traceback" not in bad.stderr
