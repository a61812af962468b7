"""Prompt lookup mixed into a block drafter: a step drafts from the context's own n-grams where the
row's last N tokens occurred before, and from the drafter elsewhere.

A small target repeats itself (on MT-Bench's second turns prompt lookup accepts over 4 tokens a
step of SmolLM2-135M's answers), and there prompt lookup (`dflash_cache.generate.lookup`) drafts better than
a trained drafter; on new text the drafter does. The choice is made per row and per step on the
device, from the length of the suffix that lookup matched: N tokens or more, lookup's drafts; else
the drafter's. Both are verified the same way, so greedy output stays the target's own.

Lookup runs on the device over a buffer of each row's tokens (prompt and committed output), with
the semantics of `lookup.propose`: the longest suffix of 1 to max(N, 3) tokens that occurred
earlier with something after it, its latest occurrence, and the drafts that followed it there, cut
at the committed end (-1 past it: no draft). The search is a few fixed-shape tensor operations,
so the step stays one CUDA graph with no host round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dflash_cache.drafters.compile import compiled_or_eager
from dflash_cache.generate.lookup import mixed_max_ngram
from dflash_cache.generate.proposer import BlockProposer


def ngram_drafts(tokens: Tensor, pos: Tensor, num_draft: int, max_ngram: int, min_ngram: int = 1
                 ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(drafts [S, num_draft], -1 where there is none; the matched suffix length [S], 0 for none)
    for rows whose committed tokens are tokens[r, :pos[r] + 1]: `lookup.propose` on each row."""
    S, L = tokens.shape
    # every n compares all L starts (those past pos - n are masked, so the padding is never matched):
    # reductions of one length, where inductor on CUDA fails to fuse L, L - 1, ... past 8K tokens
    padded = torch.nn.functional.pad(tokens, (0, max_ngram))
    s = torch.arange(L, device=tokens.device)
    start = torch.full_like(pos, -1)  # where the matched n-gram's continuation begins
    matched = torch.zeros_like(pos)
    for n in range(min_ngram, max_ngram + 1):  # a longer match found later wins
        hit = s[None] <= (pos - n)[:, None]  # something committed follows the occurrence
        for j in range(n):
            want = tokens.gather(1, (pos - n + 1 + j).clamp_min(0)[:, None])
            hit = hit & (padded[:, j : j + L] == want)
        latest = torch.where(hit, s, -1).amax(1)
        found = latest >= 0
        start = torch.where(found, latest + n, start)
        matched = torch.where(found, n, matched)
    at = start[:, None] + torch.arange(num_draft, device=tokens.device)
    drafts = tokens.gather(1, at.clamp(0, L - 1))
    return torch.where((start[:, None] >= 0) & (at <= pos[:, None]), drafts, -1), matched


class LookupMix:
    """`block`'s proposals, with prompt lookup's instead where a row's last `trust` tokens occurred
    before (module docstring). Greedy only: lookup's drafts carry no probabilities."""

    def __init__(self, block: BlockProposer, trust: int, *, compile: bool = True) -> None:
        if trust < 1:
            raise ValueError(f"lookup needs a suffix of at least 1 token, got {trust}")
        self.block, self.trust, self.max_ngram = block, trust, mixed_max_ngram(trust)
        self.tokens = torch.zeros(block.slots, block.length, dtype=torch.long, device=block.embed.device)
        cuda = compile and self.tokens.is_cuda
        self.search: Callable = compiled_or_eager(ngram_drafts, "prompt lookup") if cuda else ngram_drafts

    graphable = BlockProposer.graphable
    slots = property(lambda self: self.block.slots)
    length = property(lambda self: self.block.length)
    block_size = property(lambda self: self.block.block_size)
    num_drafts = property(lambda self: self.block.num_drafts)

    def add_context(self, states: Tensor, positions: Tensor, rows: Tensor | None = None) -> None:
        self.block.add_context(states, positions, rows)

    @torch.inference_mode()
    def start(self, rows: Tensor, prompts: Sequence[Sequence[int]], first: Tensor) -> None:
        """New requests in `rows`: their prompts, and the first tokens their prefill chose."""
        width = max(map(len, prompts)) + 1
        known = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            known[i, : len(p)] = torch.as_tensor(p)
        known = known.to(self.tokens.device)
        known.scatter_(1, torch.tensor([len(p) for p in prompts], device=known.device)[:, None], first[:, None])
        self.tokens[rows, :width] = known

    def commit(self, tokens: Tensor, pos: Tensor) -> None:
        """A step's tokens [S, m] after positions `pos` (those a row did not commit are written too,
        past its end, where nothing reads them before they are rewritten)."""
        at = (pos[:, None] + 1 + torch.arange(tokens.shape[1], device=pos.device)).clamp(max=self.length - 1)
        self.tokens.scatter_(1, at, tokens)

    @torch.inference_mode()
    def propose(self, last: Tensor, positions: Tensor, choose: Callable) -> tuple[Tensor, Tensor | None]:
        drafts, q = self.block.propose(last, positions, choose)
        if q is not None:
            raise ValueError("prompt lookup mixed into a drafter needs greedy decoding (temperature 0)")
        looked, matched = self.search(self.tokens, positions, drafts.shape[1], self.max_ngram)
        return torch.where((matched >= self.trust)[:, None], looked, drafts), None
