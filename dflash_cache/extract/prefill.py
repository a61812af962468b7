"""Chunked prefill: a sample too long for one forward runs as consecutive chunks of tokens.

One forward over a long sample holds every layer's activations for all its tokens at once; at
256K tokens of an 8B target they do not fit a GPU, while the key/value cache of the layers that
run does. So a batch whose longest sample exceeds the chunk length runs sample by sample, each
one in chunks of at most that many tokens: every chunk attends to the sample's earlier tokens
through the target's own transformers cache (`target.Carry`), at the positions after them, and
its tapped layers' outputs are those one forward would give, up to the rounding of the other
shapes. A batch that fits runs as one forward, exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from dflash_cache.target.taps import Carry

Target = Callable[..., list[torch.Tensor]]  # input ids [b, T] (and a Carry) -> outputs [b, T, H] each


def forwards(target: Target, inp: torch.Tensor, rows: torch.Tensor, lengths: np.ndarray,
             chunk: int | None) -> Iterator[tuple[int, int, list[torch.Tensor], torch.Tensor]]:  # fmt: skip
    """A batch's forwards: per forward (a, b, outputs, index), where its real tokens are the
    batch's packed rows a:b, in order, and `index` picks them out of the flattened outputs.

    `inp` is the batch right-padded to [n, T] and `rows` the flat indices of its real tokens
    (forward.batch_inputs). With `chunk` None or T <= chunk: one forward, (0, total, target(inp),
    rows). Otherwise each sample alone, in chunks of `chunk` tokens (its last one shorter)."""
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
