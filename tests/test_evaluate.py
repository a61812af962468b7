"""Speculative decoding and the generation engine (dflash eval) against independent computations:
transformers' own greedy `generate`, one prompt at a time; the one-row engine through transformers'
cache; the drafter's training forward over a whole sequence; `output_hidden_states`; and an oracle
drafter that knows the target's continuation. Also the speculative-sampling rule's distribution,
tau pooled and per prompt, prompts in every row form with chat-template kwargs, and the CLI."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY_TARGET, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.cache.spec import default_layer_ids
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.family import load_serving, save_serving
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.eval import decode as ev
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.metrics import first_difference, histogram, tau, tau_per_prompt
from dflash_cache.generate import BlockProposer, Engine, Request, StopRule, lookup
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.generate.requests import Chooser, DraftChooser, speculative_accept
from dflash_cache.generate.targets import CachedTarget, SlotTarget
from dflash_cache.rows.chat import DataError
from dflash_cache.target.load import stop_token_ids

PROMPTS = ROOT / "data" / "prompts.jsonl"
MASK_ID = 1535
MAX_NEW = 48
LENGTH = 256


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decoding a tiny model is op-overhead bound: one thread is fastest, and it keeps this file's
    time steady on a shared machine (two threads stall whenever a core is busy)."""
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
    ids = stop_token_ids(tokenizer, target)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    return ids


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # Answers of several lengths: some end in <|im_end|>, some run into max_new_tokens.
    return [p for i, p in enumerate(load_prompts(PROMPTS, tokenizer, limit=7)) if i in (0, 1, 2, 3, 6)]


@pytest.fixture(scope="module")
def references(target, prompts, stop_ids):
    """transformers' greedy generate, one prompt at a time: the independent reference."""
    return [hf_greedy(target, p, MAX_NEW, stop_ids) for p in prompts]


def export_random_drafter(out, block_size: int, seed: int = 0):
    """A random-init drafter for the tiny target, exported and loaded back in float32."""
    cfg = json.loads((TINY_TARGET / "config.json").read_text())
    dcfg = DrafterConfig.from_target(
        cfg, target_layer_ids=default_layer_ids(8), mask_token_id=MASK_ID, num_draft_layers=2, block_size=block_size
    )
    torch.manual_seed(seed)
    save_serving(DFlashDrafter(dcfg), dcfg, out)
    return out


def make_target(model, slots: int, layer_ids=None):
    """The slot target of `slots` rows, or (slots 0) the one-row target through transformers' cache."""
    return SlotTarget(model, slots, LENGTH, layer_ids) if slots else CachedTarget(model, LENGTH, layer_ids)


def drafter_proposer(model, drafter, slots: int, block_size: int | None = None) -> BlockProposer:
    return BlockProposer(drafter, embed=model.get_input_embeddings().weight, head=model.get_output_embeddings().weight,
                         slots=max(slots, 1), length=LENGTH, block_size=block_size)  # fmt: skip


def decode(engine: Engine, prompts, max_new=MAX_NEW, seed: int = 0):
    """{prompt index: completion} of every prompt through `engine`."""
    done = {c.request.key: c for c in engine.stream(
        Request(p, max_new, seed=seed * 1000 + i, key=i) for i, p in enumerate(prompts))}  # fmt: skip
    return [done[i] for i in range(len(prompts))]


class ScriptedProposer:
    """A proposer whose drafts are a function of each row's request and committed tokens (the tests'
    oracle drafters). It records the context states the engine hands it, by request and position.
    It reads the engine's rows on the host, so the engine runs it in step with the host."""

    graphable = False

    def __init__(self, block_size: int, slots: int, drafts_for):
        self.block_size, self.slots, self.drafts_for = block_size, slots, drafts_for
        self.engine: Engine | None = None
        self.contexts: dict = {}
        self.calls: list = []

    def _request(self, slot: int):
        row = self.engine.rows[slot]
        return getattr(row, "request", None), row

    def add_context(self, states, positions, rows=None):
        for j, slot in enumerate(range(states.shape[0]) if rows is None else rows.tolist()):
            request, _ = self._request(slot)
            if request is not None:
                ctx = self.contexts.setdefault(request.key, {})
                for t, pos in enumerate(positions[j].tolist()):
                    ctx[pos] = states[j, t].clone()

    def start(self, rows, prompts, first):
        pass

    def commit(self, tokens, pos):
        pass

    def propose(self, last, positions, choose):
        drafts = torch.full((last.shape[0], self.block_size - 1), -1, dtype=torch.long)
        for slot in range(last.shape[0]):
            request, row = self._request(slot)
            if request is not None:
                assert int(last[slot]) == row.out[-1] and int(positions[slot]) == len(request.prompt) + len(row.out) - 1
                self.calls.append((request.key, int(positions[slot])))
                d = list(self.drafts_for(request, row.out))[: self.block_size - 1]
                drafts[slot, : len(d)] = torch.tensor(d, dtype=torch.long)
        return drafts, None


