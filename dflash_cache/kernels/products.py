"""A decode or verify step's products with a layer's weights as one Triton kernel that reads the
weights before it waits for its input, keeps each token's bits whatever the step holds, and takes
the elementwise work around the product.

At batch 1 a product of SmolLM2-135M reads a few MB of weights, which the GPU's bandwidth covers in
a fraction of the time cuBLAS's one-row kernels take (their tiles are 64 columns wide, so a
576-column product runs on a few of the GPU's SMs; BENCHMARKS.md, "The product kernel"), and a
layer's norms, residual adds and activation are kernels of their own between them. Here a program
owns a few output columns, loads their weights whole, and then takes the step's rows a tile at a
time through the GPU's matrix instructions: each row's sums are the same instructions wherever it
sits in its tile, so a verify step of 17 tokens gives each token the bits a one-token step gives it
(what keeps greedy speculation the target's own decode). Around the product, the kernel does what
the layer does next to it:

- `norm`: transformers' RMSNorm of each input row first (the statistics in float32, the weight
  applied in the input dtype): the norm before the q/k/v and gate/up projections;
- `gated`: the weight is [gate; up] (2N rows) and the output SiLU(gate) * up, N columns;
- `residual`: the output added to the residual stream (the o and down projections);
- `rows_qkv`: the q/k/v projection of a model without q/k norms, its queries and keys rotated
  (RoPE) and its keys and values written into the slot cache, so that the layer's attention
  input is this one kernel.

A program sums K in slices of `ProductTiles.slice_k` (one warp each) side by side: slices of 256
were the fastest of those measured at both of SmolLM2's widths (576, 1,536; BENCHMARKS.md, "The
product kernel").

On a Hopper GPU or newer the kernel launches with programmatic dependent launch: it loads its
weights, which never come from the step, before it waits for the kernel before it, so the read
overlaps that kernel; after that wait it lets the next one launch.

`rows_product` and `rows_qkv` call torch custom ops, so that the decoder's compiled pieces call
each as one opaque kernel and fuse the rest around it. The kernel's tiles and launch are a
`ProductTiles` value that every call takes (the decoder's `KernelSettings` carries it).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.kernels.tiles import DEFAULT_PRODUCT_TILES, ProductTiles
from dflash_cache.kernels.triton_support import available, on_device, pdl_options

MAX_K = 2048  # the widest input row: a program holds its columns' weights whole (measured up to 2048)


def fits(*weights: Tensor) -> bool:
    """Whether the kernel serves products with these weights [N, K] (and inputs of their dtype):
    half precision, where Triton runs, K at most MAX_K."""
    return available() and all(on_device(w) and w.dtype in (torch.float16, torch.bfloat16)
                               and w.shape[-1] <= MAX_K for w in weights)  # fmt: skip


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # T taken as a value: a build for T == 1 made one-token steps slower (BENCHMARKS.md, "The product kernel")
    @triton.jit(do_not_specialize=["T"])
    def rows_times_weights(X, W, BIAS, NORM, RES, Y, T, N, eps, sx, sr, sy, COS, SIN, KC, VC, SLOT, POS, TT, s_slot,
                           s_pos, s_head, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr,
                           COLS: tl.constexpr, SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, NORMED: tl.constexpr,
                           GATED: tl.constexpr, RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HEADS: tl.constexpr,
                           KV_HEADS: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        """Y[t, c] for this program's COLS columns c and every row t < T, BLOCK_T rows at a time. The
        sums over K run as SLICES matrix products side by side, added in a fixed order: one product
        over all of K is a chain of dependent matrix instructions, slow at a wide K (BENCHMARKS.md,
        "The product kernel").

        With ROPE the weight is [q; k; v] of HEADS, KV_HEADS, KV_HEADS heads of D columns, and a
        program owns COLS / 2 columns of a head's first half and their partners in its second half,
        so it rotates its own queries and keys (RoPE by the tables COS and SIN, [rows, D]); it
        writes the queries into Y and the keys and values into the caches KC and VC at each row's
        slot (SLOT, by batch row: TT rows each) and position (POS)."""
        DT = Y.dtype.element_ty
        if ROPE:
            HALF: tl.constexpr = D // 2
            PER: tl.constexpr = HALF // (COLS // 2)  # programs a head
            j = tl.arange(0, COLS)
            second = j // (COLS // 2)  # 0: the head's first half, 1: its second
            head, part = tl.program_id(0) // PER, tl.program_id(0) % PER
            cols = head * D + second * HALF + part * (COLS // 2) + j % (COLS // 2)
        else:
            cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
        live = cols < N
        k = tl.arange(0, KP)
        inside = k < K
        KS: tl.constexpr = KP // SLICES
        w = tl.load(W + cols[:, None] * K + k[None, :], mask=live[:, None] & inside[None, :], other=0.0)
        w = tl.permute(tl.reshape(w, (COLS, SLICES, KS)), (1, 2, 0))
        if GATED:
            u = tl.load(W + (cols + N)[:, None] * K + k[None, :], mask=live[:, None] & inside[None, :], other=0.0)
            u = tl.permute(tl.reshape(u, (COLS, SLICES, KS)), (1, 2, 0))
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=live, other=0.0).to(tl.float32)
            if GATED:
                bias_u = tl.load(BIAS + N + cols, mask=live, other=0.0).to(tl.float32)
        if NORMED:
            g = tl.load(NORM + k, mask=inside, other=0.0)
        if PDL:  # everything above is weights; what follows may come from the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for first in range(0, T, BLOCK_T):
            t = first + tl.arange(0, BLOCK_T)
            real = t < T
            x = tl.load(X + t[:, None] * sx + k[None, :], mask=real[:, None] & inside[None, :], other=0.0)
            if NORMED:  # half-precision arithmetic as float32, rounded as torch rounds it
                h = x.to(tl.float32)
                h = h * tl.rsqrt(tl.sum(h * h, 1) / K + eps)[:, None]
                x = (g.to(tl.float32)[None, :] * h.to(DT).to(tl.float32)).to(DT)
            xs = tl.permute(tl.reshape(x, (BLOCK_T, SLICES, KS)), (1, 0, 2))
            y = tl.sum(tl.dot(xs, w), 0)
            if HAS_BIAS:
                y += bias[None, :]
            if GATED:
                up = tl.sum(tl.dot(xs, u), 0)
                if HAS_BIAS:
                    up += bias_u[None, :]
                gate = y.to(DT).to(tl.float32)
                y = (gate * tl.sigmoid(gate)).to(DT).to(tl.float32) * up.to(DT).to(tl.float32)
            out = real[:, None] & live[None, :]
            if RESIDUAL:
                res = tl.load(RES + t[:, None] * sr + cols[None, :], mask=out, other=0.0)
                y = y.to(DT).to(tl.float32) + res.to(tl.float32)
            if ROPE:  # transformers' x * cos + rotate_half(x) * sin, each op rounded to DT
                y = y.to(DT).to(tl.float32)
                turned = tl.reshape(tl.flip(tl.reshape(y, (BLOCK_T, 2, COLS // 2)), 1), (BLOCK_T, COLS))
                turned = turned * tl.where(second == 0, -1.0, 1.0)[None, :]
                jh = (cols % D)[None, :]
                cos = tl.load(COS + t[:, None] * D + jh, mask=out, other=1.0).to(tl.float32)
                sin = tl.load(SIN + t[:, None] * D + jh, mask=out, other=0.0).to(tl.float32)
                roped = (y * cos).to(DT).to(tl.float32) + (turned * sin).to(DT).to(tl.float32)
                y = tl.where((cols < (HEADS + KV_HEADS) * D)[None, :], roped, y)
                query = (cols < HEADS * D)[None, :]
                tl.store(Y + t[:, None] * sy + cols[None, :], y.to(DT), mask=out & query)
                c = cols - HEADS * D
                value = (c >= KV_HEADS * D)[None, :]
                c = c - tl.where(c >= KV_HEADS * D, KV_HEADS * D, 0)
                slot = tl.load(SLOT + t // TT, mask=real, other=0).to(tl.int64)
                pos = tl.load(POS + t, mask=real, other=0).to(tl.int64)
                at = slot[:, None] * s_slot + pos[:, None] * s_pos + ((c // D) * s_head + c % D)[None, :]
                tl.store(KC + at, y.to(DT), mask=out & ~query & ~value)
                tl.store(VC + at, y.to(DT), mask=out & value)
            else:
                tl.store(Y + t[:, None] * sy + cols[None, :], y.to(DT), mask=out)

    return rows_times_weights


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor | None, residual: Tensor | None,
            eps: float, gated: bool, out: Tensor, tiles: tuple, rope: dict | None = None) -> None:  # fmt: skip
    import triton

    block_t, cols, slice_k, warps, stages, pdl = tiles

    K = x.shape[-1]
    rows = x.reshape(-1, K).contiguous()
    N = weight.shape[0] // (2 if gated else 1)
    res = residual.reshape(-1, N).contiguous() if residual is not None else out
    KP = triton.next_power_of_2(max(K, 16))  # a matrix instruction sums 16 of K at least
    slices = max(KP // slice_k, 1)
    rope = rope or {"COS": out, "SIN": out, "KC": out, "VC": out, "SLOT": out, "POS": out, "TT": 1, "s_slot": 0,
                    "s_pos": 0, "s_head": 0, "HEADS": 0, "KV_HEADS": 0, "D": 0}  # fmt: skip
    _kernel()[(triton.cdiv(N, cols),)](
        rows, weight.contiguous(), bias if bias is not None else out, norm if norm is not None else out, res, out,
        rows.shape[0], N, eps, rows.stride(0), res.stride(0), out.stride(0), **rope, K=K, KP=KP, BLOCK_T=block_t,
        COLS=cols, SLICES=slices, HAS_BIAS=bias is not None, NORMED=norm is not None, GATED=gated,
        RESIDUAL=residual is not None, ROPE=rope["D"] > 0, num_warps=warps or slices, num_stages=stages,
        **pdl_options(x, pdl))  # fmt: skip


def rows_product(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor | None, residual: Tensor | None,
                 eps: float, gated: bool, tiles: ProductTiles = DEFAULT_PRODUCT_TILES) -> Tensor:  # fmt: skip
    """x [..., K] times weight [N, K] (or [2N, K] when `gated`), with the module docstring's norm,
    activation and residual: [..., N]."""
    return _rows_product(x, weight, bias, norm, residual, eps, gated, *tiles.args())


@torch.library.custom_op("dflash_cache::rows_product", mutates_args=())
def _rows_product(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor | None, residual: Tensor | None,
                  eps: float, gated: bool, block_t: int, cols: int, slice_k: int, warps: int, stages: int,
                  pdl: bool) -> Tensor:  # fmt: skip
    N = weight.shape[0] // (2 if gated else 1)
    out = torch.empty(x[..., 0].numel(), N, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, norm, residual, eps, gated, out, (block_t, cols, slice_k, warps, stages, pdl))
    return out.view(*x.shape[:-1], N)


@_rows_product.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor | None, residual: Tensor | None, eps: float,
      gated: bool, block_t: int, cols: int, slice_k: int, warps: int, stages: int, pdl: bool) -> Tensor:  # fmt: skip
    return x.new_empty(*x.shape[:-1], weight.shape[0] // (2 if gated else 1))


def rope_fits(head_dim: int, tiles: ProductTiles = DEFAULT_PRODUCT_TILES) -> bool:
    """Whether `rows_qkv` serves heads of this size: a program's cols / 2 columns divide half a head."""
    return head_dim % tiles.cols == 0


