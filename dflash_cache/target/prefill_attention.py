"""Attention for chunked prefill with no mask: a chunk of q tokens after k earlier ones.

Query i of the chunk sees the k earlier keys and the chunk's keys up to its own: causal attention
aligned to the lower right of the q x (k + q) score matrix. transformers' SDPA path writes that
rule out as a boolean mask of q x (k + q) elements, repeats the key/value heads up to the query
heads beside it, and leaves SDPA a masked kernel. At 256K tokens of the Qwen3-8B shape in chunks
of 16K that is a 4 GiB mask a chunk: with the taps unprojected the extraction ran out of an
80 GB GPU's memory, and projected it ran at under a tenth of the GPU's peak (BENCHMARKS.md,
"Chunked prefill").

`no_mask_prefill(model)` switches the model's attention, for the calls inside it, to
`lower_right_attention`, registered with transformers as ATTENTION. transformers makes no mask
for an attention it has no mask function for, and torch's `causal_lower_right` bias runs on the
flash kernel without one. Targets with sliding-window or chunked attention layers keep
transformers' own path, whose masks those layers need.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

ATTENTION = "dflash_lower_right_sdpa"
_FULL = {"full_attention", "linear_attention"}  # layer types that need no mask beyond causality


def lower_right_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: query [b, h, q, d] against key/value [b, h_kv, k + q, d]
    of one unpadded sample, causal from the lower right; returns ([b, q, h, d], None)."""
    if attention_mask is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(f"{ATTENTION} takes causal full attention only, with no mask")
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == kv_len:  # no earlier tokens: plain causal attention, the key/value heads shared as they are
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                             enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip
    else:
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # the lower-right bias takes each query head's own keys
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, kv_len),
                                             dropout_p=dropout, scale=scaling)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@cache
def _registered() -> bool:
    """Registers the attention with transformers, once, on first use (importing the interface loads
    transformers' model code)."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers without the interface keeps its own path
        return False
    AttentionInterface.register(ATTENTION, lower_right_attention)
    return True


def _configs(model: nn.Module) -> list:
    """The configs the model's modules read their attention implementation from, each once."""
    seen: dict[int, object] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def needs_no_mask(config: object) -> bool:
    """Whether every attention layer of `config` is causal over the whole context (no window)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return set(types) <= _FULL
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


@contextmanager
def no_mask_prefill(model: nn.Module) -> Iterator[None]:
    """Within it, `model`'s SDPA attention runs as `lower_right_attention` when no layer needs a
    mask (one sample, no padding: chunked prefill's calls); otherwise nothing changes."""
    configs = [c for c in _configs(model) if c._attn_implementation == "sdpa"]
    if not (configs and all(needs_no_mask(c) for c in configs) and _registered()):
        yield
        return
    for c in configs:
        c._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for c in configs:
            c._attn_implementation = "sdpa"
