"""Greedy decoding's argmax over a vocabulary on a GPU, as one kernel of many short programs.

torch's argmax of one row of 49,152 logits runs in one block of threads, about 13 us of an H200,
once per step of a batch-1 decode (and once per verified block). Here programs of BLOCK_V columns
each keep their largest value and its first index, and the last program of a row to finish (an
atomic count a row) picks the first of those (`_pick_last`, which DSpark's Markov kernel shares).
The index is torch's: the first of equal maxima. The kernel launches with programmatic dependent
launch where the GPU has it (`triton_support.pdl_options`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.kernels.triton_support import available, on_device, pdl_options, zeroed_counts

BLOCK_V = 1024  # columns a program takes, by default (a benchmark passes others)


def fits(x: Tensor) -> bool:
    """Whether the kernels serve this argmax: floating-point values where Triton runs."""
    return available() and on_device(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel() > 0


@functools.cache
def kernels():
    """(block_maxima, _pick_last), compiled on first use."""
    global tl, _pick_last  # module-level names: how kernels, here and in markov.py, find them
    import triton
    import triton.language as tl

    @triton.jit
    def _pick_last(TOP, AT, OUT, COUNT, row, p, top, at, P, BLOCK_P: tl.constexpr):
        """Program p of a row's P stores its block's largest value `top` and its index `at`; the
        row's last program to finish writes OUT[row], the index at the first of the P largest."""
        tl.store(TOP + row * P + p, top)
        tl.store(AT + row * P + p, at)
        tl.debug_barrier()  # the stores before the count that publishes them
        if tl.atomic_add(COUNT + row, 1, sem="acq_rel") == P - 1:
            tl.store(COUNT + row, 0)  # ready for the next launch
            i = tl.arange(0, BLOCK_P)  # .cg: what other programs wrote, from L2
            tops = tl.load(TOP + row * P + i, mask=i < P, other=float("-inf"), cache_modifier=".cg")
            _, j = tl.max(tops, 0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(OUT + row, tl.load(AT + row * P + j, cache_modifier=".cg").to(tl.int64))

    @triton.jit
    def block_maxima(X, TOP, AT, OUT, COUNT, V, s_x, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
        """The largest of columns [p BLOCK_V, (p+1) BLOCK_V) of a row and its first index, into
        `_pick_last`."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row, p = tl.program_id(0), tl.program_id(1)
        v = p * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(X + row.to(tl.int64) * s_x + v, mask=v < V, other=float("-inf")).to(tl.float32)
        top, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        _pick_last(TOP, AT, OUT, COUNT, row, p, top, p * BLOCK_V + at, tl.num_programs(1), BLOCK_P)

    return block_maxima, _pick_last


def scratch(rows: int, programs: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """What `_pick_last` needs for `rows` rows of `programs` blocks: (TOP, AT, OUT [rows] int64,
    COUNT, BLOCK_P)."""
    import triton

    top = torch.empty(rows, programs, dtype=torch.float32, device=device)
    at = torch.empty(rows, programs, dtype=torch.int32, device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    return top, at, out, zeroed_counts("argmax_kernel", device, rows), triton.next_power_of_2(programs)


@torch.library.custom_op("dflash_cache::first_argmax", mutates_args=())
def first_argmax(x: Tensor, block_v: int = BLOCK_V) -> Tensor:
    """x.argmax(-1) for x [rows, V] whose last dimension is contiguous, programs of `block_v` columns."""
    import triton

    rows, V = x.shape
    programs = triton.cdiv(V, block_v)
    top, at, out, count, block_p = scratch(rows, programs, x.device)
    kernels()[0][(rows, programs)](x, top, at, out, count, V, x.stride(0), BLOCK_V=block_v, BLOCK_P=block_p,
                                   num_warps=4, **pdl_options(x))  # fmt: skip
    return out


@first_argmax.register_fake
def _(x: Tensor, block_v: int = BLOCK_V) -> Tensor:
    return x.new_empty(x.shape[0], dtype=torch.int64)


def argmax(x: Tensor, block_v: int = BLOCK_V) -> Tensor:
    """x.argmax(-1), through the kernels where they run (programs of `block_v` columns)."""
    if not fits(x):
        return x.argmax(-1)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return first_argmax(flat, block_v).view(x.shape[:-1])
