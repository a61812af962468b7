"""Prompt-lookup (n-gram) drafting: the acceptance a drafter that needs no training reaches.

A reference point for a trained DFlash drafter's tau on the same prompts (Saxena 2023, "prompt
lookup decoding"; transformers' ``prompt_lookup_num_tokens`` and vLLM's n-gram proposer work the
same way). Each step the drafter takes the last n tokens of everything so far (prompt and
committed output), finds their most recent earlier occurrence, and proposes the B-1 tokens that
followed it; n runs from ``max_ngram`` down to ``min_ngram`` and the longest n that matches wins.
No match proposes nothing, and the step commits the target's one token.

Under greedy verification the target's output does not depend on the drafter, so the lookup
drafter's tau follows from the prompt and the target's greedy output alone, without running the
target again: :func:`acceptance_lengths` replays speculative decoding over that output with the
same accounting as the engine's speculative decoding (`engine.Engine`: the first token comes from
the prefill and is no step; a step commits its accepted drafts and the target's bonus token, cut
at the end of the output). Pure functions over token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["NgramIndex", "acceptance_lengths", "mixed_max_ngram", "propose", "walk"]


def propose(context: Sequence[int], num_draft: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``num_draft`` tokens that followed the most recent earlier occurrence of the longest
    suffix n-gram of ``context`` (``max_ngram`` >= n >= ``min_ngram``); [] when none occurs."""
    _check(num_draft, max_ngram, min_ngram)
    ctx = list(context)
    end = len(ctx)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = ctx[end - n :]
        # candidate starts s with ctx[s:s+n] == suffix and s + n < end (something follows it)
        for s in range(end - n - 1, -1, -1):
            if ctx[s : s + n] == suffix:
                return ctx[s + n : s + n + num_draft]
    return []


class NgramIndex:
    """The n-grams of one token sequence with their latest starts, indexed as a walk over its
    prefixes asks for them: prompt lookup's proposal after every prefix in time linear in the
    sequence, the answer `propose` gives."""

    def __init__(self, seq: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> None:
        _check(1, max_ngram, min_ngram)
        self.seq, self.max_ngram, self.min_ngram = list(seq), max_ngram, min_ngram
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self.indexed = 0  # the prefix length whose n-grams are in `latest`

    def match(self, end: int, num_draft: int) -> tuple[list[int], int]:
        """(`propose(seq[:end], num_draft)`, the length n of the suffix it matched: 0 for none).
        `end` never decreases from one call to the next."""
        seq = self.seq
        for n in range(self.min_ngram, self.max_ngram + 1):
            for s in range(max(0, self.indexed - n), end - n):  # the starts s with s + n < end not yet indexed
                self.latest[n][tuple(seq[s : s + n])] = s
        self.indexed = end
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            s = self.latest[n].get(tuple(seq[end - n : end]))
            if s is not None:
                return seq[s + n : min(s + n + num_draft, end)], n
        return [], 0


def mixed_max_ngram(trust: int) -> int:
    """The longest suffix lookup matches when mixed into a drafter at `trust`: its own 3, or longer."""
    return max(trust, 3)


def walk(n: int, accepted: Callable[[int], int]) -> list[int]:
    """Tokens committed per verification step over an output of `n` tokens when the step that
    starts after t of them accepts `accepted(t)` drafts: it commits those and the target's own
    token, cut at the end of the output. The first token comes from the prefill and is no step."""
    lengths, t = [], 1
    while t < n:
        committed = min(accepted(t) + 1, n - t)
        lengths.append(committed)
        t += committed
    return lengths


def acceptance_lengths(
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    block_size: int = 16,
    max_ngram: int = 3,
    min_ngram: int = 1,
    drafter: Sequence[int] | None = None,
    trust: int = 1,
) -> list[int]:
    """Tokens committed per verification step when a prompt-lookup drafter with block size B
    (B-1 drafts a step) speculates the greedy ``output`` of a target on ``prompt``.

    ``output`` is what greedy decoding generated, stop token and length limit included; its first
    token comes from the prefill, so an output of length 1 has no step.

    With ``drafter`` (a trained drafter's accepted drafts at every step start: ``drafter[t - 1]``
    after t output tokens), a step takes lookup's drafts only where their match is at least
    ``trust`` tokens long, and the drafter's otherwise: lookup mixed into a drafter
    (`generate.lookup_mix`)."""
    if block_size < 2:
        raise ValueError(f"block size must be >= 2, got {block_size}")
    _check(block_size - 1, max_ngram, min_ngram)
    index = NgramIndex([*prompt, *output], max_ngram, min_ngram)
    base = len(prompt)

    def accepted(t: int) -> int:
        proposed, n = index.match(base + t, block_size - 1)
        if drafter is not None and n < trust:
            return drafter[t - 1]
        a = 0
        while a < len(proposed) and t + a < len(output) and proposed[a] == output[t + a]:
            a += 1
        return a

    return walk(len(output), accepted)


def _check(num_draft: int, max_ngram: int, min_ngram: int) -> None:
    if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need num_draft >= 1 and 1 <= min_ngram <= max_ngram, got {num_draft}, "
                         f"{min_ngram}, {max_ngram}")  # fmt: skip
