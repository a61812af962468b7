"""A small step's projections as Triton kernels whose rows come out the same whatever the step's
row count, with the work around each product fused into it.

Greedy speculative decoding commits the target's own tokens only if a verify step (a block of
tokens a row) computes each token's logits bit for bit as a plain step (one token a row) would.
cuBLAS picks its kernel, and so its summation order, by the number of rows, and a 17-row product
rounds differently from a 1-row one: over a long answer some argmax flips and the speculative output
parts from the target alone's. Here a step of up to MAX_ROWS rows runs every projection with one
kernel configuration chosen from the weight's shape alone, over row tiles of 16 that never mix, so
a row's result does not depend on the rows beside it (`slot_kernel` does the same for attention).

A layer is five kernels, against ten for the compiled pieces with cuBLAS:

- `qkv`: the input norm, the fused q/k/v product, the q/k norms, RoPE, the queries out and the keys
  and values into the cache (one program a head, its two rotary halves as two products);
- the slot attention (`slot_kernel`);
- `project(..., residual=x)`: the output projection and the residual;
- `project(..., norm=..., swiglu=True)`: the post-attention norm, the gate/up product and SiLU(gate) * up;
- `project(..., residual=x)`: the down projection and the residual.

The last norm and the LM head are one more `project`. A product reads its inputs in one pass and
takes an input norm's statistics from the same pass: (x / rms(x) * w) @ W.T as ((x * w) @ W.T) / rms(x), rather
than waiting on another kernel. Otherwise the arithmetic is transformers': each product rounded to
the model's dtype before the RoPE, residual or activation that follows it, statistics in float32.

On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1), which the tests use to
check them against the compiled pieces.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.generate.slot_kernel import available, on_device

MAX_ROWS = 64  # rows (batch rows x tokens) a step may have for these kernels; beyond, cuBLAS is faster
BLOCK_M = 16  # the row tile: fixed, so that a row's arithmetic never depends on the step's rows


def serves(x: Tensor, rows: int) -> bool:
    """Whether these kernels run a step of `rows` rows whose weights are like `x` (on a GPU, or
    on a CPU under Triton's interpreter)."""
    return available() and on_device(x) and rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16,
                                                                            torch.float32)  # fmt: skip


def fits(layer, heads: int, kv_heads: int, act) -> bool | None:
    """Whether a `decoder._Layer` of this geometry can run these kernels: SiLU gating and a head
    size of 32 to 256, a power of two (each program holds a head's two rotary halves). None: yes,
    to be checked against the compiled layers on first use; False: no."""
    import torch.nn.functional as F

    d = layer.qkv.shape[0] // (heads + 2 * kv_heads)
    ok = act is F.silu and 32 <= d <= 256 and d & (d - 1) == 0 and layer.qkv.shape[1] >= 16
    return None if ok else False


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of a product with n outputs over k inputs: from the weight's
    shape alone, never the rows (module docstring). Narrow blocks where n is small, so that a
    one-row product still spreads its weight reads over the chip's 132 multiprocessors. Measured on
    an H200 (BENCHMARKS.md, "Batch-1 decoding"): short inputs (SmolLM2's 576 and 1536) are fastest
    in small chunks through a pipelined loop, long ones (4096) in chunks of 512, unrolled."""
    block_k = 64 if k <= 1024 else 128 if k <= 2048 else 512
    block_n = 64 if n >= 64 * 264 else 32 if n >= 32 * 132 else 16
    return block_n, block_k, 4, 4


def _unrolled(k: int, block_k: int) -> bool:
    """Whether a product's loop is unrolled: chunks of 512, eight at most."""
    return block_k >= 512 and -(-k // block_k) <= 8


@functools.cache
def _kernels():
    from dflash_cache.generate import fused_kernels

    return fused_kernels.project, fused_kernels.qkv


def _grid_m(rows: int) -> int:
    return -(-rows // BLOCK_M)


def project(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm: Tensor | None = None, eps: float = 0.0,
            residual: Tensor | None = None, swiglu: bool = False) -> Tensor:  # fmt: skip
    """x [M, K] -> [M, N]: residual + norm(x) @ weight.T + bias, where norm is transformers' RMSNorm
    with weight `norm`; with `swiglu`, weight [2N, K] holds the gate's rows then the up
    projection's, and the result is SiLU(gate) * up."""
    M, K = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(M, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config(weight.shape[0], K)
    grid = (-(-n // block_n), _grid_m(M))
    _kernels()[0][grid](x, x.stride(0), norm if norm is not None else x, weight, bias if bias is not None else x,
                        residual if residual is not None else x, out, M, n, K, eps, HAS_NORM=norm is not None,
                        HAS_BIAS=bias is not None, HAS_RES=residual is not None, SWIGLU=swiglu,
                        UNROLL=_unrolled(K, block_k), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                        num_warps=warps, num_stages=stages)  # fmt: skip
    return out


def qkv(x: Tensor, norm: Tensor, weight: Tensor, bias: Tensor | None, q_norm: Tensor | None, k_norm: Tensor | None,
        cos: Tensor, sin: Tensor, k_buf: Tensor, v_buf: Tensor, slot: Tensor, positions: Tensor, eps: float,
        heads: int, kv_heads: int) -> Tensor:  # fmt: skip
    """`decoder.attention_in` in one kernel: x [b*T, H] (row-major) -> queries [b, T, heads, d]; the
    keys and values go to slot[i] (int, [b]) of k_buf/v_buf [S, L, kv_heads, d] at positions [b, T]
    (both contiguous); cos/sin [b, T, d] are the rotary tables of those positions."""
    M, H = x.shape
    b, T = positions.shape
    d = weight.shape[0] // (heads + 2 * kv_heads)
    q = torch.empty(b, T, heads, d, dtype=x.dtype, device=x.device)
    _, block_k, warps, stages = config(weight.shape[0], H)
    grid = (heads + 2 * kv_heads, _grid_m(M))
    _kernels()[1][grid](x, norm, weight, bias if bias is not None else x, q_norm if q_norm is not None else x,
                        k_norm if k_norm is not None else x, cos.contiguous(), sin.contiguous(), q, k_buf, v_buf,
                        slot, positions, M, T, *k_buf.stride()[:3], eps, K=H, HEADS=heads, KV_HEADS=kv_heads, D=d,
                        HAS_BIAS=bias is not None, HAS_QK_NORM=q_norm is not None, UNROLL=_unrolled(H, block_k),
                        BLOCK_M=BLOCK_M, BLOCK_K=block_k, num_warps=warps, num_stages=stages)  # fmt: skip
    return q
