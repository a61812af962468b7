"""Chunked prefill: a sample too long for one forward runs as consecutive chunks of tokens.

One forward over a long sample holds every layer's activations for all its tokens at once; at
256K tokens of an 8B target they do not fit a GPU, while the key/value cache of the layers that
run does. So a batch whose longest sample exceeds the chunk length runs sample by sample, each
one in chunks of at most that many tokens: every chunk attends to the sample's earlier tokens
through the target's own transformers cache (`target.Carry`), at the positions after them, and
its tapped layers' outputs are those one forward would give, up to the rounding of the other
shapes. A batch that fits runs as one forward, exactly as before.

Without --prefill-chunk a process finds the chunk it needs (`Chunking`): a sample alone whose one
forward runs out of GPU memory runs again in chunks, and so does every longer sample after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from dflash_cache.core.errors import ExtractError
from dflash_cache.target.taps import Carry

Target = Callable[..., list[torch.Tensor]]  # input ids [b, T] (and a Carry) -> outputs [b, T, H] each


def forwards(target: Target, inp: torch.Tensor, rows: torch.Tensor, lengths: np.ndarray,
             chunk: int | None) -> Iterator[tuple[int, int, list[torch.Tensor], torch.Tensor]]:  # fmt: skip
    """A batch's forwards: per forward (a, b, outputs, index), where its real tokens are the
    batch's packed rows a:b, in order, and `index` picks them out of the flattened outputs.

    `inp` is the batch right-padded to [n, T] and `rows` the flat indices of its real tokens
    (forward.batch_inputs). With `chunk` None or T <= chunk: one forward, (0, total, target(inp),
    rows). Otherwise each sample alone, in chunks of `chunk` tokens (its last one shorter).
    A forward that runs out of GPU memory raises ExtractError with the setting that helps."""
    try:
        yield from _forwards(target, inp, rows, lengths, chunk)
    except torch.OutOfMemoryError as e:
        raise ExtractError(out_of_memory(inp.shape[0], inp.shape[1], int(lengths.max()), chunk)) from e


def out_of_memory(samples: int, width: int, longest: int, chunk: int | None) -> str:
    """What to change when a forward of `samples` samples padded to `width` tokens ran out of GPU
    memory: chunk long samples, a smaller chunk, or fewer tokens a batch."""
    if chunk is not None and width > chunk:
        return (f"the GPU ran out of memory in a {chunk:,}-token chunk of a sample of up to {longest:,} tokens: "
                f"pass a smaller --prefill-chunk (e.g. {max(chunk // 2, 1)}); the key/value cache of the sample's "
                "earlier tokens must still fit")  # fmt: skip
    where = f"the GPU ran out of memory in a forward of {samples} sample{'s' * (samples > 1)} of {width:,} tokens"
    if samples > 1:
        return f"{where}: lower --token-budget (this forward held {samples * width:,} padded tokens)"
    return (f"{where}: pass --prefill-chunk {suggested_chunk(width)} to run samples longer than that in chunks (the "
            "cache is the same up to rounding)")  # fmt: skip


def suggested_chunk(width: int) -> int:
    """The chunk for a sample of `width` tokens that one forward could not hold: at most half of it,
    a power of two, at most 16,384 (the chunk the 256K-token figures in BENCHMARKS.md ran at)."""
    return min(16384, 1 << max(width // 2, 1).bit_length() - 1)


class Chunking:
    """One process's prefill chunk: `tokens` (--prefill-chunk); where none is set and `adapt`
    holds, none until a sample alone runs out of GPU memory in one forward, which then runs in
    `suggested_chunk` tokens a chunk, as does every sample longer than that after it, and `say`
    tells so once. The ranks of a sharded copy must run the same forwards, so they do not adapt."""

    def __init__(self, tokens: int | None = None, adapt: bool = False,
                 say: Callable[[str], None] = lambda text: None) -> None:  # fmt: skip
        self.tokens, self.adapt, self.say = tokens, adapt, say

    @classmethod
    def of(cls, chunk: Chunking | int | None) -> Chunking:
        return chunk if isinstance(chunk, Chunking) else cls(chunk)

    def forwards(self, target: Target, inp: torch.Tensor, rows: torch.Tensor,
                 lengths: np.ndarray) -> Iterator[tuple[int, int, list[torch.Tensor], torch.Tensor]]:  # fmt: skip
        """`forwards` at this chunk; a sample alone that one forward cannot hold, in chunks."""
        if self.adapt and self.tokens is None and len(lengths) == 1:
            outputs = _whole(target, inp)
            if outputs is not None:
                yield 0, int(rows.shape[0]), outputs, rows
                return
            self.tokens = suggested_chunk(inp.shape[1])
            self.say(f"a sample of {int(lengths[0]):,} tokens ran out of GPU memory in one forward: it and every "
                     f"sample longer than {self.tokens:,} tokens after it run in chunks of {self.tokens:,} tokens "
                     f"(--prefill-chunk {self.tokens} starts that way; the cache is the same up to rounding)")
        yield from forwards(target, inp, rows, lengths, self.tokens)


def _whole(target: Target, inp: torch.Tensor) -> list[torch.Tensor] | None:
    """`target(inp)`, or None where it ran out of GPU memory, once that memory is free again (the
    failed forward's tensors go with its traceback, at the end of the except clause)."""
    try:
        return target(inp)
    except torch.OutOfMemoryError:
        pass
    torch.cuda.empty_cache()
    return None


def _forwards(target: Target, inp: torch.Tensor, rows: torch.Tensor, lengths: np.ndarray,
              chunk: int | None) -> Iterator[tuple[int, int, list[torch.Tensor], torch.Tensor]]:  # fmt: skip
    if chunk is None or inp.shape[1] <= chunk:
        yield 0, int(rows.shape[0]), target(inp), rows
        return
    offset = 0
    for i, n in enumerate(lengths.tolist()):
        for a, b, outputs in sample_chunks(target, inp[i : i + 1, :n], chunk):
            yield offset + a, offset + b, outputs, torch.arange(b - a, device=inp.device)
        offset += n


def sample_chunks(target: Target, ids: torch.Tensor, chunk: int) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
    """One sample's ids [1, n] as chunks of `chunk` tokens through one cache: (a, b, outputs of
    tokens a:b). The cache is freed when the last chunk is done (or the caller stops early)."""
    carry = Carry()
    n = ids.shape[1]
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        yield a, b, target(ids[:, a:b], carry=carry)
