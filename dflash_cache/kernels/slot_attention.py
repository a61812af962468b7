"""A step's attention over the slot cache as one Triton kernel whose every query comes out the same
whatever else the step holds.

A decode or verify step has few queries per row (1, or a block of 8 to 17) against a few hundred
to a few thousand cached keys. One program per (row, key/value head, tile of 16 query rows, piece
of `split` keys) holds its queries of that head's group (grouped-query heads share the keys they
read) and walks its piece's keys in blocks of `block_n` with an online softmax (`AttentionTiles`); the last piece of a
tile to finish merges the pieces (an atomic count a tile), so a layer's attention is one kernel at
every context, where flash attention's split-kv path takes two.

**The same bits in a decode and a verify step.** Greedy speculative decoding commits the target's
own tokens only if a verify step (a block of tokens a row) computes each token's logits bit for bit
as a plain step (one token a row) does: otherwise, over a long answer, some argmax flips and the
speculative output parts from the target alone's. Choosing the kernel by the step's shape (flash
for one-token steps over long buffers, this kernel for blocks) did exactly that. Here a query's
arithmetic depends only on its own row and position:

- the tile of query rows is always 16 and the key blocks always `block_n`, whatever the step's size;
- the keys are cut at fixed positions (0, `split`, 2 `split`...) and the pieces a row's keys reach
  are merged in order, whichever program merges them. A query that sees `split` keys or fewer gets
  the one-piece result bit for bit either way (the merge's weights are exactly 1 and 0), and one
  that sees more always goes through the merge. A row whose keys all fit in the first piece has
  its output written by that piece's program, which is what the merge would make of it;
- key blocks past what a query sees change nothing (their weights are exactly 0, the running
  maximum stays), so queries that see fewer keys than others in their tile are unaffected.

**A sliding layer** (`window` W, a drafter's) sees the keys within W positions of each query. The
kernel then visits only the pieces (and, uncut, the key blocks) from the one holding the row's
lowest visible key on: its programs and its reads are O(W + T) a row, whatever the buffer holds.

`slots.slot_attention` checks the kernel's first call against the masked path, as it does flash's.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.kernels.tiles import DEFAULT_ATTENTION_TILES, AttentionTiles
from dflash_cache.kernels.triton_support import available, on_device, pdl_options, zeroed_counts


def fits(query: Tensor, keys: Tensor) -> bool:
    """Whether the kernels serve this step: a half-precision query [b, T, heads, d] on a GPU and a
    head size of 16 to 256 (a power of two)."""
    d = query.shape[-1]
    return (available() and on_device(query) and query.dtype in (torch.float16, torch.bfloat16)
            and keys.dtype == query.dtype and 16 <= d <= 256 and d & (d - 1) == 0)  # fmt: skip


def pieces(length: int, tiles: AttentionTiles = DEFAULT_ATTENTION_TILES) -> int:
    """How many pieces the kernels cut a buffer of `length` positions into (1: it is walked whole)."""
    return -(-length // tiles.split)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attend(Q, K, V, Out, ACC, STAT, COUNT, SLOT, SEEN, sq_b, sq_t, sq_h, sk_s, sk_l, sk_h, so_b, so_t, so_h, T,
               tiles, splits, scale, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """Without SPLIT: the attention of one tile of query rows over all the keys its row sees,
        into Out. With SPLIT: over keys [s SPLIT, (s+1) SPLIT), the unnormalised sum, its running
        maximum and its total into ACC and STAT, and the row's last piece to finish (COUNT counts
        them) merges the pieces into Out (the first piece writes Out itself when the row's keys all
        fit in it). With WINDOW (> 0) a query sees only the keys within WINDOW positions of its own,
        and the pieces are counted from the one of the row's lowest visible key. With PDL it may
        start before the kernel before it ends, and waits for it first (everything it reads may
        come from it)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b, kvh, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tile, s = p % tiles, p // tiles
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # the group's query rows: token m // G, head m % G
        t, h = m // G, kvh * G + m % G
        real = m < T * G
        d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=real[:, None], other=0.0)
        slot, seen = tl.load(SLOT + b), tl.load(SEEN + b).to(tl.int32)  # seen: int32 or int64
        limit = seen - T + 1 + t if CAUSAL else tl.zeros([BLOCK_M], dtype=tl.int32) + seen
        low, lowest = 0, 0  # each query's lowest visible key, and the row's
        if WINDOW > 0:
            at = seen - T + t  # the queries' positions
            low, limit = at - WINDOW + 1, tl.minimum(limit, at + WINDOW)
            lowest = tl.maximum(seen - T - WINDOW + 1, 0)
        k_base = K + slot.to(tl.int64) * sk_s + kvh * sk_h
        v_base = V + slot.to(tl.int64) * sk_s + kvh * sk_h
        top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 below
        start, stop = lowest // BLOCK_N * BLOCK_N, seen
        if SPLIT > 0:
            start = (lowest // SPLIT + s) * SPLIT
            stop = tl.minimum(seen, start + SPLIT)
        for first in range(start, stop, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            inside = n < seen
            k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
            x = tl.dot(q, tl.trans(k)) * qk_scale
            visible = n[None, :] < limit[:, None]
            if WINDOW > 0:
                visible = visible & (n[None, :] >= low[:, None])
            x = tl.where(visible, x, float("-inf"))
            new_top = tl.maximum(top, tl.max(x, 1))
            safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # a query that sees none of these keys yet
            weight = tl.exp2(x - safe[:, None])
            alpha = tl.exp2(top - safe)
            total = total * alpha + tl.sum(weight, 1)
            v = tl.load(v_base + n[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(weight.to(v.dtype), v)
            top = new_top
        whole = s == 0  # this program saw every key its row sees: its output is the answer
        if SPLIT > 0:
            pieces = (seen + SPLIT - 1) // SPLIT - lowest // SPLIT  # the pieces the row's keys reach
            whole = whole & (pieces <= 1)  # what the merge makes of one piece, bit for bit
            if (pieces > 1) & (s < pieces):
                group = (b * tl.num_programs(1) + kvh) * tiles + tile
                i = tl.arange(0, BLOCK_M)
                tl.store(ACC + ((group * splits + s) * BLOCK_M + i[:, None]) * D + d[None, :], acc)
                tl.store(STAT + ((group * splits + s) * 2) * BLOCK_M + i, top)
                tl.store(STAT + ((group * splits + s) * 2 + 1) * BLOCK_M + i, total)
                tl.debug_barrier()  # every thread's stores before the count that publishes them
                if tl.atomic_add(COUNT + group, 1, sem="acq_rel") == pieces - 1:  # the last: merge, in order
                    tl.store(COUNT + group, 0)  # ready for the next launch
                    stat = STAT + group * splits * 2 * BLOCK_M + i  # .cg: other programs' writes, from L2
                    top = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                    for r in range(0, pieces):
                        top = tl.maximum(top, tl.load(stat + r * 2 * BLOCK_M, cache_modifier=".cg"))
                    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
                    total = tl.zeros([BLOCK_M], dtype=tl.float32)
                    for r in range(0, pieces):
                        w = tl.exp2(tl.load(stat + r * 2 * BLOCK_M, cache_modifier=".cg") - top)
                        total += tl.load(stat + (r * 2 + 1) * BLOCK_M, cache_modifier=".cg") * w
                        partial = tl.load(ACC + ((group * splits + r) * BLOCK_M + i[:, None]) * D + d[None, :],
                                          cache_modifier=".cg")  # fmt: skip
                        acc += partial * w[:, None]
                    whole = pieces > 1  # true: this program writes the merged output
        if whole:
            out = acc / total[:, None]
            tl.store(Out + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
                     out.to(Out.dtype.element_ty), mask=real[:, None])  # fmt: skip

    return attend


def attention(query: Tensor, keys: Tensor, values: Tensor, slot: Tensor, seen: Tensor, causal: bool,
              scale: float, tiles: AttentionTiles = DEFAULT_ATTENTION_TILES,
              window: int | None = None) -> Tensor:  # fmt: skip
    """query [b, T, heads, d] (the last dimension contiguous) of batch row i against the first
    seen[i] positions of slot slot[i] of keys/values [S, L, kv_heads, d]; causal: query t sees
    seen[i] - T + 1 + t of them; window W: only those j with |(seen[i] - T + t) - j| < W, query
    t's position being seen[i] - T + t. Returns [b, T, heads, d]."""
    b, T, heads, d = query.shape
    kv_heads, length = keys.shape[2], keys.shape[1]
    groups = heads // kv_heads
    block_m, block_n = tiles.block_m, tiles.block_n
    row_tiles = -(-T * groups // block_m)
    splits = pieces(length, tiles)
    out = torch.empty(b, T, heads, d, dtype=query.dtype, device=query.device)
    if query.stride(-1) != 1:
        query = query.contiguous()
    split = tiles.split if splits > 1 else 0
    if window is not None and split:  # a row's window of W - 1 + T keys reaches at most this many pieces
        splits = min(splits, (window + T - 2) // split + 2)
    if split % block_n:
        raise ValueError(f"slot attention kernel: split ({tiles.split}) must be a multiple of block_n ({block_n})")
    acc = stat = count = out
    if split:
        acc = torch.empty(b * kv_heads * row_tiles * splits * block_m * d, dtype=torch.float32, device=query.device)
        stat = torch.empty(b * kv_heads * row_tiles * splits * 2 * block_m, dtype=torch.float32, device=query.device)
        count = zeroed_counts("slot_kernel", query.device, b * kv_heads * row_tiles)
    _kernels()[(b, kv_heads, row_tiles * splits)](
        query, keys, values, out, acc, stat, count, slot, seen, *query.stride()[:3], *keys.stride()[:3],
        *out.stride()[:3], T, row_tiles, splits, scale, G=groups, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal and T > 1, SPLIT=split, WINDOW=window or 0, num_warps=tiles.warps,
        **pdl_options(query, tiles.pdl))  # fmt: skip
    return out
