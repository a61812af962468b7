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
and replayed (`device_step`). The host runs one step behind the GPU: step n+1 is queued before
step n's tokens are read back, so the bookkeeping of which rows ended (`row_book`, and the copy to
the host) overlaps the next step instead of leaving the GPU idle. A row that ended at step n has
run step n+1 for nothing; its result is dropped, and its slot cache entries are rewritten before
anything reads them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator

import torch

from dflash_cache.generate.device_step import DeviceStep, Pending
from dflash_cache.generate.lookup_mix import LookupMix
from dflash_cache.generate.proposer import BlockProposer
from dflash_cache.generate.requests import ERROR, Completion, Request, StopRule
from dflash_cache.generate.row_book import RowBook
from dflash_cache.generate.targets import Target
from dflash_cache.kernels.settings import DEFAULT_KERNELS, KernelSettings

_END = object()


class Engine:
    """Continuous batching over `target`'s rows; speculative when given a `proposer`.

    `prefill_tokens` bounds a prefill batch (prompt rows times the longest prompt). `graphs`
    captures the step as a CUDA graph (on CUDA, for a target that allows it). `kernels`: how greedy
    tokens are chosen (`KernelSettings.argmax`, `.fused_drafts`)."""

    def __init__(self, target: Target, stop: StopRule, *, temperature: float = 0.0,
                 proposer: BlockProposer | LookupMix | None = None, prefill_tokens: int = 16384,
                 graphs: bool = True, kernels: KernelSettings = DEFAULT_KERNELS) -> None:  # fmt: skip
        self.target, self.stop, self.proposer, self.temperature = target, stop, proposer, temperature
        self.prefill_tokens = prefill_tokens
        if proposer is not None and proposer.slots < target.slots:
            raise ValueError("the proposer needs a place for every target row")
        S, device = target.slots, target.device
        # Every tensor of a step is made in inference mode (here, in the step and in `stream`), so
        # the compiled pieces always see the same kind of tensor and compile once per shape.
        with torch.inference_mode():
            self.last = torch.zeros(S, dtype=torch.long, device=device)
            self.pos = torch.zeros(S, dtype=torch.long, device=device)
            self.seed = torch.zeros(S, dtype=torch.long, device=device)
        self.device_step = DeviceStep(target, proposer, temperature, graphs=graphs, kernels=kernels)
        self.graphable = self.device_step.graphable
        self.book = RowBook(S, stop, speculative=proposer is not None)
        self.steps = 0  # target forwards after the prefill whose results rows committed, over the engine's life
        self.prefill_seconds = 0.0  # host time in prefills (each ends reading its tokens back), over its life
        self._pending: Pending | None = None

    @property
    def rows(self) -> list:
        """What each row holds (`row_book.RowBook.rows`)."""
        return self.book.rows

    @property
    def room(self) -> int:
        """Positions a row needs beyond its prompt and reply: the widest step."""
        return self.device_step.room

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
            live = self.book.live
            free = self.target.slots - live
            if waiting and free and (free * 8 >= self.target.slots or live == 0 or exhausted):
                yield from self._admit(waiting)
                live = self.book.live
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
        free = self.book.free()
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
        first, _ = self.device_step.chooser(self.seed[index]).at(lengths)(logits)
        for row, r in zip(rows, batch, strict=True):
            self.book.start(row, r)
        if self.proposer is not None and states is not None:  # a proposer that reads the target's states
            positions = torch.arange(states.shape[1], device=states.device).expand(len(batch), -1)
            self.proposer.add_context(states, positions, index)
        self.last[index], self.pos[index] = first, lengths
        if self.proposer is not None:
            self.proposer.start(index, [r.prompt for r in batch], first)
        done = []
        for row, token in zip(rows, first.tolist(), strict=True):
            if (c := self.book.commit(row, [token], step=False)) is not None:
                done.append(c)
        self._free()
        self.prefill_seconds += time.perf_counter() - start
        yield from done

    def _advance(self) -> Iterator[Completion]:
        """Queue a step, then commit the one queued before it (a step that is not `graphable` runs
        the host in step with it)."""
        queued = self.device_step.queue(self.last, self.pos, self.seed, self.book.held())
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
        done = [c for i in committed
                if (c := self.book.commit(i, result[i][1 : 1 + result[i][0]], step=True)) is not None]  # fmt: skip
        self._free()
        self.target.keep(self.pos)
        yield from done

    def _free(self) -> None:
        """Rows that ended this step become free (position 0: what they write next is harmless)."""
        ended = self.book.release()
        if ended:
            index = torch.tensor(ended, device=self.pos.device)
            self.pos[index], self.last[index] = 0, 0
