"""The Triton kernels of `fused` (imported on first use, so that TRITON_INTERPRET set by then
decides whether they run on the GPU or in Triton's interpreter)."""

import triton
import triton.language as tl


@triton.jit
def chunk(X, sx, rows, live, NORM, W, cols, cols2, used, k0, K: tl.constexpr, HAS_NORM: tl.constexpr,
          TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Inputs k0..k0+BLOCK_K of X's rows (times the norm's weight, if HAS_NORM) against W's rows
    `cols` (and `cols2`, if TWO): the two partial products and the rows' partial sums of squares."""
    k = k0 + tl.arange(0, BLOCK_K)
    inside = k < K
    x = tl.load(X + rows[:, None] * sx + k[None, :], mask=live[:, None] & inside[None, :], other=0.0)
    xf = x.to(tl.float32)
    square = tl.sum(xf * xf, 1)
    if HAS_NORM:
        x = (xf * tl.load(NORM + k, mask=inside, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
    w = tl.load(W + cols[:, None] * K + k[None, :], mask=used[:, None] & inside[None, :], other=0.0)
    first = tl.dot(x, tl.trans(w))
    second = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TWO:
        w2 = tl.load(W + cols2[:, None] * K + k[None, :], mask=used[:, None] & inside[None, :], other=0.0)
        second = tl.dot(x, tl.trans(w2))
    return first, second, square


@triton.jit
def products(X, sx, rows, live, NORM, W, cols, cols2, used, K: tl.constexpr, eps, HAS_NORM: tl.constexpr,
             TWO: tl.constexpr, UNROLL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):  # fmt: skip
    """X's rows, RMS-normed if HAS_NORM, times W's rows `cols` (and `cols2`): float32 [rows,
    BLOCK_N] each, in one pass over the inputs (unrolled if UNROLL, so that every load can be in
    flight at once). The norm's statistics come from the same pass, so its 1/RMS scales the sums
    after the product: (x / rms(x) * w) @ W.T as ((x * w) @ W.T) / rms(x)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, K, BLOCK_K):
            a, b, sq = chunk(X, sx, rows, live, NORM, W, cols, cols2, used, k0, K, HAS_NORM, TWO, BLOCK_M, BLOCK_N,
                             BLOCK_K)  # fmt: skip
            acc, acc2, total = acc + a, acc2 + b, total + sq
    else:
        for k0 in range(0, K, BLOCK_K):
            a, b, sq = chunk(X, sx, rows, live, NORM, W, cols, cols2, used, k0, K, HAS_NORM, TWO, BLOCK_M, BLOCK_N,
                             BLOCK_K)  # fmt: skip
            acc, acc2, total = acc + a, acc2 + b, total + sq
    if HAS_NORM:
        scale = 1.0 / tl.sqrt(total / K + eps)
        acc, acc2 = acc * scale[:, None], acc2 * scale[:, None]
    return acc, acc2


@triton.jit
def project(X, sx, NORM, W, BIAS, RES, Y, M, N: tl.constexpr, K: tl.constexpr, eps, HAS_NORM: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, UNROLL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Y [M, N] = RES + norm(X) @ W.T + BIAS; with SWIGLU, W holds gate then up ([2N, K]) and
    Y = SiLU(gate) * up."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    used = cols < N
    dtype = Y.dtype.element_ty
    y, up = products(X, sx, rows, live, NORM, W, cols, cols + N, used, K, eps, HAS_NORM, SWIGLU, UNROLL, BLOCK_M,
                     BLOCK_N, BLOCK_K)  # fmt: skip
    if HAS_BIAS:
        y += tl.load(BIAS + cols, mask=used, other=0.0).to(tl.float32)[None, :]
    y = y.to(dtype).to(tl.float32)  # the product's own output, as F.linear gives it
    if SWIGLU:
        if HAS_BIAS:
            up += tl.load(BIAS + N + cols, mask=used, other=0.0).to(tl.float32)[None, :]
        up = up.to(dtype).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    if HAS_RES:
        y += tl.load(RES + rows[:, None] * N + cols[None, :], mask=live[:, None] & used[None, :]).to(tl.float32)
    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(dtype), mask=live[:, None] & used[None, :])


@triton.jit
def qkv(X, NORM, W, BIAS, QN, KN, COS, SIN, Q, KBUF, VBUF, SLOT, POS, M, T, sk_s, sk_l, sk_h, eps,
        K: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_QK_NORM: tl.constexpr, UNROLL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Head j's [rows, D] of the fused q/k/v product of norm(X), in its two rotary halves: a
    query head normed, rotated and stored in Q [M, HEADS, D]; a key head normed, rotated and
    written at its row's slot and position of KBUF; a value head written to VBUF."""
    j = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < M
    HALF: tl.constexpr = D // 2
    half = tl.arange(0, HALF)
    ones = half < HALF
    dtype = Q.dtype.element_ty
    lo, hi = products(X, K, rows, live, NORM, W, j * D + half, j * D + HALF + half, ones, K, eps, True, True, UNROLL,
                      BLOCK_M, HALF, BLOCK_K)  # fmt: skip
    if HAS_BIAS:
        lo += tl.load(BIAS + j * D + half).to(tl.float32)[None, :]
        hi += tl.load(BIAS + j * D + HALF + half).to(tl.float32)[None, :]
    lo, hi = lo.to(dtype).to(tl.float32), hi.to(dtype).to(tl.float32)
    both = live[:, None] & ones[None, :]
    b = rows // T
    slot = tl.load(SLOT + b, mask=live, other=0).to(tl.int64)
    where = tl.load(POS + rows, mask=live, other=0).to(tl.int64)
    if j < HEADS + KV_HEADS:
        if HAS_QK_NORM:
            r = 1.0 / tl.sqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / D + eps)
            if j < HEADS:
                w_lo, w_hi = tl.load(QN + half).to(tl.float32), tl.load(QN + HALF + half).to(tl.float32)
            else:
                w_lo, w_hi = tl.load(KN + half).to(tl.float32), tl.load(KN + HALF + half).to(tl.float32)
            lo = (lo * r[:, None]).to(dtype).to(tl.float32) * w_lo[None, :]
            hi = (hi * r[:, None]).to(dtype).to(tl.float32) * w_hi[None, :]
            lo, hi = lo.to(dtype).to(tl.float32), hi.to(dtype).to(tl.float32)
        at = rows[:, None] * D + half[None, :]
        cos_lo = tl.load(COS + at, mask=both, other=0.0).to(tl.float32)
        cos_hi = tl.load(COS + at + HALF, mask=both, other=0.0).to(tl.float32)
        sin_lo = tl.load(SIN + at, mask=both, other=0.0).to(tl.float32)
        sin_hi = tl.load(SIN + at + HALF, mask=both, other=0.0).to(tl.float32)
        lo, hi = lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi
        if j < HEADS:
            out = Q + rows[:, None] * (HEADS * D) + j * D + half[None, :]
        else:
            out = KBUF + slot[:, None] * sk_s + where[:, None] * sk_l + (j - HEADS) * sk_h + half[None, :]
    else:
        out = VBUF + slot[:, None] * sk_s + where[:, None] * sk_l + (j - HEADS - KV_HEADS) * sk_h + half[None, :]
    tl.store(out, lo.to(dtype), mask=both)
    tl.store(out + HALF, hi.to(dtype), mask=both)
