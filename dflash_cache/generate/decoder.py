"""A Llama-family decoder's forward over a `SlotCache`, in few kernels.

Decoding a small model at batch 1 costs the number of kernels a step launches, not the bytes it
reads: a step of SmolLM2-135M reads 0.27 GB of weights (0.06 ms on an H200) but transformers'
layers launch about 45 kernels each. This forward reads the weights of a loaded transformers
model (Llama, Qwen2, Qwen3, Mistral: `targets.SLOT_MODEL_TYPES`) and runs its layers as a
`LayerStack` of pieces:

- the prologue: the embedding and the rotary tables of the step's positions;
- attention-in: norm, one fused q/k/v projection, q/k norms and RoPE on queries and keys as one
  tensor, and the new keys and values written into the cache;
- slot attention (`slots.slot_attention`, one kernel on a GPU);
- attention-out: output projection, residual, norm, one fused gate/up projection, the activation,
  the down projection, residual. A layer's attention-out and the next layer's attention-in are one
  piece (a seam), so the residual add fuses with the next norm, and the last layer's takes the
  final norm.

On a GPU the pieces are compiled (`torch.compile`, which fuses the elementwise work between the
matrix products, the cache writes included): for the fixed shapes of a step, which the engine
captures whole as one CUDA graph; and once for every shape for a prefill, whose prompts differ in
length (eager, a prefill launches some 30 kernels a layer, each paying the host's launch cost).
The drafter's layers, of the same structure, run the same way (`proposer.BlockProposer`), with
one more piece: the context's keys and values.

A step of a few rows (decoding at batch 1, a verify step) runs its products through
the product kernel instead of cuBLAS (`layer_products.KernelProducts`): each product one kernel with the norm, the
SiLU gate or the residual add around it, the weights read while the kernel before it runs, and a
token's bits the same whatever the step holds. For a model without q/k norms the q/k/v product
also rotates the queries and keys and writes the keys and values into the cache, so a layer is
five kernels: q/k/v, the attention, o, gate/up, down. How many rows a step may have for that, and
how the kernels cut and launch their work, are the stack's `KernelSettings`.

The fused projections are the model's own weights: its q/k/v and gate/up parameters become views
into one tensor each, so nothing is held twice and the model itself keeps working. The
arithmetic is transformers' own (its RMSNorm formula, its rotary embedding module), so the logits
equal the model's forward up to the summation order of the fused products.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor import config as inductor_config

from dflash_cache.drafters.rope import rotate
from dflash_cache.generate.layer_products import TENSOR_OPS, KernelProducts, PaddedProducts, Products, rms_norm
from dflash_cache.generate.slots import SlotCache, SlotStep, slot_attention, write_kv
from dflash_cache.kernels import products as product_kernel
from dflash_cache.kernels.settings import DEFAULT_KERNELS, KernelSettings

Compiled = Literal["fixed", "dynamic"] | None  # which compiled pieces a forward runs


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """A config's `hidden_act` as a function (SiLU as F.silu, which the compiler fuses)."""
    from transformers.activations import ACT2FN

    return F.silu if name == "silu" else ACT2FN[name]


def _fused(linears: list[nn.Linear], name: str, owner: nn.Module) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) for several projections of the same input; the projections' own
    parameters become views into it (done once per model: kept on `owner`)."""
    done = getattr(owner, name, None)
    if done is not None:
        return done
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype, device=weight.device)
         for m, b in zip(linears, biases, strict=True)])  # fmt: skip
    start = 0
    for m in linears:
        n = m.out_features
        m.weight.data = weight[start : start + n]
        if m.bias is not None:
            m.bias.data = bias[start : start + n]
        start += n
    setattr(owner, name, (weight, bias))
    return weight, bias


@dataclass
class _Layer:
    """One decoder layer's weights, as `attention_in`, `attention_out` and `context_kv` take them."""

    norm_in: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    norm_out: Tensor
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    q_rows: int  # the query projection's rows of `qkv`

    @property
    def into(self) -> tuple:
        """What `attention_in` takes of this layer."""
        return self.norm_in, self.qkv, self.qkv_bias, self.q_norm, self.k_norm

    @property
    def out(self) -> tuple:
        """What `attention_out` takes of this layer."""
        return self.o, self.o_bias, self.norm_out, self.gate_up, self.gate_up_bias, self.down, self.down_bias

    @property
    def kv(self) -> tuple:
        """What `context_kv` takes of this layer: the k/v rows of the fused projection (a view)."""
        q = self.q_rows
        return self.qkv[q:], None if self.qkv_bias is None else self.qkv_bias[q:], self.k_norm

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fused([attn.q_proj, attn.k_proj, attn.v_proj], "_dflash_qkv", attn)
        gate_up, gate_up_bias = _fused([mlp.gate_proj, mlp.up_proj], "_dflash_gate_up", mlp)
        norm = getattr(attn, "q_norm", None)
        return cls(layer.input_layernorm.weight, qkv, qkv_bias, norm.weight if norm is not None else None,
                   attn.k_norm.weight if norm is not None else None, attn.o_proj.weight, attn.o_proj.bias,
                   layer.post_attention_layernorm.weight, gate_up, gate_up_bias, mlp.down_proj.weight,
                   mlp.down_proj.bias, attn.q_proj.out_features)  # fmt: skip


