"""Key/value buffers for many rows that each sit at a position of their own, and the attention
that reads them.

A `SlotCache` holds, per layer, keys and values [slots, kv_heads, length, head_dim]. Row r's
token at position j lives at index j of slot r, so rows of different lengths decode in one
batch, a speculative step that accepted fewer tokens in one row than in another needs no
re-layout (the stale entries past a row's length are invisible and get overwritten), and a row
that finishes frees its slot for the next prompt (continuous batching). Nothing is allocated per
step, so a decode step can be captured in a CUDA graph.

`slot_attention` writes the step's new keys and values at their positions, then lets each query
see the keys at positions up to its own (`visible`). Grouped-query heads are folded into the
query length, so the key/value heads are read once, never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class SlotCache:
    """Per-layer key and value buffers [slots, kv_heads, length, head_dim]."""

    def __init__(self, layers: int, slots: int, length: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str) -> None:  # fmt: skip
        shape = (slots, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.length = slots, length

    @staticmethod
    def bytes_per_slot(layers: int, length: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * length * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def visible(positions: Tensor, length: int, extra: int = 0) -> Tensor:
    """[b, 1, T, length] bool: a query at position p sees the keys at positions <= p + extra."""
    keys = torch.arange(length, device=positions.device)
    return (keys <= positions[:, :, None] + extra)[:, None]


def slot_attention(cache: SlotCache, layer: int, query: Tensor, key: Tensor, value: Tensor, positions: Tensor,
                   mask: Tensor | None, scale: float | None, rows: Tensor | None = None) -> Tensor:  # fmt: skip
    """Write key/value [b, kv_heads, T, D] of tokens at `positions` [b, T] into the rows' slots
    (all slots when `rows` is None, else slots `rows` [b]), then attend.

    mask None: the rows start empty (a prefill), and queries see only the new tokens, causally;
    right padding is harmless, since a real token never sees the padding after it. Otherwise mask
    [b, 1, T, length] says which buffer positions each query sees. Returns [b, heads, T, D]."""
    b, kv_heads, T, d = key.shape
    heads = query.shape[1]
    slot = torch.arange(b, device=key.device) if rows is None else rows
    index = (slot[:, None, None], torch.arange(kv_heads, device=key.device)[None, :, None], positions[:, None, :])
    k_buf, v_buf = cache.k[layer], cache.v[layer]
    k_buf.index_put_(index, key.to(k_buf.dtype))
    v_buf.index_put_(index, value.to(v_buf.dtype))
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=T > 1, scale=scale,
                                              enable_gqa=heads != kv_heads)  # fmt: skip
    keys, values = (k_buf, v_buf) if rows is None else (k_buf[rows], v_buf[rows])
    groups = heads // kv_heads
    q = query.reshape(b, kv_heads, groups * T, d)  # query head h reads key/value head h // groups
    mask = mask.repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale)
    return out.view(b, heads, T, d)
