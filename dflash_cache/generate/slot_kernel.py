"""A step's attention over the slot cache as one Triton kernel.

A decode or verify step has few queries per row (1, or a block of 16 or 17) against a few hundred
cached keys. Flash attention's split-kv path runs that as two kernels a layer (the splits, then
their combine), about 10 us on an H200 for one row of a small model, more than the layer's four
matrix products take to read their weights. Here one program per (row, key/value head) holds all
of the row's queries of that head's group (grouped-query heads share the keys they read), walks
the row's first `seen` keys in blocks with an online softmax, and writes the result: one kernel,
no split.

One program walks its row's keys alone, so a long buffer read by one query a head is where flash's
split-kv parallelism wins. Measured on an H200 (BENCHMARKS.md, "Batch-1 decoding"), one row: a
decode step is faster here up to about 1024 positions and slower at 4096 (1.86 ms against 0.96
on the SmolLM2 shape); a verify step of 17 tokens is faster at every length up to 4096 (2.09 ms
against 3.10). `fits` keeps to those cases, decided by the step's shapes alone, so that a captured
graph always takes the same path; `slot_attention` checks the first call against the masked path,
as it does flash's.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

MAX_LENGTH = 4096  # buffer positions this kernel serves for steps of several tokens
MAX_DECODE_LENGTH = 1024  # and for one-token steps
BLOCK_N = 64


@functools.cache
def available() -> bool:
    """Whether Triton imports (it ships with torch's CUDA builds)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fits(query: Tensor, keys: Tensor) -> bool:
    """Whether the kernel serves this step: a half-precision query [b, T, heads, d] on a GPU, a head
    size of 16 to 256 (a power of two), and a buffer of at most MAX_LENGTH positions for T > 1,
    MAX_DECODE_LENGTH for T = 1 (module docstring)."""
    d, T, length = query.shape[-1], query.shape[1], keys.shape[1]
    return (available() and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and keys.dtype == query.dtype and 16 <= d <= 256 and d & (d - 1) == 0
            and length <= (MAX_LENGTH if T > 1 else MAX_DECODE_LENGTH))  # fmt: skip


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attend(Q, K, V, Out, SLOT, SEEN, sq_b, sq_t, sq_h, sk_s, sk_l, sk_h, so_b, so_t, so_h, T, scale,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):  # fmt: skip
        b, kvh, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # the group's query rows: token m // G, head m % G
        t, h = m // G, kvh * G + m % G
        real = m < T * G
        d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=real[:, None], other=0.0)
        slot, seen = tl.load(SLOT + b), tl.load(SEEN + b)
        limit = seen - T + 1 + t if CAUSAL else tl.zeros([BLOCK_M], dtype=tl.int32) + seen
        k_base = K + slot.to(tl.int64) * sk_s + kvh * sk_h
        v_base = V + slot.to(tl.int64) * sk_s + kvh * sk_h
        top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 below
        for start in range(0, seen, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            inside = n < seen
            k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(n[None, :] < limit[:, None], s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            p = tl.exp2(s - new_top[:, None])
            alpha = tl.exp2(top - new_top)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            top = new_top
        out = acc / total[:, None]
        tl.store(Out + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :], out.to(Out.dtype.element_ty),
                 mask=real[:, None])  # fmt: skip

    return attend


def attention(query: Tensor, keys: Tensor, values: Tensor, slot: Tensor, seen: Tensor, causal: bool,
              scale: float) -> Tensor:  # fmt: skip
    """query [b, T, heads, d] (the last dimension contiguous) of batch row i against the first
    seen[i] positions of slot slot[i] of keys/values [S, L, kv_heads, d]; causal: query t sees
    seen[i] - T + 1 + t of them. Returns [b, T, heads, d]."""
    b, T, heads, d = query.shape
    kv_heads = keys.shape[2]
    groups = heads // kv_heads
    rows = T * groups
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    out = torch.empty(b, T, heads, d, dtype=query.dtype, device=query.device)
    if query.stride(-1) != 1:
        query = query.contiguous()
    grid = (b, kv_heads, -(-rows // block_m))
    _kernel()[grid](query, keys, values, out, slot, seen, *query.stride()[:3], *keys.stride()[:3], *out.stride()[:3],
                    T, scale, G=groups, D=d, BLOCK_M=block_m, BLOCK_N=BLOCK_N, CAUSAL=causal and T > 1,
                    num_warps=4)  # fmt: skip
    return out
