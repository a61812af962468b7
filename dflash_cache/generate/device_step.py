"""The engine's step on the device: every row of the target advances at once, by one token (plain
decoding) or by its accepted prefix of a drafted block verified in one target forward
(speculative decoding), and the step's result starts its way to the host.

A step reads and updates three device tensors per row, its last committed token, its position and
its seed, and returns [rows, 1 + m]: row r commits the count in its first column of the tokens
after it. Nothing in it reads the host, so on a GPU it is captured once as a CUDA graph
(`cuda_graph.Graph`) and replayed, its small bookkeeping compiled into a few fused kernels. Its
result is copied to one of two pinned host buffers without waiting: the host reads step n's while
step n+1 runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_cache.drafters.compile import compiled_or_eager
from dflash_cache.generate.cuda_graph import Graph
from dflash_cache.generate.lookup_mix import LookupMix
from dflash_cache.generate.proposer import BlockProposer
from dflash_cache.generate.requests import Chooser, DraftChooser
from dflash_cache.generate.requests import speculative_accept as accept
from dflash_cache.generate.targets import Target
from dflash_cache.kernels.settings import KernelSettings


def _advanced(last: Tensor, pos: Tensor, tokens: Tensor, accepted: Tensor | None, top: int) -> Tensor:
    """Row r commits tokens[r, :accepted[r] + 1] (one token where `accepted` is None): its last
    token and position move on (in place), and the step's result for the host is [count, tokens]
    per row. Positions stop at `top`, so that a row that ended runs its one extra step (the host is
    a step behind) inside its slot."""
    counts = torch.ones_like(pos) if accepted is None else accepted + 1
    last.copy_(tokens.gather(1, (counts - 1)[:, None]).squeeze(1))
    pos.add_(counts).clamp_(max=top)
    return torch.cat([counts[:, None], tokens], 1)


def _verify_input(last: Tensor, drafts: Tensor, pos: Tensor, ahead: Tensor) -> tuple[Tensor, Tensor]:
    """The verify forward's ids [b, 1 + n] (the last token, then the drafts; -1, no draft, read as
    token 0) and their positions, from `ahead` = arange(>= 1 + n)."""
    ids = torch.cat([last[:, None], drafts.clamp_min(0)], 1)
    return ids, pos[:, None] + ahead[: ids.shape[1]]


@dataclass
class Pending:
    """A step queued on the device whose result the host has not read: where its copy lands, the
    event that marks the copy done, and which request each row held when it was queued."""

    result: Tensor
    done: torch.cuda.Event | None
    rows: list


class DeviceStep:
    """The step of `target`'s rows, speculative over `proposer` when given one (module docstring).
    `graphs` captures it as a CUDA graph (on CUDA, where target and proposer allow it); `kernels`
    picks how greedy tokens are chosen."""

    def __init__(self, target: Target, proposer: BlockProposer | LookupMix | None, temperature: float, *,
                 graphs: bool, kernels: KernelSettings) -> None:  # fmt: skip
        self.target, self.proposer, self.temperature, self.kernels = target, proposer, temperature, kernels
        with torch.inference_mode():  # as every tensor of a step (`Engine`)
            self._ahead = torch.arange(self.room, device=target.device)  # the verify step's offsets from a position
        step = self._speculative if proposer is not None else self._plain
        # A step that runs Python bookkeeping per call (transformers' own cache, a proposer that
        # reads the host's rows) is never captured, since a replay would skip it, and never runs
        # ahead of the host.
        self.graphable = target.graphable and getattr(proposer, "graphable", True)
        self.fn = step
        self.run = Graph(step) if graphs and target.device.type == "cuda" and self.graphable else step
        # The step's bookkeeping, compiled where the step is captured: a few fused kernels in
        # place of some twenty small ones, each a launch in every replay.
        fused = isinstance(self.run, Graph)
        self._accept = compiled_or_eager(accept, "the acceptance") if fused and temperature <= 0 else accept
        self._advanced = compiled_or_eager(_advanced, "the step's advance") if fused else _advanced
        self._verify_input = compiled_or_eager(_verify_input, "the verify input") if fused else _verify_input
        self._results: list[Tensor] = []  # two host buffers (pinned on a GPU) that steps' results alternate in

    @property
    def room(self) -> int:
        """Positions a row needs beyond its prompt and reply: the widest step."""
        return 1 + (self.proposer.block_size if self.proposer is not None else 0)

    @property
    def top(self) -> int:
        """The last position a step may start at: its widest write still fits the row."""
        return self.target.length - self.room

    def chooser(self, seed: Tensor) -> Chooser:
        """How the rows of `seed` choose their tokens."""
        return Chooser(self.temperature, seed, kernel=self.kernels.argmax)

    # Each step advances `last` and `pos` in place and returns [S, 1 + m]: row r commits the counts[r]
    # tokens after its count (`_advanced`), all of it inside the step's CUDA graph.

    def _plain(self, last: Tensor, pos: Tensor, seed: Tensor) -> Tensor:
        logits, _ = self.target.step(last[:, None], pos[:, None])
        chooser = self.chooser(seed)
        if self.temperature > 0:  # the sampled token's noise is keyed by its position
            chooser = chooser.at(pos + 1)
        token, _ = chooser(logits[:, 0])
        return self._advanced(last, pos, token[:, None], None, self.top)

    def _speculative(self, last: Tensor, pos: Tensor, seed: Tensor) -> Tensor:
        chooser = self.chooser(seed)
        drafts, q = self.proposer.propose(last, pos, DraftChooser(chooser, pos, self.kernels.fused_drafts))  # -1: none
        ids, positions = self._verify_input(last, drafts, pos, self._ahead)
        logits, states = self.target.step(ids, positions)
        a, tokens = self._accept(drafts, q, logits, chooser, pos)  # drafts[:a], then the target's own token
        if states is not None:
            self.proposer.add_context(states, positions)
        self.proposer.commit(tokens, pos)
        return self._advanced(last, pos, tokens, a, self.top)

    def queue(self, last: Tensor, pos: Tensor, seed: Tensor, rows: list) -> Pending:
        """Queue a step and the copy of its result to the host (one copy a step); `rows`: which
        request each row holds (None: none), for the host to match the result with."""
        out = self.run(last, pos, seed)
        if not self._results:
            self._results = [torch.empty(out.shape, dtype=out.dtype, pin_memory=out.is_cuda) for _ in range(2)]
        self._results.reverse()  # the other buffer than the step still pending, if one is
        result = self._results[0]
        result.copy_(out, non_blocking=True)
        done = None
        if out.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return Pending(result, done, rows)
