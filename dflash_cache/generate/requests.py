"""What a generation backend is asked and what it answers, and the rules every backend shares:
where a reply ends, and how a token is chosen.

Choosing is a function of (request seed, position, logits) alone, never of which other rows share
the batch or of a generator's state, so a batched run, a one-row run and a resumed run sample the
same tokens: greedy is the argmax, and temperature T draws with the Gumbel-max trick,
``argmax(logits / T + g)``, whose noise ``g`` is a counter-based hash of (seed, position, vocabulary
id). That is an exact sample of ``softmax(logits / T)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dflash_cache.kernels.argmax import argmax as kernel_argmax

STOP, LENGTH, ERROR = "stop", "length", "error"  # why a completion ended

# Streams of the noise, so that the draws of different decisions at one position never coincide.
TARGET_STREAM, DRAFT_STREAM, ACCEPT_STREAM = 1, 2, 3


@dataclass(frozen=True)
class Request:
    """A prompt to continue. `key` is the caller's, returned with the completion; `seed` keys the
    sampling noise (unused when greedy)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    seed: int = 0
    key: Hashable = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if not self.prompt:
            raise ValueError("a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """What a request produced.

    ``ids`` holds the generated tokens, the stop token included when ``finish`` is "stop" (a
    server backend returns text: ``ids`` is then what the target's tokenizer makes of it). ``accepted``
    holds, for speculative decoding, the tokens committed by each verification step (accepted
    drafts plus the target's own token, cut at the stop token and the length limit); the first
    token comes from the prefill and is no step. ``seconds`` runs from the request's admission to
    its last token."""

    request: Request
    ids: list[int]
    finish: str
    accepted: list[int] | None = None
    seconds: float = 0.0
    text: str | None = None
    error: str | None = None
    retry: bool = False  # an error a later run may not meet (a server that failed), not one of the request


    @property
    def reply_ids(self) -> list[int]:
        """The reply without its stop token."""
        return self.ids[:-1] if self.finish == STOP else self.ids


class Backend(Protocol):
    """Generation behind one small interface: regen and eval call only this.

    `stream` pulls requests lazily, admitting each when there is room, and yields completions as
    they finish, in any order. The iterable may yield ``None`` for "nothing to add right now" (a
    caller whose next request waits on a completion); it must end once it has nothing more."""

    def stream(self, requests: Iterable[Request | None]) -> Iterator[Completion]: ...


class StopRule:
    """Where a reply ends: after a stop token (kept) or at the request's length limit."""

    def __init__(self, stop_ids: Iterable[int]):
        self.stop_ids = frozenset(int(t) for t in stop_ids)

    def cut(self, tokens: list[int], room: int) -> tuple[list[int], bool]:
        """The prefix of `tokens` a reply keeps with `room` tokens left, and whether it stopped."""
        for i, t in enumerate(tokens[:room]):
            if t in self.stop_ids:
                return tokens[: i + 1], True
        return tokens[:room], False


# ----------------------------------------------------------------------------- choosing tokens

_M32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (the low 32 bits of int64 arithmetic, exact on CPU and CUDA)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform(seed: Tensor, position: Tensor, stream: int, width: int | None = None) -> Tensor:
    """Uniforms in (0, 1) keyed by (seed, position, stream) per row, [b] or [b, width] (one per
    vocabulary id). seed and position are int64 [b]."""
    h = _hash32((_hash32(seed.long() & _M32) ^ (position.long() & _M32) * 0x9E3779B1 + stream) & _M32)
    if width is not None:
        h = _hash32(h[:, None] ^ torch.arange(width, device=h.device) * 0x85EBCA6B & _M32)
    return ((h.to(torch.float64) + 0.5) / 2**32).to(torch.float32)


def gumbel(seed: Tensor, position: Tensor, stream: int, width: int) -> Tensor:
    return -torch.log(-torch.log(uniform(seed, position, stream, width)))


@dataclass
class Chooser:
    """Picks tokens from logits [b, V] for rows with `seed` [b] at `position` [b] (the position of
    the token being chosen): the argmax at temperature 0, else a Gumbel-max sample. Also returns
    the distribution it sampled from (None when greedy), which speculative sampling needs. `kernel`:
    the argmaxes through the argmax kernel where it runs, else torch's (the same index)."""

    temperature: float
    seed: Tensor | None = None
    stream: int = TARGET_STREAM
    position: Tensor | None = field(default=None)
    kernel: bool = True

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.temperature <= 0:
            return self.argmax(logits), None
        scaled = logits.float() / self.temperature
        tokens = self.argmax(scaled + gumbel(self.seed, self.position, self.stream, scaled.shape[-1]))
        return tokens, torch.softmax(scaled, dim=-1)

    def argmax(self, x: Tensor) -> Tensor:
        """x.argmax(-1)."""
        return kernel_argmax(x) if self.kernel else x.argmax(-1)

    def at(self, position: Tensor, stream: int | None = None) -> Chooser:
        return Chooser(self.temperature, self.seed, self.stream if stream is None else stream, position, self.kernel)


class DraftChooser:
    """The `choose` a drafter family's `draft()` calls once per drafted slot, in order: slot i's
    token sits at `base + 1 + i`, so its noise key advances with each call. `fused`: a greedy
    family may pick its argmax its own way (a fused kernel) instead of calling it."""

    def __init__(self, chooser: Chooser, base: Tensor, fused: bool = True):
        self.chooser, self.base, self.calls = chooser, base, 0
        self.greedy = chooser.temperature <= 0 and fused  # a family may then pick its argmax its own way

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        self.calls += 1
        return self.chooser.at(self.base + self.calls, DRAFT_STREAM)(logits)

    def each(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """What n calls on logits [b, n, V] position by position give, in one choice over all of
        them (one kernel where greedy, instead of n)."""
        b, n, V = logits.shape
        first = self.calls + 1
        self.calls += n
        c = self.chooser
        if c.temperature <= 0:
            return c.argmax(logits), None
        positions = self.base[:, None] + first + torch.arange(n, device=logits.device)
        tokens, probs = Chooser(c.temperature, c.seed.repeat_interleave(n), DRAFT_STREAM, positions.flatten(),
                                c.kernel)(logits.reshape(b * n, V))  # fmt: skip
        return tokens.view(b, n), probs.view(b, n, V)


def speculative_accept(drafts: Tensor, q: Tensor | None, logits: Tensor, chooser: Chooser, base: Tensor
                       ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(accepted draft count a [b], the step's tokens [b, n+1]) for drafts [b, n] proposed after
    positions `base` [b] and verification logits [b, n+1, V] (row k: the target's distribution of
    the token after slot k). Row r commits tokens[r, :a[r] + 1]: its accepted drafts, then the
    target's token at slot a[r] (what follows is unspecified).

    Greedy: the longest prefix of drafts equal to the target's argmaxes, then the target's argmax;
    the tokens are the target's argmaxes themselves (the accepted drafts equal them).
    Sampling (Leviathan et al. 2023): draft k is kept with probability min(1, p_k(d) / q_k(d)); at
    the first rejection the token is drawn from norm(max(0, p - q)), and when all are kept from
    the last p. A proposer without probabilities (q None) counts as certain (q one-hot). A draft of
    -1 (a proposer that had fewer tokens to offer) is never accepted."""
    b, n = drafts.shape
    if chooser.temperature <= 0:
        target = chooser.argmax(logits)
        return (drafts == target[:, :n]).cumprod(1).sum(1), target
    rows = torch.arange(b, device=drafts.device)
    p = torch.softmax(logits.float() / chooser.temperature, dim=-1)
    real, drafts = drafts >= 0, drafts.clamp_min(0)
    if n:
        p_d = p[:, :n].gather(2, drafts[:, :, None]).squeeze(2)
        q_d = torch.ones_like(p_d) if q is None else q.float().gather(2, drafts[:, :, None]).squeeze(2)
        u = torch.stack([uniform(chooser.seed, base + 1 + k, ACCEPT_STREAM) for k in range(n)], 1)
        a = ((u * q_d <= p_d) & real).long().cumprod(1).sum(1)
    else:
        a = torch.zeros(b, dtype=torch.long, device=drafts.device)
    p_a = p[rows, a]
    if n:
        slot = a.clamp(max=n - 1)
        q_a = (torch.nn.functional.one_hot(drafts[rows, slot], p.shape[-1]).float() if q is None
               else q[rows, slot].float()) * real[rows, slot, None]  # fmt: skip
        residual = (p_a - q_a).clamp_min(0)
        empty = residual.sum(-1, keepdim=True) <= 0  # p == q up to rounding: the rejection had no mass
        residual = torch.where(empty, p_a, residual)
        p_a = torch.where((a < n)[:, None], residual, p_a)
    g = gumbel(chooser.seed, base + 1 + a, TARGET_STREAM, p.shape[-1])
    tokens = torch.cat([drafts, drafts.new_zeros(b, 1)], 1)
    tokens.scatter_(1, a[:, None], chooser.argmax(torch.log(p_a) + g)[:, None])  # drafts[:a], then the token at a
    return a, tokens
