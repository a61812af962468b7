"""DFlash draft model for transformers' remote-code route, shipped inside every dflash-cache export.

`save_serving` writes this file into the export directory as ``dflash.py`` and config.json's
``auto_map`` points at it, so an export loads the way z-lab documents its published drafters:

    draft = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto")

It imports only torch and transformers (4.56 and 5.x), never dflash_cache: the export must load on
a machine that has only those. The public interface follows z-lab's: class ``DFlashDraftModel``,
weights ``layers.*``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight``, the attributes
``target_layer_ids``, ``block_size`` and ``mask_token_id`` (read from ``config.dflash_config``),
``forward(position_ids, attention_mask, noise_embedding, target_hidden, past_key_values, use_cache)``
and ``spec_generate(target, input_ids, max_new_tokens, stop_token_ids, temperature)``.

The computation is dflash_cache.drafters.dflash.model.DFlashDrafter's: the tapped target states are fused once
(fc, hidden_norm); in each layer the block tokens' queries attend, without a causal mask, to the
keys and values of the fused context followed by the block's own. With a KV cache, the context's
keys and values stay in the cache between calls and each call brings only the new context
positions; the caller crops the block's entries off again (as z-lab's inference code does).

A layer whose ``config.layer_types`` entry is "sliding_attention" attends only to the keys within
``config.sliding_window`` (W) positions of the query, z-lab's reference rule: the block token at
position q sees the context positions [q - W + 1, p) before the block's first position p, and the
block tokens j with |q - j| < W. It reads only the last W - 1 + B keys, whatever the context.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


class DFlashRMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, cast back, scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention; x [b, heads, n, d], cos/sin [b, n, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        h, d, bias = config.hidden_size, self.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        sliding = bool(types) and types[layer_idx] == "sliding_attention"
        self.sliding_window = getattr(config, "sliding_window", None) if sliding else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
    ) -> torch.Tensor:
        b, n_q, _ = hidden_states.shape
        d = self.head_dim
        both = torch.cat([target_hidden, hidden_states], dim=1)  # keys/values: context, then block
        q = self.q_norm(self.q_proj(hidden_states).view(b, n_q, self.num_heads, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(b, both.shape[1], self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(both).view(b, both.shape[1], self.num_kv_heads, d).transpose(1, 2)
        cos, sin = position_embeddings
        q = _rotate(q, cos[:, -n_q:], sin[:, -n_q:])
        k = _rotate(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.sliding_window is not None:
            k, v, attention_mask = self._window(k, v, n_q, attention_mask)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=attention_mask, scale=d**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n_q, self.num_heads * d))

    def _window(self, k: torch.Tensor, v: torch.Tensor, n_q: int, attention_mask: torch.Tensor | None):
        """The last W - 1 + n_q keys and values (the queries are the last n_q positions) and the mask
        of the window over them: query t sees key j where |(position of t) - (position of j)| < W."""
        w = self.sliding_window
        keep = min(k.shape[-2], w - 1 + n_q)
        k, v = k[..., -keep:, :], v[..., -keep:, :]
        query = keep - n_q + torch.arange(n_q, device=k.device)[:, None]
        mask = (query - torch.arange(keep, device=k.device)[None, :]).abs() < w
        if attention_mask is None:
            return k, v, mask
        attention_mask = attention_mask[..., -keep:]
        if attention_mask.dtype == torch.bool:
            return k, v, attention_mask & mask
        return k, v, attention_mask.masked_fill(~mask, torch.finfo(attention_mask.dtype).min)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        x = hidden_states
        x = x + self.self_attn(self.input_layernorm(x), target_hidden, position_embeddings, attention_mask,
                               past_key_values)  # fmt: skip
        return x + self.mlp(self.post_attention_layernorm(x))


def _dflash_value(config: Qwen3Config, name: str, default=None):
    """A DFlash setting from config.dflash_config, else from the top level, else the default."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter; the target's embedding and LM head are passed in, never held here."""

    config_class = Qwen3Config
    base_model_prefix = "model"  # no such attribute and no such key prefix: weights load by their own names
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in _dflash_value(config, "target_layer_ids")]
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = int(_dflash_value(config, "mask_token_id"))
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        # RoPE frequencies (scaled types too) from transformers' Qwen3 code, kept as a plain
        # attribute: from_pretrained may build the model on the meta device, where a buffer that
        # is no checkpoint entry would stay uninitialised, and .to(bfloat16) must not round it.
        with torch.device("cpu"):
            rotary = Qwen3RotaryEmbedding(config)
        self._inv_freq = rotary.inv_freq.detach().float().clone()
        self._rope_scale = float(rotary.attention_scaling)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """noise_embedding [b, B, H]: the target's embeddings of the block (last token, then mask
        tokens); target_hidden [b, C, K*H]: the tapped target states of the C context positions not
        yet in past_key_values; position_ids [b, (cached +) C + B]: positions of those context
        entries and the block (only the last C + B are used). attention_mask, if given, is an SDPA
        mask over [B, cached + C + B]; none means every block token sees everything. Returns the
        final-normed hidden states [b, B, H]; the caller applies the target's LM head."""
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden.to(x.dtype)))
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        position_ids = position_ids[:, -(ctx.shape[1] + x.shape[1]) :].expand(x.shape[0], -1)
        rope = self._rope(position_ids, x.dtype)
        cache = past_key_values if use_cache or past_key_values is not None else None
        for layer in self.layers:
            x = layer(x, ctx, rope, attention_mask, cache)
        return self.norm(x)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, n, head_dim] at the given positions, computed in float32."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        return output_head(hidden)

    def draft_block(self, hidden: torch.Tensor, block: torch.Tensor, head: nn.Module, pick) -> torch.Tensor:
        """The drafts [1, B-1] of a block's hidden states [1, B, H]: slots 1..B-1, all at once."""
        return pick(self.compute_logits(hidden[:, 1:], head))

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        **_: object,
    ) -> torch.LongTensor:
        """Speculative decoding of one prompt (batch 1): input_ids [1, n] -> [1, n + new tokens].

        Each step the drafter fills a block [last token, mask x (B-1)] and drafts from it
        (`draft_block`), the target verifies [last token, drafts] in one forward, and the matching
        prefix plus the target's own next token is committed. At temperature > 0 the target's
        tokens are sampled and a draft is kept when it equals the target's sample, so every
        committed token is the target's sample.
        """
        self.eval()
        B, n = self.block_size, input_ids.shape[1]
        stops = set(stop_token_ids or [])
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        target_cache, draft_cache = _new_cache(target.config), _new_cache(self.config)

        def pick(logits: torch.Tensor) -> torch.Tensor:
            if temperature <= 0:
                return logits.argmax(-1)
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])

        def run_target(ids: torch.Tensor, keep: int = 0):
            out = target(input_ids=ids, use_cache=True, output_hidden_states=True, logits_to_keep=keep,
                         **{cache_arg: target_cache})  # fmt: skip
            return out.logits[0], torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

        logits, context = run_target(input_ids, keep=1)
        new = [int(pick(logits[-1]))]
        p = n  # position of the last committed token, which the target has not seen yet
        while len(new) < max_new_tokens and new[-1] not in stops:
            block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=input_ids.device)
            block[0, 0] = new[-1]
            cached = draft_cache.get_seq_length()
            positions = torch.arange(cached, p + B, device=input_ids.device).unsqueeze(0)
            hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=context,
                          past_key_values=draft_cache, use_cache=True)  # fmt: skip
            _crop(draft_cache, p)
            drafted = self.draft_block(hidden, block, head, pick)
            logits, states = run_target(torch.cat([block[:, :1], drafted], dim=1))
            verified = pick(logits).tolist()
            drafts = drafted[0].tolist()
            a = 0
            while a < len(drafts) and drafts[a] == verified[a]:
                a += 1
            _crop(target_cache, p + a + 1)
            context = states[:, : a + 1]
            p += a + 1
            committed = [*drafts[:a], verified[a]][: max_new_tokens - len(new)]
            for i, t in enumerate(committed):
                if t in stops:
                    committed = committed[: i + 1]
                    break
            new.extend(committed)
        return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)


def _new_cache(config) -> DynamicCache:
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers 4.x before DynamicCache took a config
        return DynamicCache()


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions; a negative crop() argument removes that many positions
    in both transformers 4 and 5."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


__all__ = ["DFlashDraftModel"]
