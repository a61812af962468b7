"""A Llama-family decoder's forward over a `SlotCache`, in few kernels.

Decoding a small model at batch 1 costs the number of kernels a step launches, not the bytes it
reads: a step of SmolLM2-135M reads 0.27 GB of weights (0.06 ms on an H200) but transformers'
layers launch about 45 kernels each. This forward reads the weights of a loaded transformers
model (Llama, Qwen2, Qwen3, Mistral: `targets.SLOT_MODEL_TYPES`) and runs each layer as
attention-in (norm, one fused q/k/v projection, q/k norms, RoPE), slot attention, and
attention-out (output projection, residual, norm, one fused gate/up projection, the activation,
the down projection, residual). On a GPU the two halves are compiled (`torch.compile`, which
fuses the elementwise work between the matrix products) for the fixed shapes of a decode step,
and the engine captures the whole step as one CUDA graph.

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
    """transformers' RMSNorm: the statistics in float32, the weight applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [b, T, heads, d] with cos/sin [b, T, d] (transformers' rotate-half layout)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
    """One decoder layer's weights, as the two halves take them."""

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

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fused([attn.q_proj, attn.k_proj, attn.v_proj], "_dflash_qkv", attn)
        gate_up, gate_up_bias = _fused([mlp.gate_proj, mlp.up_proj], "_dflash_gate_up", mlp)
        norm = getattr(attn, "q_norm", None)
        return cls(layer.input_layernorm.weight, qkv, qkv_bias, norm.weight if norm is not None else None,
                   attn.k_norm.weight if norm is not None else None, attn.o_proj.weight, attn.o_proj.bias,
                   layer.post_attention_layernorm.weight, gate_up, gate_up_bias, mlp.down_proj.weight,
                   mlp.down_proj.bias)  # fmt: skip


def attention_in(x: Tensor, norm: Tensor, qkv: Tensor, qkv_bias: Tensor | None, q_norm: Tensor | None,
                 k_norm: Tensor | None, cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int
                 ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [b, T, H] -> queries [b, T, heads, d], keys and values [b, T, kv_heads, d]. Weights come
    as plain tensors, so that one compilation serves every layer."""
    b, T, _ = x.shape
    h = F.linear(rms_norm(x, norm, eps), qkv, qkv_bias)
    d = h.shape[-1] // (heads + 2 * kv_heads)
    q, k, v = h.view(b, T, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], dim=2)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def attention_out(x: Tensor, attn: Tensor, o: Tensor, o_bias: Tensor | None, norm: Tensor, gate_up: Tensor,
                  gate_up_bias: Tensor | None, down: Tensor, down_bias: Tensor | None, eps: float,
                  act: Callable[[Tensor], Tensor]) -> Tensor:  # fmt: skip
    """The residual stream after the layer: x [b, T, H] and the attention's output [b, T, heads, d]."""
    x = x + F.linear(attn.flatten(2), o, o_bias)
    gate, up = F.linear(rms_norm(x, norm, eps), gate_up, gate_up_bias).chunk(2, dim=-1)
    return x + F.linear(act(gate) * up, down, down_bias)


class Decoder:
    """The decoder of a loaded Llama-family causal LM, run over a `SlotCache` (module docstring).

    `forward` returns the final-normed hidden states and, for `layer_ids`, the tapped layers'
    outputs concatenated (layer id l = output of decoder layer l, as `extract.target.LayerTaps`
    taps it). `compiled` is what a step uses: the compiled halves on a GPU (eager ones if
    compilation fails, with a warning)."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None, *, compile: bool = True) -> None:
        base = model.get_decoder()
        config = base.config
        self.embed, self.norm, self.rotary = base.embed_tokens.weight, base.norm.weight, base.rotary_emb
        self.eps = float(config.rms_norm_eps)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        first = base.layers[0]
        self.scale = float(first.self_attn.scaling)
        act = first.mlp.act_fn
        self.act = F.silu if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" else act
        self.layers = [_Layer.of(layer) for layer in base.layers]
        self.layer_ids = list(layer_ids or [])
        self.eager = (attention_in, attention_out)
        self.compiled = self.eager
        if compile and self.embed.is_cuda:
            self.compiled = (torch.compile(attention_in, dynamic=False), torch.compile(attention_out, dynamic=False))

    @torch.inference_mode()
    def forward(self, ids: Tensor, cache: SlotCache, step: SlotStep, *, compiled: bool = False
                ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """ids [b, T] into the slots `step` names: (hidden [b, T, H] after the final norm, tapped
        states [b, T, K*H] or None)."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x, step.positions)
        taps = {}
        for i, w in enumerate(self.layers):
            x = self._layer(i, x, w, cos, sin, cache, step, compiled)
            if i in self.layer_ids:
                taps[i] = x
        states = torch.cat([taps[i] for i in self.layer_ids], -1) if self.layer_ids else None
        return rms_norm(x, self.norm, self.eps), states

    def _layer(self, i: int, x: Tensor, w: _Layer, cos: Tensor, sin: Tensor, cache: SlotCache, step: SlotStep,
               compiled: bool) -> Tensor:  # fmt: skip
        into, out = self.compiled if compiled else self.eager
        try:
            q, k, v = into(x, w.norm_in, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, cos, sin, self.eps, self.heads,
                           self.kv_heads)  # fmt: skip
            attn = slot_attention(cache, i, q, k, v, step, self.scale)
            return out(x, attn, w.o, w.o_bias, w.norm_out, w.gate_up, w.gate_up_bias, w.down, w.down_bias, self.eps,
                       self.act)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a compiler failure: run eagerly, loudly
            if not compiled or self.compiled is self.eager:
                raise
            warnings.warn(f"torch.compile of the decoder failed ({type(e).__name__}: {str(e)[:200]}); "
                          "decoding with the eager layers", stacklevel=2)  # fmt: skip
            self.compiled = self.eager
            return self._layer(i, x, w, cos, sin, cache, step, False)
