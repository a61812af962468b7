"""The target model as generation drives it: prefill prompts into rows, run a step of T tokens per
row, and keep what the rows committed.

Two implementations behind one interface (`Target`):

- `SlotTarget` runs a transformers decoder with its attention swapped for `slot_attention`
  (registered with transformers' AttentionInterface), so every row keeps its own position in a
  `SlotCache`: many rows decode at once and a decode step can be a CUDA graph. It serves the
  model types whose attention is plain causal attention over the cache (`SLOT_MODEL_TYPES`).
- `CachedTarget` runs any causal LM through its own transformers cache, one row at a time. It is
  the path for everything else, notably hybrid models with linear-attention layers (Qwen3.5,
  Qwen3.6, Qwen3-Next), whose recurrent state cannot be cropped back after a rejected draft: it
  keeps a copy of the cache from before each verification and re-runs the accepted tokens on it.

Both return the logits of every step position and, when asked for target layers, the tapped
hidden states (layer id l = output of decoder layer l, `extract.target.LayerTaps`).
"""

from __future__ import annotations

import copy
import inspect
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_cache.extract.target import LayerTaps, text_config
from dflash_cache.generate.slots import SlotCache, slot_attention

ATTENTION = "dflash_slots"
# Model types whose every layer is causal softmax attention over the cache with a standard RoPE,
# checked token for token against transformers' own decoding in the tests.
SLOT_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
# Attention implementations that read no cache; the prefill and the steps use them inside sdpa.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Target(Protocol):
    slots: int  # rows that decode at once
    length: int  # positions a row may hold
    layer_ids: list[int]

    def prefill(self, rows: list[int], prompts: list[tuple[int, ...]]) -> tuple[Tensor, Tensor | None]:
        """Empty `rows` and run `prompts` into them: (logits at each prompt's last token [k, V],
        tapped states [k, max prompt length, K*H] right-padded, or None without layer_ids)."""

    def step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        """ids [slots, T] at positions [slots, T] (each row's next T positions): (logits [slots,
        T, V], tapped states [slots, T, K*H] or None)."""

    def keep(self, lengths: Tensor) -> None:
        """After a step: row r now holds `lengths[r]` positions; forget the rest of the step."""


def slot_support(model: nn.Module) -> str | None:
    """Why `SlotTarget` cannot run this model, or None when it can."""
    tc = text_config(model.config.to_dict())
    model_type = tc.get("model_type", model.config.model_type)
    if model_type not in SLOT_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(SLOT_MODEL_TYPES)}"
    if tc.get("sliding_window") and tc.get("use_sliding_window", model_type == "mistral"):
        return "sliding-window attention"
    if (tc.get("rope_scaling") or {}).get("rope_type", "default") in ("dynamic", "longrope"):
        return "a rope scaling that depends on the sequence length"
    if any(t != "full_attention" for t in tc.get("layer_types") or []):
        return "layers other than full attention"
    return None


class _Step:
    """What the slot attention of the forward in flight reads (set by `SlotTarget._run`)."""

    cache: SlotCache | None = None
    positions: Tensor | None = None
    seen: Tensor | None = None
    rows: Tensor | None = None


_STEP = _Step()


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001
    """transformers' attention-function signature over the slot cache of the step in flight."""
    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise NotImplementedError("slot attention has no sliding window or soft cap")
    out = slot_attention(_STEP.cache, module.layer_idx, query, key, value, _STEP.positions, _STEP.seen, scaling,
                         rows=_STEP.rows)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


