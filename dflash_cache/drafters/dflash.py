"""The DFlash family: the draft model, its objective, FLOPs count, serving export and draft head.

The drafter fuses K tapped target layers into a context (fc, then hidden_norm, once) and runs a
few Qwen3-style decoder layers over blocks of B tokens. In each layer the queries come only from
the block tokens; the keys and values are the layer's k_proj/v_proj of the context (k_norm, RoPE
at the context positions) followed by the block tokens' own. The context never passes through
q_proj, o_proj or the MLP. The token embedding and LM head belong to the target: they are
frozen, passed in by the caller, and never part of this module, so its state_dict() is the
serving checkpoint (z-lab / vLLM / SGLang format) as is.

Block slot 0 holds the anchor (the last committed token), slots 1..B-1 the mask token; slot k is
trained to predict the token at anchor + k (`train/objective.py`), so a block drafts B - 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_cache.cache.spec import check_drafter_fits, default_layer_ids
from dflash_cache.drafters.base import (
    Choose,
    Family,
    Output,
    bf16_state,
    choose_each,
    geometry,
    mask_block,
    read_config,
    rope_from,
    target_text_config,
    write_export,
)
from dflash_cache.train.objective import BlockLayout, block_attention, compile_for_cuda, forward_blocks

if TYPE_CHECKING:
    from dflash_cache.cache.spec import CacheSpec
    from dflash_cache.train.config import TrainConfig
    from dflash_cache.train.loader import Batch

INITIALIZER_RANGE = 0.02  # Qwen3's initializer_range: std of the Linear weights at init
# The remote-code modeling file every export carries, under the name z-lab's drafters use, so that
# AutoModel.from_pretrained(export, trust_remote_code=True) loads it (config.json's auto_map).
MODELING_SOURCE = Path(__file__).with_name("modeling_dflash.py")
MODELING_FILE = "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
ARCHITECTURE = "DFlashDraftModel"
BLOCK_SIZE = 16  # the DFlash paper's


@dataclass
class DrafterConfig:
    """Geometry of a DFlash drafter and the target facts it depends on."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    rope_scaling: dict | None = None
    num_hidden_layers: int = 5  # draft layers
    block_size: int = BLOCK_SIZE
    attention_bias: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        ids = self.target_layer_ids
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids must be non-empty and distinct, got {ids}")
        if min(ids) < 0 or max(ids) >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {ids} out of range for {self.num_target_layers} target layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.rope_scaling is not None:
            self.rope_theta, self.rope_scaling = rope_from(
                {"rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling}
            )

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        *,
        target_layer_ids: list[int] | None,
        mask_token_id: int,
        num_draft_layers: int = 5,
        block_size: int = BLOCK_SIZE,
    ) -> DrafterConfig:
        """Drafter geometry from a HF target config.json dict (Qwen3/Llama-like keys; a
        multimodal config's text_config is used when the top level has no hidden_size).
        target_layer_ids None means the default 5 spread layers."""
        t = target_text_config(target_config)
        n_target = t["num_hidden_layers"]
        return cls(
            **geometry(t),
            target_layer_ids=(default_layer_ids(n_target) if target_layer_ids is None else list(target_layer_ids)),
            num_target_layers=n_target,
            mask_token_id=mask_token_id,
            num_hidden_layers=num_draft_layers,
            block_size=block_size,
        )

    def _rope_parameters(self) -> dict:
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def to_serving_config(self) -> dict:
        """The config.json that z-lab's DFlashDraftModel, vLLM and SGLang read."""
        n = self.num_hidden_layers
        return {
            "architectures": [ARCHITECTURE],
            "auto_map": dict(AUTO_MAP),
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": INITIALIZER_RANGE,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * n,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": n,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": n,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 4 / vLLM read rope_theta + rope_scaling, 5 reads
            # rope_parameters; they agree.
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": self._rope_parameters(),
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_serving_config(cls, d: dict) -> DrafterConfig:
        dflash = d.get("dflash_config") or {}
        return cls(
            **geometry(d),
            attention_bias=d.get("attention_bias", False),
            target_layer_ids=dflash["target_layer_ids"],
            num_target_layers=d["num_target_layers"],
            mask_token_id=dflash["mask_token_id"],
            num_hidden_layers=d["num_hidden_layers"],
            block_size=d.get("block_size", dflash.get("block_size", BLOCK_SIZE)),
        )


# ----------------------------------------------------------------------------- model


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


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half convention) on x [N, heads, D] with cos/sin [N, D]."""
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x: Tensor, ctx: Tensor, rope_q, rope_k) -> tuple[Tensor, ...]:
        """(q, k_ctx, v_ctx, k_blk, v_blk): the block tokens' queries, keys and values and the
        context's keys and values, normed and rotated, in one dtype."""
        nq, nc, d = x.shape[0], ctx.shape[0], self.head_dim
        q = _rotate(self.q_norm(self.q_proj(x).view(nq, self.n_heads, d)), *rope_q)
        k_blk = _rotate(self.k_norm(self.k_proj(x).view(nq, self.n_kv, d)), *rope_q)
        k_ctx = _rotate(self.k_norm(self.k_proj(ctx).view(nc, self.n_kv, d)), *rope_k)
        v_blk = self.v_proj(x).view(nq, self.n_kv, d)
        v_ctx = self.v_proj(ctx).view(nc, self.n_kv, d)
        dt = v_blk.dtype  # under autocast the norms give float32 while v is bf16
        return q.to(dt), k_ctx.to(dt), v_ctx, k_blk.to(dt), v_blk

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        layout: BlockLayout,
        attention: str | None = None,
    ) -> Tensor:
        out = block_attention(*self.project(x, ctx, rope_q, rope_k), layout, self.head_dim**-0.5, attention)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, ctx: Tensor, rope_q, rope_k, layout: BlockLayout, attention: str | None = None
                ) -> Tensor:
        if not (x.is_cuda and _attention_inputs_cuda is not None and _mlp_block_cuda is not None):
            x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, layout, attention)
            return x + self.mlp(self.post_attention_layernorm(x))
        # The same arithmetic, with everything around the attention kernel compiled: the norms,
        # RoPE, casts and SiLU fuse into a few kernels around the GEMMs (BENCHMARKS.md, "Training step").
        attn = self.self_attn
        out = block_attention(*_attention_inputs_cuda(self, x, ctx, rope_q, rope_k), layout, attn.head_dim**-0.5,
                              attention)
        return _mlp_block_cuda(self, x, out)


