"""The embedded backends: continuous batching of requests over a target's rows, decoding plainly or
speculatively with a block proposer.

Every row of the target holds one request. A step advances every row at once: one token per row
(plain decoding), or a drafted block verified in one target forward, of which each row commits its
own accepted prefix and the target's next token (speculative decoding; rows accept different
counts and stay apart, each at its own position). A row that ends frees its place, and the next
waiting prompts are prefilled into the free rows in token-budget batches, so the GPU keeps a full
batch while the requests' lengths differ. Which token a row commits depends only on its request
(prompt, seed) and never on its neighbours (`requests.Chooser`), so the output equals one-row
decoding token for token, and greedy speculative decoding equals plain greedy decoding.

On a GPU the whole step (draft, verify, accept, context update) is captured once as a CUDA graph
and replayed, which removes the per-layer launch overhead that dominates small models. The host
runs one step behind the GPU: step n+1 is queued before step n's tokens are read back, so the
bookkeeping of which rows ended (and the copy to the host) overlaps the next step instead of
leaving the GPU idle. A row that ended at step n has run step n+1 for nothing; its result is
dropped, and its slot cache entries are rewritten before anything reads them.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash_cache.drafters.compile import compiled_or_eager
from dflash_cache.generate.lookup_mix import LookupMix
from dflash_cache.generate.proposer import BlockProposer
from dflash_cache.generate.requests import ERROR, LENGTH, STOP, Chooser, Completion, DraftChooser, Request, StopRule
from dflash_cache.generate.requests import speculative_accept as accept
from dflash_cache.generate.targets import Target

_END = object()
_ENDED = object()  # a row whose request ended in this step, freed after it


@dataclass
class _Row:
    request: Request
    out: list[int] = field(default_factory=list)
    accepted: list[int] | None = None
    started: float = field(default_factory=time.perf_counter)


class _Graph:
    """`fn(*inputs)` captured as a CUDA graph on its first call, replayed after; the outputs are the
    graph's own tensors, overwritten by the next replay. The graph reads and updates the first
    call's input tensors in place: a later call with those same tensors copies nothing. Falls back
    to eager once, with a warning, if capture fails."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]]):
        self.fn, self.graph, self.inputs, self.outputs, self.broken = fn, None, None, None, False

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if self.broken:
            return self.fn(*inputs)
        if self.graph is None:
            try:
                self._capture(inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, loudly
                self.broken = True
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly", stacklevel=2)
                return self.fn(*inputs)
        for mine, given in zip(self.inputs, inputs, strict=True):
            if mine is not given:
                mine.copy_(given)
        self.graph.replay()
        return self.outputs

    def _capture(self, inputs: tuple[Tensor, ...]) -> None:
        self.inputs = inputs
        before = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the same cache writes a real step makes, so harmless
            for _ in range(2):
                self.fn(*inputs)
            for t, saved in zip(inputs, before, strict=True):  # but not the step's own advance
                t.copy_(saved)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: an unreachable engine freed then would return its
        # pinned host buffers, and the host allocator's event calls would invalidate the capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph):
                self.outputs = self.fn(*self.inputs)
        finally:
            if collecting:
                gc.enable()
        self.graph = graph


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
class _Pending:
    """A step queued on the device whose result the host has not read: where its copy lands, the
    event that marks the copy done, and which request each row held when it was queued."""

    result: Tensor
    done: torch.cuda.Event | None
    rows: list


class Engine:
    """Continuous batching over `target`'s rows; speculative when given a `proposer`.

    `prefill_tokens` bounds a prefill batch (prompt rows times the longest prompt). `graphs`
    captures the step as a CUDA graph (on CUDA, for a target that allows it)."""

    def __init__(self, target: Target, stop: StopRule, *, temperature: float = 0.0,
                 proposer: BlockProposer | LookupMix | None = None, prefill_tokens: int = 16384,
                 graphs: bool = True) -> None:  # fmt: skip
        self.target, self.stop, self.proposer, self.temperature = target, stop, proposer, temperature
        self.prefill_tokens = prefill_tokens
        if proposer is not None and proposer.slots < target.slots:
            raise ValueError("the proposer needs a place for every target row")
        S, device = target.slots, target.device
        # Every tensor of a step is made in inference mode (here and in `stream`), so the compiled
        # pieces always see the same kind of tensor and compile once per shape.
        with torch.inference_mode():
            self.last = torch.zeros(S, dtype=torch.long, device=device)
            self.pos = torch.zeros(S, dtype=torch.long, device=device)
            self.seed = torch.zeros(S, dtype=torch.long, device=device)
            self._ahead = torch.arange(self.room, device=device)  # the verify step's offsets from a row's position
        self.chooser = Chooser(temperature, self.seed)
        step = self._speculative_step if proposer is not None else self._plain_step
        # A step that runs Python bookkeeping per call (transformers' own cache, a proposer that
        # reads the host's rows) is never captured, since a replay would skip it, and never runs
        # ahead of the host.
        self.graphable = target.graphable and getattr(proposer, "graphable", True)
        self._step = _Graph(step) if graphs and device.type == "cuda" and self.graphable else step
        # The step's bookkeeping, compiled where the step is captured: a few fused kernels in
        # place of some twenty small ones, each a launch in every replay.
        fused = isinstance(self._step, _Graph)
        self._accept = compiled_or_eager(accept, "the acceptance") if fused and temperature <= 0 else accept
        self._advanced = compiled_or_eager(_advanced, "the step's advance") if fused else _advanced
        self._verify_input = compiled_or_eager(_verify_input, "the verify input") if fused else _verify_input
        self.rows: list[_Row | None] = [None] * S
        self.steps = 0  # target forwards after the prefill whose results rows committed, over the engine's life
        self.prefill_seconds = 0.0  # host time in prefills (each ends reading its tokens back), over its life
        self._pending: _Pending | None = None
        self._results: list[Tensor] = []  # two host buffers (pinned on a GPU) that steps' results alternate in

    @property
    def room(self) -> int:
        """Positions a row needs beyond its prompt and reply: the widest step."""
        return 1 + (self.proposer.block_size if self.proposer is not None else 0)

    @property
    def _top(self) -> int:
        """The last position a step may start at: its widest write still fits the row."""
        return self.target.length - self.room

    # ------------------------------------------------------------------ the two steps
    # Each advances `last` and `pos` in place and returns [S, 1 + m]: row r commits the counts[r]
    # tokens after its count (`_advance`), all of it inside the step's CUDA graph.

    def _plain_step(self, last: Tensor, pos: Tensor, seed: Tensor) -> Tensor:
        logits, _ = self.target.step(last[:, None], pos[:, None])
        chooser = Chooser(self.temperature, seed)
        if self.temperature > 0:  # the sampled token's noise is keyed by its position
            chooser = chooser.at(pos + 1)
        token, _ = chooser(logits[:, 0])
        return self._advanced(last, pos, token[:, None], None, self._top)

    def _speculative_step(self, last: Tensor, pos: Tensor, seed: Tensor) -> Tensor:
        chooser = Chooser(self.temperature, seed)
        drafts, q = self.proposer.propose(last, pos, DraftChooser(chooser, pos))  # -1: no draft there
        ids, positions = self._verify_input(last, drafts, pos, self._ahead)
        logits, states = self.target.step(ids, positions)
        a, tokens = self._accept(drafts, q, logits, chooser, pos)  # drafts[:a], then the target's own token
        if states is not None:
            self.proposer.add_context(states, positions)
        self.proposer.commit(tokens, pos)
        return self._advanced(last, pos, tokens, a, self._top)

    # ------------------------------------------------------------------ scheduling

    @torch.inference_mode()
    def stream(self, requests: Iterable[Request | None]) -> Iterator[Completion]:
        """Generate `requests` (see `requests.Backend`), yielding completions as rows end."""
        source = iter(requests)
        waiting: deque[Request] = deque()
        exhausted = False
        self._pending = None
        while True:
            while not exhausted and len(waiting) < 2 * self.target.slots:
                r = next(source, _END)
                if r is _END:
                    exhausted = True
                elif r is None:
                    break
                else:
                    waiting.append(r)
            live = self.target.slots - self.rows.count(None)
            free = self.target.slots - live
            if waiting and free and (free * 8 >= self.target.slots or live == 0 or exhausted):
                yield from self._admit(waiting)
                live = self.target.slots - self.rows.count(None)
            if live == 0:
                self._pending = None  # a step queued after every row had ended: nothing to read
                if exhausted and not waiting:
                    return
                if not waiting:
                    raise RuntimeError("the request source is waiting on completions, but none is in flight")
                continue
            yield from self._advance()

    def _admit(self, waiting: deque[Request]) -> Iterator[Completion]:
        """Prefill waiting prompts into the free rows, in token-budget batches of similar length."""
        free = [i for i, r in enumerate(self.rows) if r is None]
        take = sorted((waiting.popleft() for _ in range(min(len(free), len(waiting)))), key=lambda r: len(r.prompt))
        batch: list[Request] = []
        for r in take:
            if len(r.prompt) + r.max_new_tokens + self.room > self.target.length:
                why = (f"prompt ({len(r.prompt)} tokens) and max_new_tokens ({r.max_new_tokens}) exceed the "
                       f"{self.target.length} positions of a row")
                yield Completion(r, [], ERROR, error=why)
                continue
            if batch and (len(batch) + 1) * len(r.prompt) > self.prefill_tokens:
                yield from self._prefill(batch, free)
                batch = []
            batch.append(r)
        if batch:
            yield from self._prefill(batch, free)

    def _prefill(self, batch: list[Request], free: list[int]) -> Iterator[Completion]:
        start = time.perf_counter()
        rows = [free.pop(0) for _ in batch]
        logits, states = self.target.prefill(rows, [r.prompt for r in batch])
        index = torch.tensor(rows, device=self.pos.device)
        lengths = torch.tensor([len(r.prompt) for r in batch], device=self.pos.device)
        self.seed[index] = torch.tensor([r.seed for r in batch], device=self.pos.device)
        first, _ = Chooser(self.temperature, self.seed[index]).at(lengths)(logits)
        for row, r in zip(rows, batch, strict=True):
            self.rows[row] = _Row(r, accepted=[] if self.proposer is not None else None)
        if self.proposer is not None and states is not None:  # a proposer that reads the target's states
            positions = torch.arange(states.shape[1], device=states.device).expand(len(batch), -1)
            self.proposer.add_context(states, positions, index)
        self.last[index], self.pos[index] = first, lengths
        if self.proposer is not None:
            self.proposer.start(index, [r.prompt for r in batch], first)
        done = []
        for row, token in zip(rows, first.tolist(), strict=True):
            if (c := self._commit(row, [token], step=False)) is not None:
                done.append(c)
        self._free()
        self.prefill_seconds += time.perf_counter() - start
        yield from done

    def _advance(self) -> Iterator[Completion]:
        """Queue a step, then commit the one queued before it (a step that is not `graphable` runs
        the host in step with it)."""
        queued = self._queue()
        pending = queued
        if self.graphable:
            pending, self._pending = self._pending, queued
        if pending is None:
            return
        if pending.done is not None:
            pending.done.synchronize()
        committed = [i for i, row in enumerate(pending.rows) if row is not None and self.rows[i] is row]
        if committed:
            self.steps += 1
        result = pending.result.tolist()
        done = [c for i in committed if (c := self._commit(i, result[i][1 : 1 + result[i][0]], step=True)) is not None]
        self._free()
        self.target.keep(self.pos)
        yield from done

    def _queue(self) -> _Pending:
        """Queue a step and the copy of its result to the host (one copy a step)."""
        out = self._step(self.last, self.pos, self.seed)
        if not self._results:
            self._results = [torch.empty(out.shape, dtype=out.dtype, pin_memory=out.is_cuda) for _ in range(2)]
        self._results.reverse()  # the other buffer than the step still pending, if one is
        result = self._results[0]
        result.copy_(out, non_blocking=True)
        done = None
        if out.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return _Pending(result, done, [r if isinstance(r, _Row) else None for r in self.rows])

    def _commit(self, i: int, tokens: list[int], *, step: bool) -> Completion | None:
        """Row i commits `tokens` (cut at a stop token and the length limit); returns its
        completion when that ended it."""
        row = self.rows[i]
        kept, stopped = self.stop.cut(tokens, row.request.max_new_tokens - len(row.out))
        row.out.extend(kept)
        if step and row.accepted is not None:
            row.accepted.append(len(kept))
        if not stopped and len(row.out) < row.request.max_new_tokens:
            return None
        self.rows[i] = _ENDED
        return Completion(row.request, row.out, STOP if stopped else LENGTH, row.accepted,
                          time.perf_counter() - row.started)  # fmt: skip

    def _free(self) -> None:
        """Rows that ended this step become free (position 0: what they write next is harmless)."""
        ended = [i for i, r in enumerate(self.rows) if r is _ENDED]
        if ended:
            index = torch.tensor(ended, device=self.pos.device)
            self.pos[index], self.last[index] = 0, 0
            for i in ended:
                self.rows[i] = None