def rows_qkv(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor, eps: float, cos: Tensor, sin: Tensor,
             k_cache: Tensor, v_cache: Tensor, slot: Tensor, positions: Tensor, heads: int, kv_heads: int,
             tiles: ProductTiles = DEFAULT_PRODUCT_TILES) -> Tensor:  # fmt: skip
    """The q/k/v projection of the RMS-normed x [b, T, H] (weight [q; k; v]) with RoPE by cos/sin
    [b, T, d] on the queries and keys: the keys and values written into the caches [S, L, kv_heads,
    d] at slot [b, 1] and positions [b, T], the queries returned, [b, T, heads, d]."""
    return _rows_qkv(x, weight, bias, norm, eps, cos, sin, k_cache, v_cache, slot, positions, heads, kv_heads,
                     *tiles.args())  # fmt: skip


@torch.library.custom_op("dflash_cache::rows_qkv", mutates_args=("k_cache", "v_cache"))
def _rows_qkv(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor, eps: float, cos: Tensor, sin: Tensor,
              k_cache: Tensor, v_cache: Tensor, slot: Tensor, positions: Tensor, heads: int, kv_heads: int,
              block_t: int, cols: int, slice_k: int, warps: int, stages: int, pdl: bool) -> Tensor:  # fmt: skip
    b, T, _ = x.shape
    d = cos.shape[-1]
    out = torch.empty(b * T, heads * d, dtype=x.dtype, device=x.device)
    rope = {"COS": cos.reshape(b * T, d).contiguous(), "SIN": sin.reshape(b * T, d).contiguous(), "KC": k_cache,
            "VC": v_cache, "SLOT": slot.reshape(b).contiguous(), "POS": positions.reshape(b * T).contiguous(),
            "TT": T, "s_slot": k_cache.stride(0), "s_pos": k_cache.stride(1), "s_head": k_cache.stride(2),
            "HEADS": heads, "KV_HEADS": kv_heads, "D": d}  # fmt: skip
    _launch(x, weight, bias, norm, None, eps, False, out, (block_t, cols, slice_k, warps, stages, pdl), rope)
    return out.view(b, T, heads, d)


@_rows_qkv.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor, eps: float, cos: Tensor, sin: Tensor,
      k_cache: Tensor, v_cache: Tensor, slot: Tensor, positions: Tensor, heads: int, kv_heads: int, block_t: int,
      cols: int, slice_k: int, warps: int, stages: int, pdl: bool) -> Tensor:  # fmt: skip
    return x.new_empty(x.shape[0], x.shape[1], heads, cos.shape[-1])
