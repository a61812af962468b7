"""Key/value buffers for many rows that each sit at a position of their own, and the attention
that reads them.

A `SlotCache` holds, per layer, keys and values [slots, length, kv_heads, head_dim]. Row r's
token at position j lives at index j of slot r, so rows of different lengths decode in one
batch, a speculative step that accepted fewer tokens in one row than in another needs no
re-layout (the stale entries past a row's length are never seen before they are overwritten),
and a row that finishes frees its slot for the next prompt (continuous batching). Nothing is
allocated per step, so a decode step can be captured in a CUDA graph.

`slot_attention` writes a step's new keys and values at their positions (unless the caller's
compiled layer already did), then lets each row's queries see the first `seen[r]` positions of its
slot (causally among the step's own tokens, or all of them); a sliding layer's (`window` W) only
those within W positions of the query's own, and reads no others: its cost is O(W) at any length.
On a GPU that is the Triton kernel over the padded buffer (`slot_kernel`: one for every step, so
that a token's attention is the same bits in a decode and a verify step), or flash attention with
per-row key counts (`seqused_k`) where Triton is missing (no window); both read only each row's
used keys, with grouped-query heads as they are. On a CPU it is an SDPA call with the equivalent
mask (over the window's keys alone, gathered, for a sliding layer). What every layer of a forward shares
(positions, key counts, flash's sequence offsets) is a `SlotStep`, made once per forward.

Tensors are token-major: queries, keys and values [b, T, heads, head_dim].
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from dflash_cache.kernels import slot_attention as slot_kernel
from dflash_cache.kernels import triton_support
from dflash_cache.kernels.tiles import DEFAULT_ATTENTION_TILES, AttentionTiles
from dflash_cache.target.taps import SDPA_BACKENDS


class SlotCache:
    """Per-layer key and value buffers [slots, length, kv_heads, head_dim]."""

    def __init__(self, layers: int, slots: int, length: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str) -> None:  # fmt: skip
        shape = (slots, length, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        if torch.device(device).type == "cuda":  # where the compiled layers write them: one compilation
            for buf in self.k + self.v:  # for every cache size
                torch._dynamo.maybe_mark_dynamic(buf, 0)
                torch._dynamo.maybe_mark_dynamic(buf, 1)
        self.slots, self.length = slots, length
        self.index = torch.arange(slots, device=device)[:, None]  # [slots, 1]: made once, not per step

    @staticmethod
    def bytes_per_slot(layers: int, length: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * length * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _has_varlen_flash() -> bool:
    """Whether this torch's flash attention takes per-sequence key counts (`seqused_k`)."""
    try:
        return "seqused_k" in str(torch.ops.aten._flash_attention_forward.default._schema)
    except (AttributeError, RuntimeError):
        return False


# The GPU kernels a step may use, in order of preference; the first call of each is compared with
# the masked path, and a mismatch turns it off.
_KERNELS = {"triton": triton_support.available(), "flash": _has_varlen_flash()}
_checked: set[tuple[str, bool, bool]] = set()


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this stream (nothing may wait on the GPU then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class SlotStep:
    """Where a forward's tokens go and what they see, shared by its layers.

    positions [b, T]: each token's position in its row. rows [b]: the slots written (None: slot i
    for batch row i; `slot` gives either as [b, 1]). seen [b]: the positions each row's queries
    see, the step's own included;
    None for a prefill, whose rows start empty and see only the new tokens, causally (right
    padding is harmless: a real token never sees the padding after it). causal: a step's own
    tokens see each other causally (query t sees seen[r] - T + 1 + t positions), else all."""

    positions: Tensor
    seen: Tensor | None = None
    rows: Tensor | None = None
    causal: bool = True
    _flash_args: dict = field(init=False, default_factory=dict)  # flash's offsets and int32 key counts, made once

    def slot(self, cache: SlotCache) -> Tensor:
        """[b, 1]: the slot of `cache` each batch row writes (views: no kernel per step)."""
        return cache.index[: self.positions.shape[0]] if self.rows is None else self.rows[:, None]


def slot_attention(cache: SlotCache, layer: int, query: Tensor, key: Tensor, value: Tensor, step: SlotStep,
                   scale: float | None, *, write: bool = True, tiles: AttentionTiles = DEFAULT_ATTENTION_TILES,
                   window: int | None = None) -> Tensor:  # fmt: skip
    """Write key/value [b, T, kv_heads, D] of a step's tokens into their slots (`write`; False when
    the caller wrote them), then attend; returns [b, T, heads, D] (see `SlotStep` for what each
    query sees; `window`: a sliding layer's W, of which a query sees the keys at positions j with
    |its position - j| < W). `tiles`: how the Triton kernel runs, where it does."""
    k_buf, v_buf = cache.k[layer], cache.v[layer]
    if write:
        write_kv(key, value, k_buf, v_buf, step.slot(cache), step.positions)
    if step.seen is None:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        T, mask = query.shape[1], None
        if window is not None:  # causal within the window
            gap = torch.arange(T, device=query.device)[:, None] - torch.arange(T, device=query.device)[None, :]
            mask = (gap >= 0) & (gap < window)
        with sdpa_kernel(SDPA_BACKENDS):  # a prefill: no cuDNN plan per prompt length
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                 scale=scale, enable_gqa=query.shape[2] != key.shape[2])  # fmt: skip
        return out.transpose(1, 2)
    if triton_support.on_device(query):
        out = _on_gpu(query, k_buf, v_buf, step.slot(cache), step, scale, tiles, window)
        if out is not None:
            return out
    return _masked(query, *_rows_of(k_buf, v_buf, step), step, scale, window)