def _attention_inputs(layer: DecoderLayer, x: Tensor, ctx: Tensor, rope_q, rope_k) -> tuple[Tensor, ...]:
    return layer.self_attn.project(layer.input_layernorm(x), ctx, rope_q, rope_k)


def _mlp_block(layer: DecoderLayer, x: Tensor, attn_out: Tensor) -> Tensor:
    x = x + layer.self_attn.o_proj(attn_out.flatten(1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


_attention_inputs_cuda = compile_for_cuda(_attention_inputs)
_mlp_block_cuda = compile_for_cuda(_mlp_block)


class DFlashDrafter(nn.Module):
    """The DFlash draft model over a packed batch of blocks (see the module docstring)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
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
                    rope_parameters=cfg._rope_parameters(),
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
        batch's packed tapped target hidden states. Returns the final-normed hidden [nb*B, H];
        the caller applies the frozen LM head. `attention`: the backend, "flex" or "sdpa"; None
        picks flex on CUDA where it works (`objective.block_attention`)."""
        ctx = self.hidden_norm(self.fc(context))
        rope_q = self._rope(layout.query_positions(), block_embeds.dtype)
        rope_k = self._rope(layout.ctx_pos, block_embeds.dtype)
        x = block_embeds
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, ctx, rope_q, rope_k, layout, attention, use_reentrant=False)
            else:
                x = layer(x, ctx, rope_q, rope_k, layout, attention)
        return self.norm(x)


# ----------------------------------------------------------------------------- serving export


def save_serving(model: DFlashDrafter, cfg: DrafterConfig, out_dir: Path,
                 frozen: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """Write config.json + model.safetensors (bf16) + the remote-code modeling file into out_dir,
    atomically (`base.write_export`). `frozen` is not used: z-lab's layout has no embedding and
    no LM head, the serving engine takes the target's."""
    if model.fc.out_features != cfg.hidden_size or len(model.layers) != cfg.num_hidden_layers:
        raise ValueError("cfg does not describe this model")
    write_export(out_dir, cfg.to_serving_config(), bf16_state(model), MODELING_SOURCE, MODELING_FILE)


def load_serving(
    path: Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported drafter. dtype None keeps the checkpoint's (bf16)."""
    path = Path(path)
    cfg = DrafterConfig.from_serving_config(read_config(path))
    state = load_file(str(path / "model.safetensors"), device=str(device))
    with torch.device("meta"):  # no wasted init: the weights come from the file
        model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None:
        model.to(dtype)
    return model, cfg


# ----------------------------------------------------------------------------- the family


def config(cfg: TrainConfig, spec: CacheSpec) -> DrafterConfig:
    """The drafter's geometry from the target's config recorded in the cache (ValueError on
    settings the drafter refuses; a SpecError when it does not fit the cache)."""
    layers = cfg.layers or list(spec.layers.ids)
    dcfg = DrafterConfig.from_target(spec.target.config, target_layer_ids=layers,
                                     mask_token_id=spec.tokenizer.mask_token_id, num_draft_layers=cfg.draft_layers,
                                     block_size=cfg.block_size or BLOCK_SIZE)  # fmt: skip
    check_drafter_fits(spec, layer_ids=layers, hidden_size=dcfg.hidden_size, vocab_size=dcfg.vocab_size,
                       mask_token_id=dcfg.mask_token_id)  # fmt: skip
    return dcfg


def identity(cfg: TrainConfig) -> dict[str, Any]:
    """DFlash's settings are all common ones (TrainConfig.identity)."""
    return {}


def objective(model: nn.Module, embed: Tensor, head: Tensor, batch: Batch, dcfg: DrafterConfig, cfg: TrainConfig,
              generator: torch.Generator, reduce: bool = False) -> Output:  # fmt: skip
    """Blocks from anchors, frozen embedding, drafter, chunked slot-decayed cross-entropy
    (`objective.forward_blocks`). The loss is each rank's own weighted mean (`reduce` unused)."""
    loss, correct, blocks = forward_blocks(model, embed, head, batch, block_size=dcfg.block_size,
                                           mask_token_id=dcfg.mask_token_id, max_anchors=cfg.max_anchors,
                                           gamma=cfg.gamma, loss_chunk=cfg.loss_chunk, generator=generator)  # fmt: skip
    return Output(loss=loss, correct=correct, blocks=blocks)


class StepFlops:
    """Useful FLOPs of a training step, from the model's geometry and the batch's layout:

    - draft layers, forward and backward: 6 * P_layers * blocks * B;
    - frozen LM head, forward and input gradient: 4 * V * H * blocks * (B - 1);
    - `fc` and the per-layer k/v projections of the context: 4 * P_ctx * context_tokens;
    - attention: 14 * layers * (query heads * head_dim) * B * sum over blocks of (anchor + B).

    Recomputation, padding and masked-out work are not useful, so MFU from this count is honest.
    """

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.block_size = cfg.block_size
        self.p_layers = sum(p.numel() for p in model.layers.parameters())
        attn = [layer.self_attn for layer in model.layers]
        self.p_ctx = model.fc.weight.numel() + sum(a.k_proj.weight.numel() + a.v_proj.weight.numel() for a in attn)
        self.head = cfg.vocab_size * cfg.hidden_size
        self.attn = 14 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * cfg.block_size

    def backbone(self, num_blocks: int, context_tokens: int, anchor_sum: int) -> float:
        """The draft layers, the context projections and attention: what every family built on
        this backbone computes."""
        B = self.block_size
        return (6 * self.p_layers * num_blocks * B + 4 * self.p_ctx * context_tokens
                + self.attn * (anchor_sum + num_blocks * B))  # fmt: skip

    def __call__(self, num_blocks: int, context_tokens: int, anchor_sum: int, scored: int = 0) -> float:
        head = 4 * self.head * num_blocks * (self.block_size - 1)  # every block's B - 1 drafted slots
        return self.backbone(num_blocks, context_tokens, anchor_sum) + head


def block_input(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, B]: the anchor (the last committed token) in slot 0, the mask token after it."""
    return mask_block(anchor_tokens, block_size, mask_token_id)


def draft(model: nn.Module, hidden: Tensor, block_ids: Tensor, head_weight: Tensor, choose: Choose
          ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """B - 1 proposals from slots 1..B-1 of the block's hidden states [b, B, H]: slot k proposes
    the token at anchor + k. All at once from the LM head; `choose` picks each position's token."""
    logits = (hidden[:, 1:] @ head_weight.to(hidden.dtype).T).float()
    return choose_each(logits, choose)


FAMILY = Family(
    name="dflash",
    architectures=(ARCHITECTURE,),
    default_block_size=BLOCK_SIZE,
    needs_final_hidden=False,
    config=config,
    identity=identity,
    model=DFlashDrafter,
    objective=objective,
    flops=StepFlops,
    serving_config=DrafterConfig.to_serving_config,
    from_serving_config=DrafterConfig.from_serving_config,
    save_serving=save_serving,
    load_serving=load_serving,
    block_input=block_input,
    draft=draft,
)

__all__ = [
    "AUTO_MAP",
    "FAMILY",
    "MODELING_FILE",
    "DFlashDrafter",
    "DrafterConfig",
    "StepFlops",
    "block_input",
    "draft",
    "load_serving",
    "save_serving",
]
