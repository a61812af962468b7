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
same accounting as ``evaluate.speculative_generate`` (the first token comes from the prefill and
is no step; a step commits its accepted drafts and the target's bonus token, cut at the end of
the output). Pure functions over token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["acceptance_lengths", "propose"]


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


def acceptance_lengths(
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    block_size: int = 16,
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> list[int]:
    """Tokens committed per verification step when a prompt-lookup drafter with block size B
    (B-1 drafts a step) speculates the greedy ``output`` of a target on ``prompt``.

    ``output`` is what greedy decoding generated, stop token and length limit included; its first
    token comes from the prefill, so an output of length 1 has no step."""
    if block_size < 2:
        raise ValueError(f"block size must be >= 2, got {block_size}")
    _check(block_size - 1, max_ngram, min_ngram)
    seq = [*prompt, *output]
    base = len(prompt)
    # propose()'s answer without its backward scan: for each n, every n-gram of the context that
    # something follows, with its latest start (a replay of a long output is then linear in it)
    latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
    indexed = 0  # the context length whose n-grams are in `latest`

    def drafts(end: int) -> list[int]:
        nonlocal indexed
        for n in range(min_ngram, max_ngram + 1):
            for s in range(max(0, indexed - n), end - n):  # the starts s with s + n < end not yet indexed
                latest[n][tuple(seq[s : s + n])] = s
        indexed = end
        for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
            s = latest[n].get(tuple(seq[end - n : end]))
            if s is not None:
                return seq[s + n : min(s + n + block_size - 1, end)]
        return []

    lengths: list[int] = []
    t = 1
    while t < len(output):
        proposed = drafts(base + t)
        a = 0
        while a < len(proposed) and t + a < len(output) and proposed[a] == output[t + a]:
            a += 1
        committed = min(a + 1, len(output) - t)
        lengths.append(committed)
        t += committed
    return lengths


def _check(num_draft: int, max_ngram: int, min_ngram: int) -> None:
    if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need num_draft >= 1 and 1 <= min_ngram <= max_ngram, got {num_draft}, "
                         f"{min_ngram}, {max_ngram}")  # fmt: skip
