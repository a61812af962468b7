"""The Triton kernels of `fused` (imported on first use, so that TRITON_INTERPRET set by then
decides whether they run on the GPU or in Triton's interpreter)."""

import triton
import triton.language as tl


@triton.jit
def rstd(X, sx, rows, live, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each row of X (float32 statistics), in BLOCK_K chunks."""
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * sx + k[None, :], mask=live[:, None] & (k[None, :] < K), other=0.0)
        x = x.to(tl.float32)
        total += tl.sum(x * x, 1)
    return 1.0 / tl.sqrt(total / K + eps)


@triton.jit
def product(X, sx, rows, live, scale, NORM, W, cols, used, K: tl.constexpr, HAS_NORM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """X's rows (each normed: scale [rows] and NORM [K], if HAS_NORM) times W's rows `cols`
    [BLOCK_N] (W [n, K] row-major): float32 [rows, BLOCK_N]."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        inside = k < K
        x = tl.load(X + rows[:, None] * sx + k[None, :], mask=live[:, None] & inside[None, :], other=0.0)
        if HAS_NORM:  # transformers' RMSNorm: normed in float32, rounded, then times the weight, rounded
            w_norm = tl.load(NORM + k, mask=inside, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * scale[:, None]).to(x.dtype)
            x = (normed.to(tl.float32) * w_norm[None, :]).to(x.dtype)
        w = tl.load(W + cols[:, None] * K + k[None, :], mask=used[:, None] & inside[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def project(X, sx, NORM, W, BIAS, RES, Y, M, N: tl.constexpr, K: tl.constexpr, eps, HAS_NORM: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Y [M, N] = RES + norm(X) @ W.T + BIAS; with SWIGLU, W holds gate then up ([2N, K]) and
    Y = SiLU(gate) * up."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    used = cols < N
    scale = rstd(X, sx, rows, live, K, eps, BLOCK_M, BLOCK_K) if HAS_NORM else tl.zeros([BLOCK_M], dtype=tl.float32)
    dtype = Y.dtype.element_ty
    y = product(X, sx, rows, live, scale, NORM, W, cols, used, K, HAS_NORM, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(BIAS + cols, mask=used, other=0.0).to(tl.float32)[None, :]
    y = y.to(dtype).to(tl.float32)  # the product's own output, as F.linear gives it
    if SWIGLU:
        up = product(X, sx, rows, live, scale, NORM, W, cols + N, used, K, HAS_NORM, BLOCK_M, BLOCK_N, BLOCK_K)
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
        HAS_QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
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
    scale = rstd(X, K, rows, live, K, eps, BLOCK_M, BLOCK_K)
    lo = product(X, K, rows, live, scale, NORM, W, j * D + half, ones, K, True, BLOCK_M, HALF, BLOCK_K)
    hi = product(X, K, rows, live, scale, NORM, W, j * D + HALF + half, ones, K, True, BLOCK_M, HALF, BLOCK_K)
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
