"""DSpark's greedy Markov step on a GPU: a slot's logits, base + W2 z, and their argmax, without
writing the logits.

Drafting a block, DSpark's Markov head runs slot by slot: each slot's rank-r latent z times W2
[V, r] (25 MB at SmolLM2's vocabulary and rank 256), added to the slot's base logits, then the
argmax over the vocabulary picks the token the next slot starts from. As tensor ops that is a
product that writes V logits, and an argmax that reads them back. Here programs of a block of
vocabulary rows each (`MarkovTiles`) compute their logits, rounded as torch rounds them (the
product in float32 to the input dtype, the sum with the base to it again), and keep their maximum
and its first index; the last program of a row to finish picks the first maximum of those
(`argmax_kernel._pick_last`). The token is torch's argmax of the same logits (the first of equal
maxima), up to the product's summation order.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.kernels import argmax as argmax_kernel
from dflash_cache.kernels.tiles import DEFAULT_MARKOV_TILES, MarkovTiles
from dflash_cache.kernels.triton_support import available, on_device


def fits(base: Tensor, w2: Tensor) -> bool:
    """Whether the kernels serve this slot: half-precision logits and W2 where Triton runs."""
    return (available() and on_device(base) and base.dtype in (torch.float16, torch.bfloat16)
            and w2.dtype == base.dtype)  # fmt: skip


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    global _pick_last  # a kernel calls a Triton function by its module-level name
    _pick_last = argmax_kernel.kernels()[1]

    @triton.jit
    def block_maxima(BASE, Z, ROWS, W, TOP, AT, OUT, COUNT, V, R, s_base, s_z, s_rows, BLOCK_V: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
        """The largest logit of rows [p BLOCK_V, (p+1) BLOCK_V) and its first index, into
        `argmax_kernel`'s `_pick_last`. GATHER: the row's latent is Z[ROWS[row]]."""
        row, p = tl.program_id(0), tl.program_id(1)
        latent = tl.load(ROWS + row * s_rows).to(tl.int64) if GATHER else row
        DT = BASE.dtype.element_ty
        v = p * BLOCK_V + tl.arange(0, BLOCK_V)
        live = v < V
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            z = tl.load(Z + latent * s_z + r, mask=r < R, other=0.0).to(tl.float32)
            w = tl.load(W + v[:, None] * R + r[None, :], mask=live[:, None] & (r < R)[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * z[None, :], 1)
        base = tl.load(BASE + row * s_base + v, mask=live, other=0.0).to(tl.float32)
        logit = (acc.to(DT).to(tl.float32) + base).to(DT).to(tl.float32)
        logit = tl.where(live, logit, float("-inf"))
        top, at = tl.max(logit, 0, return_indices=True, return_indices_tie_break_left=True)
        _pick_last(TOP, AT, OUT, COUNT, row, p, top, p * BLOCK_V + at, tl.num_programs(1), BLOCK_P)

    return block_maxima


def markov_argmax(base: Tensor, z: Tensor, w2: Tensor, rows: Tensor | None = None,
                  tiles: MarkovTiles = DEFAULT_MARKOV_TILES) -> Tensor:  # fmt: skip
    """argmax(base + z @ w2.T) per row: base [b, V] (its last dimension contiguous), z [b, r], w2
    [V, r]; [b] int64. With `rows` [b], row i's latent is z[rows[i]] instead: the vanilla head's
    W1[prev], read in place rather than gathered by a kernel of its own. The programs are cut and
    launched by `tiles`."""
    return _markov_argmax(base, z, w2, rows, *tiles.args())


@torch.library.custom_op("dflash_cache::markov_argmax", mutates_args=())
def _markov_argmax(base: Tensor, z: Tensor, w2: Tensor, rows: Tensor | None, block_v: int, block_r: int,
                   warps: int) -> Tensor:  # fmt: skip
    """`markov_argmax` with its tiles as ints: a program takes `block_v` vocabulary rows, `block_r`
    of the rank at once, with `warps` warps."""
    import triton

    b, V = base.shape
    R = w2.shape[1]
    programs = triton.cdiv(V, block_v)
    top, at, out, count, block_p = argmax_kernel.scratch(b, programs, base.device)
    z, w2 = z.contiguous(), w2.contiguous()
    gather = rows is not None
    rows = rows if gather else out  # without GATHER the kernel never reads ROWS: any int64 pointer will do
    _kernels()[(b, programs)](base, z, rows, w2, top, at, out, count, V, R, base.stride(0), z.stride(0),
                              rows.stride(0), BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_P=block_p, GATHER=gather,
                              num_warps=warps)  # fmt: skip
    return out


@_markov_argmax.register_fake
def _(base: Tensor, z: Tensor, w2: Tensor, rows: Tensor | None, block_v: int, block_r: int, warps: int
      ) -> Tensor:  # fmt: skip
    return base.new_empty(base.shape[0], dtype=torch.int64)
