"""The prompt-lookup baseline of the quality run (dflash_cache/generate/lookup.py): its drafts follow the
n-gram rule, and the acceptance it computes from a greedy output alone equals what the real
speculative-decoding loop commits with that drafter plugged in, on a real target."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import ROOT, TINY_TARGET, hf_greedy
from test_evaluate import decode, scripted_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_cache.generate import lookup
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.generate.lookup_mix import ngram_drafts
from dflash_cache.target.load import stop_token_ids


def test_propose_takes_the_longest_most_recent_ngram():
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # suffix (5, 6) last occurred at 4 (followed by 8, 2, ...); the 3-gram (2, 5, 6) never did
    assert lookup.propose(context, 3) == [8, 2, 5]
    assert lookup.propose(context, 3, max_ngram=1) == [8, 2, 5]  # unigram 6 last at 5, same follow-up
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # the trigram wins over a later unigram
    assert lookup.propose([1, 2, 3], 4) == []  # nothing repeats
    assert lookup.propose([4, 4], 5) == [4]  # only what exists after the match
    assert lookup.propose([7], 3) == []
    with pytest.raises(ValueError):
        lookup.propose([1, 2], 0)


def test_acceptance_lengths_by_hand():
    # Output repeats the prompt: after the prefill's first token (3) every step drafts the rest.
    prompt, output = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]
    # t=1: context ends ...7, 1 -> unigram 1 at 0 -> drafts 2..7 (B-1 = 3: 2, 3, 4): all right, +bonus 5
    assert lookup.acceptance_lengths(prompt, output, block_size=4) == [4, 2]
    assert lookup.acceptance_lengths([9], [1, 2, 3], block_size=16) == [1, 1]  # nothing to look up
    assert lookup.acceptance_lengths([9], [1], block_size=16) == []  # the prefill's token only
    lengths = lookup.acceptance_lengths(prompt, output, block_size=16)
    assert sum(lengths) == len(output) - 1  # every token but the first is committed by a step


def test_acceptance_replays_propose_step_by_step():
    """acceptance_lengths indexes the n-grams as the output grows instead of scanning back each step:
    the same drafts as lookup.propose on every prefix, on random small-vocabulary sequences (many
    repeats, ties between n-gram lengths) and every setting."""
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 20])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(30))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(60))]
        B, max_n = rng.choice([2, 4, 16]), rng.choice([1, 2, 3, 4])
        min_n = rng.randint(1, max_n)
        seq, t, expected = [*prompt, *output], 1, []
        while t < len(output):
            drafts = lookup.propose(seq[: len(prompt) + t], B - 1, max_n, min_n)
            a = next((i for i, d in enumerate(drafts) if t + i >= len(output) or d != output[t + i]), len(drafts))
            expected.append(min(a + 1, len(output) - t))
            t += expected[-1]
        assert lookup.acceptance_lengths(prompt, output, block_size=B, max_ngram=max_n, min_ngram=min_n) == expected


def test_acceptance_equals_the_speculative_loop():
    """lookup.acceptance_lengths(prompt, greedy output) is what the engine's speculative loop commits
    per step when lookup.propose is its drafter: the same accounting, checked on the tiny target's
    own decoding (real verification forwards, stop tokens and the length limit), 3 rows at once."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    stop_ids = stop_token_ids(tokenizer, target)
    prompts = load_prompts(ROOT / "data" / "prompts.jsonl", tokenizer, limit=6)
    B = 8
    drafted: list[int] = []

    def lookup_drafter(request, out):
        drafts = lookup.propose([*request.prompt, *out], B - 1)
        drafted.append(len(drafts))
        return drafts

    engine, _ = scripted_engine(target, 3, stop_ids, B, lookup_drafter, None)
    total_steps = 0
    for c in decode(engine, prompts, 40):
        assert c.ids == hf_greedy(target, list(c.request.prompt), 40, stop_ids)
        assert c.accepted == lookup.acceptance_lengths(list(c.request.prompt), c.ids, block_size=B)
        total_steps += len(c.accepted)
    assert total_steps > 20 and max(drafted) == B - 1 and min(drafted) < B - 1  # full, short and empty drafts ran


def test_lookup_on_the_device_drafts_what_propose_does():
    """`lookup_mix.ngram_drafts`, the engine's search over a buffer of rows at different positions
    (with stale tokens past each row's end), gives `lookup.propose`'s drafts on every row, and the
    length of the suffix it matched."""
    rng = random.Random(1)
    for _ in range(300):
        vocab, rows, L = rng.choice([2, 3, 5, 20]), rng.randint(1, 4), 48
        k, max_n = rng.choice([1, 3, 7]), rng.choice([1, 2, 3, 4])
        tokens = torch.tensor([[rng.randrange(vocab) for _ in range(L)] for _ in range(rows)])
        pos = torch.tensor([rng.randrange(L) for _ in range(rows)])
        drafts, matched = ngram_drafts(tokens, pos, k, max_n)
        for r in range(rows):
            context = tokens[r, : pos[r] + 1].tolist()
            want = lookup.propose(context, k, max_n)
            assert drafts[r].tolist() == want + [-1] * (k - len(want))
            assert (int(matched[r]) > 0) == bool(want)
            if want:
                n = int(matched[r])
                assert n == max(m for m in range(1, max_n + 1) if lookup.propose(context, k, m, m))


def test_lookup_mixed_into_a_drafter_takes_lookup_where_its_match_is_long_enough():
    """The mixed walk, step by step: lookup's drafts where its matched suffix has `trust` tokens or
    more, the drafter's accepted count elsewhere."""
    rng = random.Random(2)
    for _ in range(500):
        vocab = rng.choice([2, 3, 5, 20])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(60))]
        B, trust = rng.choice([2, 4, 8]), rng.choice([1, 2, 3, 4])
        drafter = [rng.randrange(B) for _ in range(len(output))]
        seq, t, expected = [*prompt, *output], 1, []
        while t < len(output):
            context = seq[: len(prompt) + t]
            n = next((m for m in range(max(trust, 3), 0, -1) if lookup.propose(context, B - 1, m, m)), 0)
            if n >= trust:
                drafts = lookup.propose(context, B - 1, max(trust, 3))
                a = next((i for i, d in enumerate(drafts) if t + i >= len(output) or d != output[t + i]), len(drafts))
            else:
                a = drafter[t - 1]
            expected.append(min(a + 1, len(output) - t))
            t += expected[-1]
        got = lookup.acceptance_lengths(prompt, output, block_size=B, max_ngram=max(trust, 3), drafter=drafter,
                                        trust=trust)  # fmt: skip
        assert got == expected
