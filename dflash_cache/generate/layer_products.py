"""A layer's products, in three kinds (normed, gated, residual), as the decoder's steps run them.

`Products` runs them as tensor ops, which the compiler fuses with the elementwise work around them
(prefills and large batches); `PaddedProducts` pads each row's tokens to one count so a one-token
step and a verify step run cuBLAS at one shape and round alike (targets wider than the product
kernel takes); `KernelProducts` runs a few-row step's products as the product kernel
(`kernels/products.py`), the norm, the SiLU gate or the residual add fused with each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_cache.drafters.rope import rotate
from dflash_cache.generate.slots import write_kv
from dflash_cache.kernels import products as product_kernel
from dflash_cache.kernels.products import rows_product, rows_qkv
from dflash_cache.kernels.settings import DEFAULT_KERNELS
from dflash_cache.kernels.tiles import ProductTiles


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: the statistics in float32 (float64 stays float64), the weight applied
    in the input dtype."""
    h = x if x.dtype == torch.float64 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)



class Products:
    """A layer's kinds of product, as tensor ops: what the compiler fuses with the elementwise work
    around them, and what runs on a CPU and for prefills. The pieces take an instance (`products`),
    whose settings the compiler specialises them on."""

    def normed(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None) -> Tensor:
        """The product of the RMS-normed x."""
        return F.linear(rms_norm(x, norm, eps), w, bias)

    def gated(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None,
              act: Callable[[Tensor], Tensor]) -> Tensor:  # fmt: skip
        """act(gate) * up of the RMS-normed x, w being [gate; up]: the MLP's input side."""
        gate, up = self.normed(x, norm, eps, w, bias).chunk(2, dim=-1)
        return act(gate) * up

    def residual(self, x: Tensor, a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        """The residual stream x plus the product of a: the o and down projections."""
        return x + F.linear(a, w, bias)

    def norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """The final norm."""
        return rms_norm(x, weight, eps)

    def qkv(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None, q_norm: Tensor | None,
            k_norm: Tensor | None, cos: Tensor, sin: Tensor, kv: tuple, heads: int,
            kv_heads: int) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        """`attention_in`'s queries, keys and values (module docstring), the keys and values written
        into the cache."""
        q, k, v = self.project(x, norm, eps, w, bias, q_norm, k_norm, cos, sin, heads, kv_heads)
        write_kv(k, v, *kv)
        return q, k, v

    def project(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None, q_norm: Tensor | None,
                k_norm: Tensor | None, cos: Tensor, sin: Tensor, heads: int,
                kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """`qkv` without the cache writes."""
        b, T, _ = x.shape
        h = self.normed(x, norm, eps, w, bias)
        d = h.shape[-1] // (heads + 2 * kv_heads)
        qk, v = h.view(b, T, heads + 2 * kv_heads, d).split([heads + kv_heads, kv_heads], dim=2)
        if q_norm is not None:
            qk = rms_norm(qk, torch.cat([q_norm.expand(heads, d), k_norm.expand(kv_heads, d)]), eps)
        q, k = rotate(qk, cos, sin).split([heads, kv_heads], dim=2)
        return q, k, v


TENSOR_OPS = Products()


class PaddedProducts(Products):
    """The tensor ops' products and norms with each row's tokens padded to `tokens`, for a few-row
    step the product kernel does not serve (a target wider than `product_kernel.MAX_K`): a
    one-token and a verify step then run every product and every norm at one shape, which cuBLAS
    and the compiled reductions (deterministic: `LayerStack`) round alike, so each token's bits are
    its own as with `KernelProducts`. Unpadded, the norms' kernels change with the step's size, and
    a verify step's logits part from one-token steps' in their last bits."""

    def __init__(self, tokens: int = DEFAULT_KERNELS.padded_tokens) -> None:
        self.tokens = tokens

    def _padded(self, t: Tensor) -> Tensor:
        """t [b, T, ...] as [b, tokens, ...]: each row's T tokens, then zeros."""
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, self.tokens - t.shape[1]))

    @staticmethod
    def _unpadded(t: Tensor, T: int) -> Tensor:
        return t[:, :T]

    def normed(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None) -> Tensor:
        return self._unpadded(TENSOR_OPS.normed(self._padded(x), norm, eps, w, bias), x.shape[1])

    def residual(self, x: Tensor, a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        return x + self._unpadded(F.linear(self._padded(a), w, bias), a.shape[1])

    def norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._unpadded(rms_norm(self._padded(x), weight, eps), x.shape[1])

    def project(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None, q_norm: Tensor | None,
                k_norm: Tensor | None, cos: Tensor, sin: Tensor, heads: int,
                kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        T, pad = x.shape[1], self._padded
        q, k, v = TENSOR_OPS.project(pad(x), norm, eps, w, bias, q_norm, k_norm, pad(cos), pad(sin), heads, kv_heads)
        return self._unpadded(q, T), self._unpadded(k, T), self._unpadded(v, T)


class KernelProducts(Products):
    """The same products as `product_kernel`'s kernels (SiLU only), cut and launched by `tiles`:
    each one kernel, and each token's bits the same whatever the step holds; for a decode or verify
    step's few rows. Without q/k norms (and with `rope`), the q/k/v projection also rotates the
    queries and keys and writes the keys and values into the cache itself, and gives back the
    queries alone."""

    def __init__(self, tiles: ProductTiles = DEFAULT_KERNELS.products,
                 rope: bool = DEFAULT_KERNELS.rope_in_product) -> None:  # fmt: skip
        self.tiles, self.rope = tiles, rope

    def normed(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None) -> Tensor:
        return rows_product(x, w, bias, norm, None, eps, False, self.tiles)

    def gated(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None,
              act: Callable[[Tensor], Tensor]) -> Tensor:  # fmt: skip
        return rows_product(x, w, bias, norm, None, eps, True, self.tiles)

    def residual(self, x: Tensor, a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        return rows_product(a, w, bias, None, x, 0.0, False, self.tiles)

    def qkv(self, x: Tensor, norm: Tensor, eps: float, w: Tensor, bias: Tensor | None, q_norm: Tensor | None,
            k_norm: Tensor | None, cos: Tensor, sin: Tensor, kv: tuple, heads: int,
            kv_heads: int) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        if self.rope and q_norm is None and product_kernel.rope_fits(cos.shape[-1], self.tiles):
            return rows_qkv(x, w, bias, norm, eps, cos, sin, *kv, heads, kv_heads, self.tiles), None, None
        return super().qkv(x, norm, eps, w, bias, q_norm, k_norm, cos, sin, kv, heads, kv_heads)
