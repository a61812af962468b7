"""The DFlash draft model over a packed batch of blocks (the family's docstring says what it computes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_cache.drafters.attention import BlockLayout, block_attention
from dflash_cache.drafters.compile import compile_for_cuda
from dflash_cache.drafters.dflash.config import INITIALIZER_RANGE, DrafterConfig
from dflash_cache.drafters.rope import rotate


class RMSNorm(nn.Module):
    """Qwen3RMSNorm's arithmetic (normalize in float32, cast back, scale), but float64 inputs
    stay float64 so that exactness tests can be tight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x if x.dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a sliding layer's W (`attention.block_attention`), None: full attention
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x: Tensor, ctx_kv: tuple[Tensor, Tensor], rope_q, rope_k) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v): the block tokens' queries, and the keys and values of the context rows then
        the block rows (`block_attention`), normed and rotated, in one dtype. `ctx_kv`: this
        layer's k_proj and v_proj of the context [Nc, n_kv * d] (`DFlashDrafter.context_kv`)."""
        (k_ctx, v_ctx), nq, d = ctx_kv, x.shape[0], self.head_dim
        q = rotate(self.q_norm(self.q_proj(x).view(nq, self.n_heads, d)), *rope_q)
        k_blk = rotate(self.k_norm(self.k_proj(x).view(nq, self.n_kv, d)), *rope_q)
        k_ctx = rotate(self.k_norm(k_ctx.view(-1, self.n_kv, d)), *rope_k)
        v_blk = self.v_proj(x).view(nq, self.n_kv, d)
        v_ctx = v_ctx.view(-1, self.n_kv, d)
        dt = v_blk.dtype  # under autocast the norms give float32 while v is bf16
        return q.to(dt), torch.cat([k_ctx.to(dt), k_blk.to(dt)]), torch.cat([v_ctx, v_blk])

    def forward(
        self,
        x: Tensor,
        ctx_kv: tuple[Tensor, Tensor],
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        layout: BlockLayout,
        attention: str | None = None,
    ) -> Tensor:
        out = block_attention(*self.project(x, ctx_kv, rope_q, rope_k), layout, self.head_dim**-0.5, attention,
                              self.window)  # fmt: skip
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, ctx_kv: tuple[Tensor, Tensor], rope_q, rope_k, layout: BlockLayout,
                attention: str | None = None) -> Tensor:  # fmt: skip
        if not (x.is_cuda and _attention_inputs_cuda is not None and _mlp_block_cuda is not None):
            x = x + self.self_attn(self.input_layernorm(x), ctx_kv, rope_q, rope_k, layout, attention)
            return x + self.mlp(self.post_attention_layernorm(x))
        # The same arithmetic, with everything around the attention kernel compiled: the norms,
        # RoPE, casts and SiLU fuse into a few kernels around the GEMMs (BENCHMARKS.md, "Training step").
        attn = self.self_attn
        out = block_attention(*_attention_inputs_cuda(self, x, ctx_kv, rope_q, rope_k), layout, attn.head_dim**-0.5,
                              attention, attn.window)
        return _mlp_block_cuda(self, x, out)


def _attention_inputs(layer: DecoderLayer, x: Tensor, ctx_kv: tuple[Tensor, Tensor], rope_q, rope_k
                      ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return layer.self_attn.project(layer.input_layernorm(x), ctx_kv, rope_q, rope_k)


def _mlp_block(layer: DecoderLayer, x: Tensor, attn_out: Tensor) -> Tensor:
    x = x + layer.self_attn.o_proj(attn_out.flatten(1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _context_states(model: DFlashDrafter, context: Tensor) -> Tensor:
    """fc, then hidden_norm, in the dtype the projections compute in: under autocast the norm's
    float32 result would otherwise be cast for each layer's projections, and their gradients
    summed in float32 (BENCHMARKS.md, "Training at long context")."""
    h = model.fc(context)
    return model.hidden_norm(h).to(h.dtype)


_attention_inputs_cuda = compile_for_cuda(_attention_inputs)
_mlp_block_cuda = compile_for_cuda(_mlp_block)
_context_states_cuda = compile_for_cuda(_context_states)


class DFlashDrafter(nn.Module):
    """The DFlash draft model over a packed batch of blocks (see the module docstring)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(cfg, window) for window in cfg.windows)
        self.fc = nn.Linear(cfg.fc_inputs, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gradient_checkpointing = False  # recompute each layer in backward to save memory
        # RoPE frequencies (scaled types too) from transformers' Qwen3 code. A plain attribute,
        # not a buffer: Module.to(bfloat16) must not round it, and it is no checkpoint entry.
        with torch.device("cpu"):
            rotary = Qwen3RotaryEmbedding(
                Qwen3Config(
                    hidden_size=h,
                    num_attention_heads=cfg.num_attention_heads,
                    head_dim=cfg.head_dim,
                    max_position_embeddings=cfg.max_position_embeddings,
                    rope_parameters=cfg.rope_parameters(),
                )
            )
        self._inv_freq = rotary.inv_freq.float()
        self._rope_scale = float(rotary.attention_scaling)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=INITIALIZER_RANGE)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.to(cdt)[:, None] * self._inv_freq.to(cdt)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def forward(self, block_embeds: Tensor, context: Tensor, layout: BlockLayout, attention: str | None = None
                ) -> Tensor:
        """block_embeds [nb*B, H]: target embeddings of the block tokens; context [Nc, K*H]: the
        batch's packed tapped target hidden states (their projected values [Nc, context_width] on a
        projected cache). Returns the final-normed hidden [nb*B, H];
        the caller applies the frozen LM head. `attention`: the backend, "flex" or "sdpa"; None
        picks flex on CUDA where it works (`attention.block_attention`)."""
        states = _context_states_cuda if context.is_cuda and _context_states_cuda is not None else _context_states
        ctx_kv = self.context_kv(states(self, context))
        rope_q = self._rope(layout.query_positions(), block_embeds.dtype)
        rope_k = self._rope(layout.ctx_pos, block_embeds.dtype)
        x = block_embeds
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, kv, rope_q, rope_k, layout, attention, use_reentrant=False)
            else:
                x = layer(x, kv, rope_q, rope_k, layout, attention)
        return self.norm(x)

    def context_kv(self, ctx: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (k_proj, v_proj) of the context ctx [Nc, H], from one GEMM over every layer's
        weights: at long context the context's projections are most of a step, and one product
        gives its gradient without summing a [Nc, H] tensor per layer."""
        projs = [p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        bias = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
        kv = F.linear(ctx, torch.cat([p.weight for p in projs]), bias).split([p.out_features for p in projs], 1)
        return list(zip(kv[0::2], kv[1::2], strict=True))