def scripted_engine(model, slots: int, stop_ids, block_size: int, drafts_for, layer_ids):
    proposer = ScriptedProposer(block_size, max(slots, 1), drafts_for)
    engine = Engine(make_target(model, slots, layer_ids), StopRule(stop_ids), proposer=proposer)
    proposer.engine = engine
    return engine, proposer


@pytest.fixture(scope="module")
def continuations(target, prompts):
    """The target's greedy continuation past every stop token, so that every block can be filled."""
    return [c.ids for c in decode(Engine(make_target(target, 4), StopRule([])), prompts, MAX_NEW + 16)]


def test_stops_and_references(references, stop_ids):
    stopped = [r[-1] in stop_ids and len(r) < MAX_NEW for r in references]
    assert stopped == [len(r) != MAX_NEW for r in references]
    assert 0 < sum(stopped) < len(references)


@pytest.mark.parametrize("slots", [0, 1, 3, 8])
def test_target_decoding_equals_transformers_generate(target, prompts, references, stop_ids, slots):
    """Plain greedy decoding, many rows at once (rows end and are refilled at different steps) or one
    row through transformers' cache: transformers' own generate, token for token."""
    got = decode(Engine(make_target(target, slots), StopRule(stop_ids)), prompts)
    assert [c.ids for c in got] == references
    assert [c.finish for c in got] == ["stop" if r[-1] in stop_ids else "length" for r in references]


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_greedy_speculative_equals_target_in_any_batch(tmp_path, target, prompts, references, stop_ids, block_size):
    """With a random drafter: the target's greedy output, and the same tau whether the prompts share
    a batch of 3 rows, run one at a time, or run through transformers' cache."""
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", block_size), dtype=torch.float32)
    runs = {}
    for slots in (3, 1, 0):
        engine = Engine(make_target(target, slots, dcfg.target_layer_ids), StopRule(stop_ids),
                        proposer=drafter_proposer(target, drafter, slots))  # fmt: skip
        runs[slots] = decode(engine, prompts)
    for got in runs.values():
        assert [c.ids for c in got] == references
        for c in got:
            assert all(1 <= n <= block_size for n in c.accepted) and sum(c.accepted) == len(c.ids) - 1
    assert [c.accepted for c in runs[3]] == [c.accepted for c in runs[1]] == [c.accepted for c in runs[0]]


class TableProposer:
    """Drafts read by position from one sequence held on the device (so the engine captures it and
    runs ahead of the host, as it does a real drafter's): the target's own continuation of one
    prompt, every draft right."""

    graphable = True

    def __init__(self, seq: list[int], block_size: int, slots: int):
        self.table, self.block_size, self.slots = torch.tensor(seq + [0] * block_size), block_size, slots

    def add_context(self, states, positions, rows=None):
        pass

    def start(self, rows, prompts, first):
        pass

    def commit(self, tokens, pos):
        pass

    def propose(self, last, positions, choose):
        return self.table[positions[:, None] + torch.arange(1, self.block_size)], None


def test_rows_that_fill_their_slots_and_end_at_other_steps(target, prompts):
    """The host commits a step while the next one runs, so a row that ended runs one step more.
    Rows of 64 positions that the prompt, the reply and a block fill exactly, or nearly, ending at
    different steps, in two rows and in one, with drafts that are all right (whole blocks of 8
    accepted up to the end) and without a drafter: the target's own greedy tokens, and one row
    counts a step for each commit, none for the step after its end."""
    prompt = tuple(prompts[0][:30])
    (whole,) = Engine(SlotTarget(target, 1, 128), StopRule([])).stream([Request(prompt, 64)])
    for slots in (2, 1):
        for proposer in (None, TableProposer(list(prompt) + whole.ids, 8, slots)):
            room = 1 + (8 if proposer is not None else 0)
            engine = Engine(SlotTarget(target, slots, 64), StopRule([]), proposer=proposer)
            requests = [Request(prompt, 64 - len(prompt) - room - k, key=k) for k in (0, 3, 5)]
            done = {c.request.key: c for c in engine.stream(requests)}
            for r in requests:
                assert done[r.key].ids == whole.ids[: r.max_new_tokens]
            if proposer is not None:
                assert all(c.accepted[:-1] == [8] * (len(c.accepted) - 1) for c in done.values())
            if slots == 1:
                commits = sum(len(c.accepted) if proposer else len(c.ids) - 1 for c in done.values())
                assert engine.steps == commits