def attention_in(x: Tensor, norm: Tensor, qkv: Tensor, qkv_bias: Tensor | None, q_norm: Tensor | None,
                 k_norm: Tensor | None, cos: Tensor, sin: Tensor, kv: tuple, eps: float, heads: int,
                 kv_heads: int, products: Products = TENSOR_OPS
                 ) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """x [b, T, H] -> queries [b, T, heads, d], keys and values [b, T, kv_heads, d] (queries and
    keys normed and rotated as one tensor, so one kernel), the keys and values also written into
    the cache (`kv`: the layer's key and value buffers, the rows' slots and the positions; keys and
    values None where the product kernel wrote them there itself). Weights come as plain tensors,
    so that one compilation serves every layer."""
    return products.qkv(x, norm, eps, qkv, qkv_bias, q_norm, k_norm, cos, sin, kv, heads, kv_heads)


def attention_out(x: Tensor, attn: Tensor, o: Tensor, o_bias: Tensor | None, norm: Tensor, gate_up: Tensor,
                  gate_up_bias: Tensor | None, down: Tensor, down_bias: Tensor | None, eps: float,
                  act: Callable[[Tensor], Tensor], products: Products = TENSOR_OPS) -> Tensor:  # fmt: skip
    """The residual stream after the layer: x [b, T, H] and the attention's output [b, T, heads, d]."""
    x = products.residual(x, attn.flatten(2), o, o_bias)
    return products.residual(x, products.gated(x, norm, eps, gate_up, gate_up_bias, act), down, down_bias)


def seam(x: Tensor, attn: Tensor, out: tuple, into: tuple, cos: Tensor, sin: Tensor, kv: tuple, eps: float,
         heads: int, kv_heads: int, act: Callable[[Tensor], Tensor], products: Products = TENSOR_OPS
         ) -> tuple[Tensor, ...]:  # fmt: skip
    """Layer i's attention-out and layer i+1's attention-in in one piece (the residual add and the
    next norm fuse): (the residual stream after layer i, layer i+1's queries, keys and values)."""
    x = attention_out(x, attn, *out, eps, act, products)
    return (x, *attention_in(x, *into, cos, sin, kv, eps, heads, kv_heads, products))


def last(x: Tensor, attn: Tensor, out: tuple, norm: Tensor, eps: float, act: Callable[[Tensor], Tensor],
         products: Products = TENSOR_OPS) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The last layer's attention-out and the final norm: (the residual stream, its normed states)."""
    x = attention_out(x, attn, *out, eps, act, products)
    return x, products.norm(x, norm, eps)


def context_kv(ctx: Tensor, kv_w: Tensor, kv_bias: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor,
               kv: tuple, eps: float, kv_heads: int) -> None:  # fmt: skip
    """A drafter layer's keys and values of context states ctx [b, T, H] into the cache (`kv`, as
    `attention_in` takes it): its k/v projections, k_norm and RoPE on the keys, and no input norm
    (DFlash's context)."""
    b, T, _ = ctx.shape
    k, v = F.linear(ctx, kv_w, kv_bias).view(b, T, 2 * kv_heads, -1).chunk(2, dim=2)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    write_kv(rotate(k, cos, sin), v, *kv)


# How each kind of piece compiles: a prefill's for every shape; a padded step's without the
# on-device benchmarking that would pick its reductions' configurations by timing (so the one- and
# the many-token steps get the same ones, and round alike).
_COMPILE = {"fixed": {"dynamic": False}, "dynamic": {"dynamic": True},
            "padded": {"dynamic": False, "options": {"deterministic": True} if hasattr(inductor_config, "deterministic")
                       else {}}}  # fmt: skip

