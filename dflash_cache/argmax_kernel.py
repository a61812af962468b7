"""Greedy decoding's argmax over a vocabulary on a GPU, in two short kernels instead of one long one.

torch's argmax of one row of 49,152 logits runs in one block of threads, about 13 us of an H200,
once per step of a batch-1 decode (and once per verified block). Here programs of BLOCK_V columns
each keep their largest value and its first index (`block_maxima`), then one program a row picks
the first of those (`first_maximum`, which DSpark's Markov kernel shares). The index is torch's:
the first of equal maxima. Both kernels launch with programmatic dependent launch where the GPU has
it (`triton_support.pdl_options`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.triton_support import available, on_device, pdl_options

BLOCK_V = 1024  # columns a program takes


def fits(x: Tensor) -> bool:
    """Whether the kernels serve this argmax: floating-point values where Triton runs."""
    return available() and on_device(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel() > 0


@functools.cache
def kernels():
    """(block_maxima, first_maximum), compiled on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def block_maxima(X, TOP, AT, V, s_x, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
        """TOP/AT[row, p]: the largest of columns [p BLOCK_V, (p+1) BLOCK_V) and its first index."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row, p = tl.program_id(0), tl.program_id(1)
        v = p * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(X + row.to(tl.int64) * s_x + v, mask=v < V, other=float("-inf")).to(tl.float32)
        top, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        programs = tl.num_programs(1)
        tl.store(TOP + row * programs + p, top)
        tl.store(AT + row * programs + p, p * BLOCK_V + at)

    @triton.jit
    def first_maximum(TOP, AT, OUT, P, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
        """OUT[row]: AT at the first of the row's P largest TOP values."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK_P)
        top = tl.load(TOP + row * P + i, mask=i < P, other=float("-inf"))
        _, j = tl.max(top, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(OUT + row, tl.load(AT + row * P + j).to(tl.int64))

    return block_maxima, first_maximum


def pick(top: Tensor, at: Tensor, pdl: dict | None = None) -> Tensor:
    """[rows] int64: for each row of top/at [rows, P] (a block's largest value, its index), the
    index of the first largest."""
    import triton

    rows, P = top.shape
    out = torch.empty(rows, dtype=torch.int64, device=top.device)
    kernels()[1][(rows,)](top, at, out, P, BLOCK_P=triton.next_power_of_2(P), num_warps=4,
                          **(pdl or {"PDL": False}))  # fmt: skip
    return out


@torch.library.custom_op("dflash_cache::first_argmax", mutates_args=())
def first_argmax(x: Tensor) -> Tensor:
    """x.argmax(-1) for x [rows, V] whose last dimension is contiguous."""
    import triton

    rows, V = x.shape
    programs = triton.cdiv(V, BLOCK_V)
    top = torch.empty(rows, programs, dtype=torch.float32, device=x.device)
    at = torch.empty(rows, programs, dtype=torch.int32, device=x.device)
    pdl = pdl_options(x)
    pdl.pop("NEXT_FIRST", None)
    kernels()[0][(rows, programs)](x, top, at, V, x.stride(0), BLOCK_V=BLOCK_V, num_warps=4, **pdl)
    return pick(top, at, pdl)


@first_argmax.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], dtype=torch.int64)


def argmax(x: Tensor) -> Tensor:
    """x.argmax(-1), through the kernels where they run."""
    if not fits(x):
        return x.argmax(-1)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return first_argmax(flat).view(x.shape[:-1])