def test_sampling_is_the_same_in_any_batch(tmp_path, target, prompts, stop_ids):
    """At temperature 0.8 a prompt's tokens depend on its seed alone, not on its batch or on the
    target's cache: plain and speculative sampling give the same output in 4 rows, 1 row and the
    cached one-row target; another seed gives another output."""
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", 8), dtype=torch.float32)
    for with_drafter in (False, True):
        runs = []
        for slots in (4, 1, 0):
            proposer = drafter_proposer(target, drafter, slots) if with_drafter else None
            engine = Engine(make_target(target, slots, dcfg.target_layer_ids), StopRule(stop_ids), temperature=0.8,
                            proposer=proposer)  # fmt: skip
            runs.append([(c.ids, c.accepted) for c in decode(engine, prompts, 24, seed=1)])
        assert runs[0] == runs[1] == runs[2]
        other = Engine(make_target(target, 4, dcfg.target_layer_ids), StopRule(stop_ids), temperature=0.8,
                       proposer=drafter_proposer(target, drafter, 4) if with_drafter else None)  # fmt: skip
        assert [c.ids for c in decode(other, prompts, 24, seed=2)] != [ids for ids, _ in runs[0]]


@pytest.mark.parametrize("block_size", [4, 16])
def test_oracle_drafter_accepts_whole_blocks(target, prompts, references, continuations, stop_ids, block_size):
    """A drafter that proposes the target's own greedy continuation: every step commits B tokens
    (the last one fewer, where max_new_tokens or <|im_end|> cuts it) and the output is unchanged."""
    index = {tuple(p): i for i, p in enumerate(prompts)}

    def oracle(request, out):
        return continuations[index[request.prompt]][len(out) : len(out) + block_size - 1]

    engine, proposer = scripted_engine(target, 3, stop_ids, block_size, oracle, default_layer_ids(8))
    for c, ref in zip(decode(engine, prompts), references, strict=True):
        assert c.ids == ref
        assert c.accepted[:-1] == [block_size] * (len(c.accepted) - 1) and 1 <= c.accepted[-1] <= block_size
        assert len(c.accepted) == -(-(len(ref) - 1) // block_size)  # ceil: as few steps as possible
        p = len(c.request.prompt)
        assert [pos for key, pos in proposer.calls if key == c.request.key] == \
            [p + k * block_size for k in range(len(c.accepted))]  # fmt: skip
        if (len(ref) - 1) % block_size == 0:
            assert tau(c.accepted) == block_size


@pytest.mark.parametrize("slots", [3, 0])
def test_partly_wrong_drafts_accept_their_correct_prefix(target, prompts, references, continuations, stop_ids, slots):
    """Drafts right up to a wrong slot that moves from step to step: each step commits exactly the
    right prefix plus the bonus, so every cut point of the rows' caches is exercised, and the output
    is still the target's. The context handed to the drafter is the target's hidden_states[l+1] of
    every committed position, as one full forward over the final sequence computes it."""
    B, layers = 8, default_layer_ids(8)
    index = {tuple(p): i for i, p in enumerate(prompts)}
    wrong_at: dict[int, list[int]] = {}

    def half_oracle(request, out):
        drafts = list(continuations[index[request.prompt]][len(out) : len(out) + B - 1])
        marks = wrong_at.setdefault(request.key, [])
        j = (len(marks) + request.key) % (B - 1)
        drafts[j] = (drafts[j] + 1) % 2048
        marks.append(j)
        return drafts

    engine, proposer = scripted_engine(target, slots, stop_ids, B, half_oracle, layers)
    for c, ref in zip(decode(engine, prompts), references, strict=True):
        marks = wrong_at[c.request.key]
        assert c.ids == ref
        assert c.accepted[:-1] == [j + 1 for j in marks[:-1]] and 1 <= c.accepted[-1] <= marks[-1] + 1
        seq = list(c.request.prompt) + c.ids
        with torch.inference_mode():
            hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        expected = torch.cat([hs[lid + 1][0] for lid in layers], dim=-1)
        ctx = proposer.contexts[c.request.key]
        got = torch.stack([ctx[pos] for pos in range(len(seq) - 1)])  # the last token is never fed
        torch.testing.assert_close(got, expected[: len(seq) - 1], rtol=1e-4, atol=1e-4)


def test_proposals_match_the_training_forward(tmp_path, target, prompts, references):
    """BlockProposer, with each row's context written position by position as decoding would, gives
    the argmax of the drafter's training-time forward over the whole sequence's context with several
    blocks at once (the block attention rule of training)."""
    B = 8
    drafter, dcfg = load_serving(export_random_drafter(tmp_path / "d", B), dtype=torch.float32)
    seq = prompts[0] + references[0]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.inference_mode():
        hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        context = torch.cat([hs[lid + 1][0] for lid in dcfg.target_layer_ids], dim=-1)
        anchors = [len(prompts[0]), len(prompts[0]) + 5, len(seq) - B]
        ids = torch.full((len(anchors), B), MASK_ID)
        ids[:, 0] = torch.tensor([seq[a] for a in anchors])
        layout = BlockLayout.build(torch.tensor([0, len(seq)]), torch.zeros(len(anchors), dtype=torch.long),
                                   torch.tensor(anchors), B)  # fmt: skip
        hidden = drafter(embed(ids.flatten()), context, layout).view(len(anchors), B, -1)
        want = head(hidden[:, 1:]).argmax(-1)
        proposer = drafter_proposer(target, drafter, len(anchors))
        for row, a in enumerate(anchors):  # the prompt in one go, then the rest in uneven steps with stale tails
            cuts = [0, len(prompts[0]), *range(len(prompts[0]) + 3, a, 5), a]
            for lo, hi in zip(cuts, cuts[1:], strict=False):
                positions = torch.arange(lo, hi + B)[None].clamp(max=len(seq) - 1)
                stale = context[positions[0]].clone()
                stale[hi - lo :] = torch.randn_like(stale[hi - lo :])  # what rejected drafts leave behind
                proposer.add_context(stale[None], positions, torch.tensor([row]))
        got, _ = proposer.propose(torch.tensor([seq[a] for a in anchors]), torch.tensor(anchors),
                                  Chooser(0.0))  # fmt: skip
    assert torch.equal(got, want)


def test_speculative_sampling_rule_keeps_target_distribution():
    """The first committed token of a step is distributed as the target's p, whatever q is; drafts
    are accepted with probability sum_x min(p, q). 20,000 rows in one call, each with its own seed."""
    g = torch.Generator().manual_seed(0)
    V, T, n = 5, 0.7, 20000
    logits = (torch.randn(2, V, generator=g) * 2).expand(n, -1, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, dim=-1)
    p0 = torch.softmax(logits[0, 0] / T, dim=-1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    chooser = Chooser(T, torch.arange(n))
    a, tokens = speculative_accept(drafts, q.expand(n, 1, V), logits, chooser, torch.zeros(n, dtype=torch.long))
    first = tokens[:, 0]
    assert torch.equal(first[a == 1], drafts[a == 1, 0])
    assert torch.allclose(torch.bincount(first, minlength=V) / n, p0, atol=0.015)
    assert abs(a.float().mean() - torch.minimum(p0, q).sum()) < 0.015
    none = torch.full_like(drafts, -1)  # no draft: never accepted, and the token is a sample of p itself
    a, tokens = speculative_accept(none, q.expand(n, 1, V), logits, chooser, torch.zeros(n, dtype=torch.long))
    assert not a.any() and torch.allclose(torch.bincount(tokens[:, 0], minlength=V) / n, p0, atol=0.015)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafts_chosen_at_once_are_the_ones_chosen_one_by_one(temperature):
    """A block's drafts in one choice (`DraftChooser.each`, what the engine uses) are the tokens and
    probabilities of choosing them position by position, each with its own noise key."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 3
    base, seed = torch.tensor([4, 19, 0]), torch.tensor([1, 2, 3])
    one = DraftChooser(Chooser(temperature, seed), base)
    one(logits[:, 0])  # a call before: the block's keys continue from it
    picked = [one(logits[:, i]) for i in range(1, 7)]
    many = DraftChooser(Chooser(temperature, seed), base)
    many(logits[:, 0])
    tokens, probs = many.each(logits[:, 1:])
    assert torch.equal(tokens, torch.stack([t for t, _ in picked], 1))
    if temperature:
        torch.testing.assert_close(probs, torch.stack([q for _, q in picked], 1), rtol=0, atol=0)
        assert len(set(tokens.flatten().tolist())) > 3  # sampled, not the argmax of every row
    else:
        assert probs is None and torch.equal(tokens, logits[:, 1:].argmax(-1))
    assert many.calls == one.calls == 7


def test_tau_and_histogram():
    assert tau([1, 3, 4, 2, 5]) == 3.0
    assert tau([16, 16, 7]) == 13.0
    assert tau([]) == 0.0
    assert histogram([1, 3, 4, 2, 5, 1], 5) == [2, 1, 1, 1, 1]


def test_tau_per_prompt():
    per_prompt = [[1, 3, 4], [16, 16, 7], [], [2]]  # the empty one: the first token ended the generation
    want = statistics.fmean(statistics.fmean(lengths) for lengths in per_prompt if lengths)
    assert tau_per_prompt(per_prompt) == pytest.approx(want)
    assert tau_per_prompt([[], []]) == 0.0


def test_evaluate_reports_taus_speed_and_equality(tmp_path):
    """evaluate() end to end: tau per prompt is the mean of the prompts' own means of the acceptance
    lengths it returns, tau the pooled mean; every output is the target's; a batch of 1 gives the
    same outputs and taus as the default batch."""
    drafter = export_random_drafter(tmp_path / "d", 8)
    cfg = EvalConfig(target=str(TINY_TARGET), drafter=drafter, data=str(PROMPTS), max_new_tokens=24, limit=6)
    r = ev.evaluate(cfg)
    lengths = [s["acceptance_lengths"] for s in r.samples]
    assert len(lengths) == 6 and all(s["same_as_target"] for s in r.samples)
    assert r.tau_per_prompt == pytest.approx(statistics.fmean(statistics.fmean(n) for n in lengths if n))
    assert r.tau == pytest.approx(statistics.fmean(n for sample in lengths for n in sample))
    assert r.new_tokens == sum(s["new_tokens"] for s in r.samples) == r.settings["target_new_tokens"]
    assert r.spec_tok_s > 0 and r.target_tok_s > 0 and r.speedup == pytest.approx(r.spec_tok_s / r.target_tok_s)
    assert r.settings["batch_size"] == 6 and r.settings["engine"] == "SlotTarget"
    one = ev.evaluate(EvalConfig(**{**cfg.__dict__, "batch_size": 1}), baseline=False)
    assert [s["output_ids"] for s in one.samples] == [s["output_ids"] for s in r.samples]
    assert one.tau_per_prompt == r.tau_per_prompt and one.settings["batch_size"] == 1
    assert all(s["same_as_target"] is None for s in one.samples) and one.target_tok_s == 0.0


def _qwen3_tokenizer():
    """The Qwen3-style fixture tokenizer (family_targets.py): no generation markers, and a template
    that honours enable_thinking."""
    import family_targets

    return family_targets.build_tokenizer("qwen3")


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
    off = load_prompts(f, tok, chat_template_kwargs={"enable_thinking": False})
    want = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False),
               add_special_tokens=False)["input_ids"]  # fmt: skip
    assert off == [want] * len(rows)
    assert tok.decode(want).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    default = load_prompts(f, tok)
    assert default == [tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]] * 8
    assert default[0] != off[0]


def test_bad_prompt_rows_and_template_kwargs(tmp_path, tokenizer):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n" + '{"conversations": 3}\n')
    with pytest.raises(DataError, match=r"line 2: wrong type: conversations must be a list"):
        load_prompts(f, tokenizer)
    with pytest.raises(DataError, match="JSON object"):
        load_prompts(f, tokenizer, chat_template_kwargs=["enable_thinking"])


def test_prompts_drop_the_reply(tmp_path, tokenizer):
    f = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "Add 2 and 3."}]
    rows = [{"messages": [*chat, {"role": "assistant", "content": "5"}]}, {"messages": chat}, {"text": "hello"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = load_prompts(f, tokenizer)
    assert a == b == tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert c == tokenizer("hello")["input_ids"]
    assert load_prompts(f, tokenizer, limit=1) == [a]


def test_drafter_for_another_target_is_refused():
    cfg = json.loads((TINY_TARGET / "config.json").read_text())
    dcfg = DrafterConfig.from_target({**cfg, "hidden_size": 32}, target_layer_ids=None, mask_token_id=MASK_ID)
    with pytest.raises(ev.EvalError, match="hidden_size"):
        ev.check_drafter_matches_target(dcfg, cfg)


@pytest.mark.slow  # three CLI evals
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


MT_BENCH_ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["What is 10 x 24?", "Now divide that by 4."]},
    {"question_id": 82, "category": "math", "turns": ["Give me 6 colours in alphabetical order.", "Reverse them."]},
    {"question_id": 83, "category": "stem", "turns": ["Compute 12 times 2."]},
]


def test_mt_bench_turns_follow_the_targets_own_answers(tmp_path, tokenizer, target, stop_ids):
    """MT-Bench's rows as it ships them: turn 2 is asked after the target's own greedy answer to
    turn 1, so its prompt is the chat template of [turn 1, that answer, turn 2], and its output is
    transformers' greedy continuation of that prompt (both computed here, one prompt at a time).
    tau is reported for each turn and overall; first_turn keeps turn 1 only, with the same figures."""
    data = tmp_path / "question.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH_ROWS))
    drafter = export_random_drafter(tmp_path / "d", 8)
    cfg = EvalConfig(target=str(TINY_TARGET), drafter=drafter, data=str(data), max_new_tokens=MAX_NEW, batch_size=2)
    r = ev.evaluate(cfg)
    assert [(s["index"], s["turn"]) for s in r.samples] == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1)]
    lookup_lengths = {1: [], 2: []}  # prompt lookup's, on these prompts and outputs
    for s in r.samples:
        row = MT_BENCH_ROWS[s["index"]]
        chat = [{"role": "user", "content": row["turns"][0]}]
        if s["turn"] == 2:
            first = hf_greedy(target, tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                                   return_dict=True)["input_ids"], MAX_NEW, stop_ids)
            answer = tokenizer.decode([t for t in first if t not in stop_ids], skip_special_tokens=True)
            chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": row["turns"][1]}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert s["prompt_tokens"] == len(prompt)
        assert s["output_ids"] == hf_greedy(target, prompt, MAX_NEW, stop_ids) and s["same_as_target"]
        lookup_lengths[s["turn"]].append(lookup.acceptance_lengths(prompt, s["output_ids"], block_size=8))
    assert r.settings["block_size"] == r.lookup["block_size"] == 8  # a DFlash block: 7 drafts, as lookup's
    assert [t["tau_per_prompt"] for t in r.lookup["turns"]] == [tau_per_prompt(lookup_lengths[t]) for t in (1, 2)]
    assert r.lookup["tau_per_prompt"] == pytest.approx(tau_per_prompt(lookup_lengths[1] + lookup_lengths[2]))
    assert r.lookup["tau_per_prompt"] > 1
    lengths = {t: [s["acceptance_lengths"] for s in r.samples if s["turn"] == t] for t in (1, 2)}
    assert [(t["turn"], t["prompts"]) for t in r.turns] == [(1, 3), (2, 2)]
    for t in r.turns:
        assert t["tau_per_prompt"] == pytest.approx(statistics.fmean(statistics.fmean(n) for n in lengths[t["turn"]]))
        assert t["tau"] == pytest.approx(statistics.fmean(n for steps in lengths[t["turn"]] for n in steps))
    assert r.tau_per_prompt == pytest.approx(statistics.fmean(s["tau"] for s in r.samples))
    assert r.settings["prompts"] == 3 and r.settings["turn_prompts"] == 5
    assert r.steps == sum(t["steps"] for t in r.turns)
    one = ev.evaluate(EvalConfig(**{**cfg.__dict__, "first_turn": True}), baseline=False)
    assert [s["output_ids"] for s in one.samples] == [s["output_ids"] for s in r.samples if s["turn"] == 1]
    assert one.turns == r.turns[:1] and one.tau_per_prompt == r.turns[0]["tau_per_prompt"]
    assert load_prompts(data, tokenizer)[0] == tokenizer.apply_chat_template(
        [{"role": "user", "content": MT_BENCH_ROWS[0]["turns"][0]}], add_generation_prompt=True, return_dict=True
    )["input_ids"]  # fmt: skip


def test_first_difference_is_where_two_outputs_part():
    """Where a speculative output parts from the target alone's: the first unequal token, the
    shorter one's length when one is the other's prefix, None when equal."""
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([4, 2], [1, 2]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