RECOMPILE_LIMIT = 64


def allow_recompiles() -> None:
    """Raise dynamo's recompile limit to RECOMPILE_LIMIT (never lower it), once generation compiles:
    the one place the process's dynamo settings change. A fixed piece compiles once per step shape
    (rows, tokens), dtype, layer geometry and kernel settings, and every stack's pieces are the same
    functions, whose compilations dynamo keeps together (per code object): an eval of a drafter
    beside its target alone needs more than dynamo's default of 8 before it would run them eagerly.
    The limit is process-wide on purpose: the engine's compiled bookkeeping and the compiled draft
    (`drafters.compile.compiled_or_eager`, one compilation per step shape too) rely on it as well."""
    config, name = torch._dynamo.config, "recompile_limit"
    name = name if hasattr(config, name) else "cache_size_limit"  # its name before torch 2.7
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


class LayerStack:
    """Llama/Qwen3-style decoder layers of one geometry, run over a `SlotCache` as pieces (module
    docstring), compiled on a GPU (`compile`): `fixed` pieces for a step's shapes, `dynamic` ones for a
    prefill's (the eager pieces, with a warning, if compilation fails). `kernels`: which products a
    step runs and how the kernels run (`KernelSettings`).

    `prologue(inputs, positions)` makes a forward's first residual stream and its rotary tables
    (x [b, T, H], cos, sin [b, T, d]); `norm` is the final norm's weight. `context_in`, for a
    drafter, makes its context states and their rotary tables from the target's tapped states.
    `windows`: each layer's sliding window (None: full attention), as `slots.slot_attention` takes it."""

    def __init__(self, layers: list[nn.Module], *, eps: float, heads: int, kv_heads: int, scale: float,
                 act: Callable[[Tensor], Tensor], norm: Tensor, prologue: Callable, context_in: Callable | None = None,
                 compile: bool, kernels: KernelSettings = DEFAULT_KERNELS,
                 windows: list[int | None] | None = None) -> None:  # fmt: skip
        self.layers = [_Layer.of(layer) for layer in layers]
        self.windows = list(windows or [None] * len(self.layers))
        self.eps, self.heads, self.kv_heads, self.scale, self.act, self.norm = eps, heads, kv_heads, scale, act, norm
        self.kernels = kernels
        self._padded = PaddedProducts(kernels.padded_tokens)
        self._kernel = KernelProducts(kernels.products, kernels.rope_in_product)
        self.eager = {"prologue": prologue, "in": attention_in, "seam": seam, "last": last, "kv": context_kv}
        if context_in is not None:
            self.eager["context_in"] = context_in
        self.compiled = {"fixed": self.eager, "dynamic": self.eager, "padded": self.eager}
        if compile and self.layers[0].qkv.is_cuda:
            self.compiled = {kind: {k: torch.compile(f, **_COMPILE[kind]) for k, f in self.eager.items()}
                             for kind in self.compiled}  # fmt: skip
            allow_recompiles()

    def run(self, inputs: Tensor, cache: SlotCache, step: SlotStep, *, compiled: Compiled = None,
            taps: list[int] | None = None) -> tuple[Tensor, dict[int, Tensor]]:  # fmt: skip
        """`inputs` (what the prologue takes) at `step.positions` through every layer: the final
        normed states [b, T, H], and the residual stream after each layer in `taps`. `compiled`:
        "fixed" for a step, "dynamic" for a prefill, None for the eager pieces."""
        products = self._products(step, compiled)
        kind = "padded" if products is self._padded else compiled
        return self._pieces(kind, lambda fns: self._run(fns, inputs, cache, step, taps or [], products))

    def _products(self, step: SlotStep, compiled: Compiled) -> Products:
        """For a step (the fixed shapes) of at most `kernels.kernel_rows` batch rows: `KernelProducts`
        where the kernel serves the layers, else `PaddedProducts` in half precision (up to
        `kernels.padded_tokens` tokens a row); chosen by the rows, so that a row's verify and decode
        steps run the same products. The tensor ops otherwise."""
        w = self.layers[0]
        b, T = step.positions.shape
        if compiled != "fixed" or b > self.kernels.kernel_rows:
            return TENSOR_OPS
        if self.act is F.silu and product_kernel.fits(w.qkv, w.o, w.gate_up, w.down):
            return self._kernel
        if w.qkv.dtype in (torch.float16, torch.bfloat16) and T <= self.kernels.padded_tokens:
            return self._padded
        return TENSOR_OPS

    def context(self, states: Tensor, cache: SlotCache, step: SlotStep, *, compiled: Compiled = None) -> None:
        """Write every layer's keys and values of the context made from tapped target states (a
        drafter's: `context_in`, then `context_kv`) at `step`'s slots and positions."""
        self._pieces(compiled, lambda fns: self._context(fns, states, cache, step))

    def _pieces(self, compiled: Compiled, body: Callable[[dict], object]):
        if compiled is not None and self.compiled[compiled] is not self.eager:
            try:
                return body(self.compiled[compiled])
            except Exception as e:  # noqa: BLE001 - a compiler failure: run eagerly, loudly
                warnings.warn(
                    f"torch.compile of the decoder layers ({compiled} shapes) failed "
                    f"({type(e).__name__}: {str(e)[:200]}); running the eager layers",
                    stacklevel=3,
                )
                self.compiled[compiled] = self.eager
        return body(self.eager)

    def _kv(self, cache: SlotCache, i: int, step: SlotStep) -> tuple:
        return cache.k[i], cache.v[i], step.slot(cache), step.positions

    def _run(self, fns: dict, inputs: Tensor, cache: SlotCache, step: SlotStep, taps: list[int],
             products: Products) -> tuple[Tensor, dict[int, Tensor]]:  # fmt: skip
        geometry = (self.eps, self.heads, self.kv_heads)
        x, cos, sin = fns["prologue"](inputs, step.positions)
        q, k, v = fns["in"](x, *self.layers[0].into, cos, sin, self._kv(cache, 0, step), *geometry, products)
        tapped = {}
        last_layer = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            attn = slot_attention(cache, i, q, k, v, step, self.scale, write=False, tiles=self.kernels.attention,
                                  window=self.windows[i])  # fmt: skip
            if i < last_layer:
                x, q, k, v = fns["seam"](x, attn, w.out, self.layers[i + 1].into, cos, sin,
                                         self._kv(cache, i + 1, step), *geometry, self.act, products)  # fmt: skip
            else:
                x, normed = fns["last"](x, attn, w.out, self.norm, self.eps, self.act, products)
            if i in taps:
                tapped[i] = x
        return normed, tapped

    def _context(self, fns: dict, states: Tensor, cache: SlotCache, step: SlotStep) -> None:
        ctx, cos, sin = fns["context_in"](states, step.positions)
        for i, w in enumerate(self.layers):
            fns["kv"](ctx, *w.kv, cos, sin, self._kv(cache, i, step), self.eps, self.kv_heads)