def write_kv(k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor, slot: Tensor, positions: Tensor) -> None:
    """Keys and values [b, T, kv_heads, d] into their rows' slots [b, 1] at positions [b, T]."""
    k_buf.index_put_((slot, positions), k.to(k_buf.dtype))
    v_buf.index_put_((slot, positions), v.to(v_buf.dtype))


def _rows_of(k_buf: Tensor, v_buf: Tensor, step: SlotStep) -> tuple[Tensor, Tensor]:
    """The buffers' slots of the step's batch rows, in batch order (without `rows`, batch row i is
    slot i, and a step may hold fewer rows than the cache has slots)."""
    if step.rows is None:
        b = step.positions.shape[0]
        return k_buf[:b], v_buf[:b]
    return k_buf[step.rows], v_buf[step.rows]


def _on_gpu(query: Tensor, k_buf: Tensor, v_buf: Tensor, slot: Tensor, step: SlotStep, scale: float | None,
            tiles: AttentionTiles, window: int | None = None) -> Tensor | None:  # fmt: skip
    """A step's attention through the first GPU kernel that serves it, or None (flash attention
    serves no window: a sliding layer without the Triton kernel takes the masked path's window)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if _KERNELS["triton"] and slot_kernel.fits(query, k_buf):
        out = slot_kernel.attention(query, k_buf, v_buf, slot[:, 0], step.seen, step.causal, scale, tiles, window)
        cut = slot_kernel.pieces(k_buf.shape[1], tiles) > 1
        if _trusted("triton", out, query, k_buf, v_buf, step, scale, cut=cut, window=window):
            return out
    half = query.dtype in (torch.float16, torch.bfloat16)
    if window is None and _KERNELS["flash"] and query.is_cuda and half and query.shape[-1] <= 256:
        out = _flash(query, k_buf, v_buf, step, scale)
        if _trusted("flash", out, query, k_buf, v_buf, step, scale):
            return out
    return None


def _flash(query: Tensor, k_buf: Tensor, v_buf: Tensor, step: SlotStep, scale: float) -> Tensor:
    keys, values = _rows_of(k_buf, v_buf, step)
    b, T, heads, d = query.shape
    S, L = keys.shape[:2]
    args = step._flash_args
    if L not in args:  # once per forward, not once per layer (made here: the slot kernel needs none)
        rows = args.setdefault("rows", torch.arange(b + 1, device=query.device, dtype=torch.int32))
        args.setdefault("q", rows * T)
        args.setdefault("seen", step.seen.to(torch.int32))
        args[L] = rows * L
    out = torch.ops.aten._flash_attention_forward(
        query.reshape(b * T, heads, d), keys.view(S * L, *keys.shape[2:]), values.view(S * L, *values.shape[2:]),
        args["q"], args[L], T, L, 0.0, step.causal and T > 1, False, scale=scale, seqused_k=args["seen"],
    )[0]  # fmt: skip
    return out.view(b, T, heads, d)


def _masked(query: Tensor, keys: Tensor, values: Tensor, step: SlotStep, scale: float | None,
            window: int | None = None) -> Tensor:  # fmt: skip
    b, T, heads, d = query.shape
    kv_heads, L = keys.shape[2], keys.shape[1]
    seen = step.seen
    offsets = T - 1 - torch.arange(T, device=seen.device)
    limit = seen[:, None] - offsets if step.causal else seen[:, None].expand(b, T)
    if window is None:
        mask = torch.arange(L, device=seen.device) < limit[:, :, None]  # [b, T, L]
    else:  # only the W - 1 + T positions the step's queries may reach, gathered
        first = seen - T - (window - 1)  # [b]: the step's first query's lowest position
        pos = first[:, None] + torch.arange(window - 1 + T, device=seen.device)  # [b, W - 1 + T]
        rows = torch.arange(b, device=seen.device)[:, None]
        keys, values = keys[rows, pos.clamp(min=0)], values[rows, pos.clamp(min=0)]
        at = (seen[:, None] - T + torch.arange(T, device=seen.device))[:, :, None]  # the queries' positions
        pos = pos[:, None, :]
        mask = (pos >= 0) & (pos < limit[:, :, None]) & ((at - pos).abs() < window)  # [b, T, W - 1 + T]
    groups = heads // kv_heads
    q = query.permute(0, 2, 1, 3).reshape(b, kv_heads, groups * T, d)  # query head h reads key/value head h // groups
    k, v = keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)
    mask = mask[:, None].repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    return out.reshape(b, heads, T, d).transpose(1, 2)


def _trusted(name: str, out: Tensor, query: Tensor, k_buf: Tensor, v_buf: Tensor, step: SlotStep,
             scale: float, cut: bool = False, window: int | None = None) -> bool:  # fmt: skip
    """Whether a kernel's output may be used. Its first call in a process (of each way it runs: the
    Triton kernel over a buffer cut in pieces too, with a window too) is compared with the masked
    path: a disagreement beyond bf16 rounding turns the kernel off, with a warning."""
    key = (name, cut, window is not None)
    if key not in _checked and not capturing():
        _checked.add(key)
        masked = _masked(query, *_rows_of(k_buf, v_buf, step), step, scale, window).float()
        err = float((out.float() - masked).norm() / masked.norm().clamp_min(1e-6))
        if not err < 2e-2:
            _KERNELS[name] = False
            warnings.warn(f"{name} attention over the slot cache disagrees with the masked path (relative error "
                          f"{err:.3g}); not using it", stacklevel=4)  # fmt: skip
    return _KERNELS[name]