class SlotTarget:
    """A transformers decoder over a `SlotCache` (see the module docstring)."""

    def __init__(self, model: nn.Module, slots: int, length: int, layer_ids: list[int] | None = None) -> None:
        why = slot_support(model)
        if why is not None:
            raise ValueError(f"SlotTarget cannot run this model: {why}")
        _register()
        tc = text_config(model.config.to_dict())
        heads = tc["num_attention_heads"]
        head_dim = tc.get("head_dim") or tc["hidden_size"] // heads
        weight = model.get_input_embeddings().weight
        self.model, self.base, self.head = model, model.get_decoder(), model.get_output_embeddings()
        self.slots, self.length, self.layer_ids = slots, -(-length // 16) * 16, list(layer_ids or [])
        self.cache = SlotCache(tc["num_hidden_layers"], slots, self.length, tc.get("num_key_value_heads") or heads,
                               head_dim, dtype=weight.dtype, device=weight.device)  # fmt: skip
        self.taps = LayerTaps.of(model, self.layer_ids) if self.layer_ids else None
        self.device = weight.device

    @torch.inference_mode()
    def _run(self, ids: Tensor, positions: Tensor, seen: Tensor | None, rows: Tensor | None
             ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """One forward with the slot attention in place of the model's own, for its length only: the
        model stays usable as it was (a CUDA graph replays the kernels, not this Python)."""
        config, own = self.model.config, self.model.config._attn_implementation
        _STEP.cache, _STEP.positions, _STEP.seen, _STEP.rows = self.cache, positions, seen, rows
        config._attn_implementation = ATTENTION
        try:
            with sdpa_kernel(_SDPA_BACKENDS):
                hidden = self.base(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        finally:
            config._attn_implementation = own
            _STEP.cache = _STEP.positions = _STEP.seen = _STEP.rows = None
        states = torch.cat(self.taps.take(), dim=-1) if self.taps is not None else None
        return hidden, states

    def prefill(self, rows: list[int], prompts: list[tuple[int, ...]]) -> tuple[Tensor, Tensor | None]:
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        if width > self.length:
            raise ValueError(f"a prompt of {width} tokens does not fit rows of {self.length} positions")
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        positions = torch.arange(width, device=self.device).expand(len(prompts), -1)
        hidden, states = self._run(ids.to(self.device), positions, None, torch.tensor(rows, device=self.device))
        last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
        with torch.inference_mode():
            return self.head(last), states

    def step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        hidden, states = self._run(ids, positions, positions[:, -1] + 1, None)
        with torch.inference_mode():
            return self.head(hidden), states

    def keep(self, lengths: Tensor) -> None:
        """Nothing to undo: a row's entries past its length are invisible and get overwritten."""


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5 calls the cache argument `cache` (5.40 onwards; `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def has_recurrent_layers(model: nn.Module) -> bool:
    """Layers whose state is a recurrence (linear attention, SSM) rather than cropable keys."""
    types = text_config(model.config.to_dict()).get("layer_types") or []
    return any(t not in ("full_attention", "sliding_attention", "chunked_attention") for t in types)


class CachedTarget:
    """Any causal LM through its own transformers cache, one row (see the module docstring)."""

    slots = 1

    def __init__(self, model: nn.Module, length: int, layer_ids: list[int] | None = None) -> None:
        self.model, self.length, self.layer_ids = model, length, list(layer_ids or [])
        self.taps = LayerTaps.of(model, self.layer_ids) if self.layer_ids else None
        self.device = model.get_input_embeddings().weight.device
        self.kwarg = _cache_kwarg(model)
        self.recurrent = has_recurrent_layers(model)
        self.cache = None
        self._before = None  # (cache copy, its length, the step's ids) while a step may be undone

    @torch.inference_mode()
    def _forward(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        out = self.model(input_ids=ids, use_cache=True, **{self.kwarg: self.cache})
        states = torch.cat(self.taps.take(), dim=-1) if self.taps is not None else None
        return out.logits, states

    def prefill(self, rows: list[int], prompts: list[tuple[int, ...]]) -> tuple[Tensor, Tensor | None]:
        if rows != [0] or len(prompts) != 1:
            raise ValueError("CachedTarget holds one row")
        self.cache, self._before = _new_cache(self.model), None
        logits, states = self._forward(torch.tensor([prompts[0]], device=self.device))
        return logits[:, -1], states

    def step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        held = self.cache.get_seq_length()
        if int(positions[0, 0]) != held:
            raise RuntimeError(f"step at position {int(positions[0, 0])} after {held} cached positions")
        self._before = (copy.deepcopy(self.cache), held, ids) if self.recurrent and ids.shape[1] > 1 else None
        return self._forward(ids)

    def keep(self, lengths: Tensor) -> None:
        length = int(lengths[0])
        if length == 0:  # the row ended: the next prefill starts a new cache
            self.cache = self._before = None
            return
        extra = self.cache.get_seq_length() - length
        if extra <= 0:
            return
        if self._before is None:
            self.cache.crop(-extra)  # a negative argument removes that many, in transformers 4 and 5
            return
        self.cache, held, ids = self._before  # the recurrent state cannot be cropped: re-run what was kept
        self._before = None
        self._forward(ids[:, : length - held])