class Decoder:
    """The decoder of a loaded Llama-family causal LM, run over a `SlotCache` (module docstring).

    `forward` returns the final-normed hidden states and, for `layer_ids`, the tapped layers'
    outputs concatenated (layer id l = output of decoder layer l, as `target.taps.LayerTaps`
    taps it). `compiled` as `LayerStack.run` takes it; `kernels` as `LayerStack` does."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None, *, compile: bool = True,
                 kernels: KernelSettings = DEFAULT_KERNELS) -> None:  # fmt: skip
        base = model.get_decoder()
        config = base.config
        self.embed, self.rotary = base.embed_tokens.weight, base.rotary_emb
        heads = config.num_attention_heads
        self.layers = LayerStack(list(base.layers), eps=float(config.rms_norm_eps), heads=heads,
                                 kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                                 scale=float(base.layers[0].self_attn.scaling), act=activation(config.hidden_act),
                                 norm=base.norm.weight, prologue=self._prologue, compile=compile,
                                 kernels=kernels)  # fmt: skip
        self.layer_ids = list(layer_ids or [])

    def _prologue(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = F.embedding(ids, self.embed)
        return x, *self.rotary(x, positions)

    @torch.inference_mode()
    def forward(self, ids: Tensor, cache: SlotCache, step: SlotStep, *, compiled: Compiled = None
                ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """ids [b, T] into the slots `step` names: (hidden [b, T, H] after the final norm, tapped
        states [b, T, K*H] or None)."""
        hidden, taps = self.layers.run(ids, cache, step, compiled=compiled, taps=self.layer_ids)
        states = torch.cat([taps[i] for i in self.layer_ids], -1) if self.layer_ids else None
        return hidden, states
