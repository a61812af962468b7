"""A Llama-family decoder's forward over a `SlotCache`, in few kernels.

Decoding a small model at batch 1 costs the number of kernels a step launches, not the bytes it
reads: a step of SmolLM2-135M reads 0.27 GB of weights (0.06 ms on an H200) but transformers'
layers launch about 45 kernels each. This forward reads the weights of a loaded transformers
model (Llama, Qwen2, Qwen3, Mistral: `targets.SLOT_MODEL_TYPES`) and runs its layers as a
`LayerStack`: per layer attention-in (norm, one fused q/k/v projection, q/k norms and RoPE on
queries and keys as one tensor), slot attention, and attention-out (output projection, residual,
norm, one fused gate/up projection, the activation, the down projection, residual), where a
layer's attention-out and the next layer's attention-in are one piece, so the residual add fuses
with the next norm. On a GPU the pieces are compiled (`torch.compile`, which fuses the elementwise
work between the matrix products) for the fixed shapes of a decode step, and the engine captures
the whole step as one CUDA graph. The drafter's layers, of the same structure, run the same way
(`proposer.BlockProposer`).

The fused projections are the model's own weights: its q/k/v and gate/up parameters become views
into one tensor each, so nothing is held twice and the model itself keeps working. The
arithmetic is transformers' own (its RMSNorm formula, its rotary embedding module), so the logits
equal the model's forward up to the summation order of the fused products.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache.generate.slots import SlotCache, SlotStep, slot_attention


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: the statistics in float32 (float64 stays float64), the weight applied
    in the input dtype."""
    h = x if x.dtype == torch.float64 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [b, T, heads, d] with cos/sin [b, T, d] (transformers' rotate-half layout)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
                 k_norm: Tensor | None, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int
                 ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """x [b, T, H] -> queries and keys [b, T, heads + kv_heads, d] (normed, rotated: one tensor,
    so one kernel), values [b, T, kv_heads, d]. Weights come as plain tensors, so that one
    compilation serves every layer."""
    b, T, _ = x.shape
    h = F.linear(rms_norm(x, norm, eps), qkv, qkv_bias)
    d = h.shape[-1] // (heads + 2 * kv_heads)
    qk, v = h.view(b, T, heads + 2 * kv_heads, d).split([heads + kv_heads, kv_heads], dim=2)
    if q_norm is not None:
        qk = rms_norm(qk, torch.cat([q_norm.expand(heads, d), k_norm.expand(kv_heads, d)]), eps)
    return rotate(qk, cos, sin), v


def attention_out(x: Tensor, attn: Tensor, o: Tensor, o_bias: Tensor | None, norm: Tensor, gate_up: Tensor,
                  gate_up_bias: Tensor | None, down: Tensor, down_bias: Tensor | None, eps: float,
                  act: Callable[[Tensor], Tensor]) -> Tensor:  # fmt: skip
    """The residual stream after the layer: x [b, T, H] and the attention's output [b, T, heads, d]."""
    x = x + F.linear(attn.flatten(2), o, o_bias)
    gate, up = F.linear(rms_norm(x, norm, eps), gate_up, gate_up_bias).chunk(2, dim=-1)
    return x + F.linear(act(gate) * up, down, down_bias)


def seam(x: Tensor, attn: Tensor, out: tuple, into: tuple, cos: Tensor, sin: Tensor, eps: float, heads: int,
         kv_heads: int, act: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Layer i's attention-out and layer i+1's attention-in in one piece (the residual add and the
    next norm fuse): (the residual stream after layer i, layer i+1's queries and keys, values)."""
    x = attention_out(x, attn, *out, eps, act)
    return (x, *attention_in(x, *into, cos, sin, eps, heads, kv_heads))


def context_kv(ctx: Tensor, kv: Tensor, kv_bias: Tensor | None, k_norm: Tensor | None, cos: Tensor, sin: Tensor,
               eps: float, kv_heads: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """A drafter layer's keys and values [b, T, kv_heads, d] of context states ctx [b, T, H]: its
    k/v projections, k_norm and RoPE on the keys, and no input norm (DFlash's context)."""
    b, T, _ = ctx.shape
    k, v = F.linear(ctx, kv, kv_bias).view(b, T, 2 * kv_heads, -1).chunk(2, dim=2)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    return rotate(k, cos, sin), v


class LayerStack:
    """Llama/Qwen3-style decoder layers of one geometry, run over a `SlotCache`: attention-in,
    slot attention, and the seams between layers, compiled on a GPU for a step's fixed shapes
    (`compiled=True`; eager pieces, with a warning, if compilation fails)."""

    def __init__(self, layers: list[nn.Module], *, eps: float, heads: int, kv_heads: int, scale: float,
                 act: Callable[[Tensor], Tensor], compile: bool) -> None:  # fmt: skip
        self.layers = [_Layer.of(layer) for layer in layers]
        self.eps, self.heads, self.kv_heads, self.scale, self.act = eps, heads, kv_heads, scale, act
        self.eager = {"in": attention_in, "seam": seam, "out": attention_out, "kv": context_kv}
        self.compiled = self.eager
        if compile and self.layers[0].qkv.is_cuda:
            self.compiled = {k: torch.compile(f, dynamic=False) for k, f in self.eager.items()}

    def run(self, x: Tensor, cos: Tensor, sin: Tensor, cache: SlotCache, step: SlotStep, *, compiled: bool = False,
            taps: list[int] | None = None) -> tuple[Tensor, dict[int, Tensor]]:  # fmt: skip
        """x [b, T, H] through every layer (cos/sin [b, T, d]): the residual stream after the last
        layer, and after each layer in `taps`."""
        if compiled and self.compiled is not self.eager:
            try:
                return self._run(self.compiled, x, cos, sin, cache, step, taps or [])
            except Exception as e:  # noqa: BLE001 - a compiler failure: run eagerly, loudly
                self._give_up(e)
        return self._run(self.eager, x, cos, sin, cache, step, taps or [])

    def _run(self, fns: dict, x: Tensor, cos: Tensor, sin: Tensor, cache: SlotCache, step: SlotStep,
             taps: list[int]) -> tuple[Tensor, dict[int, Tensor]]:  # fmt: skip
        geometry = (self.eps, self.heads, self.kv_heads)
        qk, v = fns["in"](x, *self.layers[0].into, cos, sin, *geometry)
        tapped = {}
        last = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            attn = slot_attention(cache, i, qk[:, :, : self.heads], qk[:, :, self.heads :], v, step, self.scale)
            if i < last:
                x, qk, v = fns["seam"](x, attn, w.out, self.layers[i + 1].into, cos, sin, *geometry, self.act)
            else:
                x = fns["out"](x, attn, *w.out, self.eps, self.act)
            if i in taps:
                tapped[i] = x
        return x, tapped

    def context(self, ctx: Tensor, cos: Tensor, sin: Tensor, cache: SlotCache, step: SlotStep, *,
                compiled: bool = False) -> None:  # fmt: skip
        """Write every layer's keys and values of context states ctx [b, T, H] at `step`'s slots
        and positions (a drafter's context: see `context_kv`)."""
        if compiled and self.compiled is not self.eager:
            try:
                return self._context(self.compiled["kv"], ctx, cos, sin, cache, step)
            except Exception as e:  # noqa: BLE001 - a compiler failure: run eagerly, loudly
                self._give_up(e)
        self._context(context_kv, ctx, cos, sin, cache, step)

    def _context(self, fn: Callable, ctx: Tensor, cos: Tensor, sin: Tensor, cache: SlotCache, step: SlotStep) -> None:
        for i, w in enumerate(self.layers):
            k, v = fn(ctx, *w.kv, cos, sin, self.eps, self.kv_heads)
            cache.k[i].index_put_((step.slot, step.positions), k.to(cache.k[i].dtype))
            cache.v[i].index_put_((step.slot, step.positions), v.to(cache.v[i].dtype))

    def _give_up(self, e: Exception) -> None:
        warnings.warn(f"torch.compile of the decoder layers failed ({type(e).__name__}: {str(e)[:200]}); "
                      "running the eager layers", stacklevel=3)  # fmt: skip
        self.compiled = self.eager


class Decoder:
    """The decoder of a loaded Llama-family causal LM, run over a `SlotCache` (module docstring).

    `forward` returns the final-normed hidden states and, for `layer_ids`, the tapped layers'
    outputs concatenated (layer id l = output of decoder layer l, as `extract.target.LayerTaps`
    taps it). A step runs the compiled layers (`compiled=True`)."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None, *, compile: bool = True) -> None:
        base = model.get_decoder()
        config = base.config
        self.embed, self.norm, self.rotary = base.embed_tokens.weight, base.norm.weight, base.rotary_emb
        self.eps = float(config.rms_norm_eps)
        heads = config.num_attention_heads
        self.layers = LayerStack(list(base.layers), eps=self.eps, heads=heads,
                                 kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                                 scale=float(base.layers[0].self_attn.scaling), act=activation(config.hidden_act),
                                 compile=compile)  # fmt: skip
        self.layer_ids = list(layer_ids or [])

    @torch.inference_mode()
    def forward(self, ids: Tensor, cache: SlotCache, step: SlotStep, *, compiled: bool = False
                ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """ids [b, T] into the slots `step` names: (hidden [b, T, H] after the final norm, tapped
        states [b, T, K*H] or None)."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x, step.positions)
        x, taps = self.layers.run(x, cos, sin, cache, step, compiled=compiled, taps=self.layer_ids)
        states = torch.cat([taps[i] for i in self.layer_ids], -1) if self.layer_ids else None
        return rms_norm(x, self.norm, self.eps), states
