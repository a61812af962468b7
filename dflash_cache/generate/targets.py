"""The target model as generation drives it: prefill prompts into rows, run a step of T tokens per
row, and keep what the rows committed.

Two implementations behind one interface (`Target`):

- `SlotTarget` runs a transformers decoder's weights through `decoder.Decoder` over a
  `SlotCache`, so every row keeps its own position: many rows decode at once, and a decode step
  is a few compiled kernels a layer that the engine captures as one CUDA graph. It serves the
  model types whose attention is plain causal attention over the cache (`SLOT_MODEL_TYPES`).
- `CachedTarget` runs any causal LM through its own transformers cache, one row at a time. It is
  the path for everything else, notably hybrid models with linear-attention layers (Qwen3.5,
  Qwen3.6, Qwen3-Next), whose recurrent state cannot be cropped back after a rejected draft: it
  keeps a copy of the cache from before each verification and re-runs the accepted tokens on it.

Both return the logits of every step position and, when asked for target layers, the tapped
hidden states (layer id l = output of decoder layer l, `target.taps.LayerTaps`).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache.generate.decoder import Decoder
from dflash_cache.generate.slots import SlotCache, SlotStep
from dflash_cache.kernels.settings import DEFAULT_KERNELS, KernelSettings
from dflash_cache.target.config import text_config
from dflash_cache.target.hybrid import has_recurrent_layers
from dflash_cache.target.kv_cache import cache_kwarg, new_cache
from dflash_cache.target.taps import LayerTaps

# Model types whose every layer is causal softmax attention over the cache with a standard RoPE,
# checked token for token against transformers' own decoding in the tests.
SLOT_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


class Target(Protocol):
    slots: int  # rows that decode at once
    length: int  # positions a row may hold
    layer_ids: list[int]
    graphable: bool  # whether a step may be captured as a CUDA graph and replayed

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


class SlotTarget:
    """A Llama-family decoder over a `SlotCache` (see the module docstring); `kernels`: how its
    steps' kernels run (`KernelSettings`)."""

    graphable = True  # a step allocates nothing and syncs nothing: the engine may capture it

    def __init__(self, model: nn.Module, slots: int, length: int, layer_ids: list[int] | None = None, *,
                 compile: bool = True, kernels: KernelSettings = DEFAULT_KERNELS) -> None:  # fmt: skip
        why = slot_support(model)
        if why is not None:
            raise ValueError(f"SlotTarget cannot run this model: {why}")
        tc = text_config(model.config.to_dict())
        heads = tc["num_attention_heads"]
        head_dim = tc.get("head_dim") or tc["hidden_size"] // heads
        weight = model.get_input_embeddings().weight
        self.model, self.head = model, model.get_output_embeddings().weight
        self.slots, self.length, self.layer_ids = slots, -(-length // 16) * 16, list(layer_ids or [])
        self.cache = SlotCache(tc["num_hidden_layers"], slots, self.length, tc.get("num_key_value_heads") or heads,
                               head_dim, dtype=weight.dtype, device=weight.device)  # fmt: skip
        self.decoder = Decoder(model, self.layer_ids, compile=compile, kernels=kernels)
        self.device = weight.device

    @torch.inference_mode()
    def prefill(self, rows: list[int], prompts: list[tuple[int, ...]]) -> tuple[Tensor, Tensor | None]:
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        if width > self.length:
            raise ValueError(f"a prompt of {width} tokens does not fit rows of {self.length} positions")
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        positions = torch.arange(width, device=self.device).expand(len(prompts), -1)
        step = SlotStep(positions, rows=torch.tensor(rows, device=self.device))
        hidden, states = self.decoder.forward(ids.to(self.device), self.cache, step, compiled="dynamic")
        last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
        return F.linear(last, self.head), states

    @torch.inference_mode()
    def step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        step = SlotStep(positions, seen=positions[:, -1] + 1)
        hidden, states = self.decoder.forward(ids, self.cache, step, compiled="fixed")
        return F.linear(hidden, self.head), states

    def keep(self, lengths: Tensor) -> None:
        """Nothing to undo: a row's entries past its length are invisible and get overwritten."""


class CachedTarget:
    """Any causal LM through its own transformers cache, one row (see the module docstring)."""

    slots = 1
    # A step runs transformers' cache code in Python (its lengths, the copy of the recurrent state
    # to undo a step with): replaying a captured graph would skip that bookkeeping.
    graphable = False

    def __init__(self, model: nn.Module, length: int, layer_ids: list[int] | None = None) -> None:
        self.model, self.length, self.layer_ids = model, length, list(layer_ids or [])
        self.taps = LayerTaps.of(model, self.layer_ids) if self.layer_ids else None
        self.device = model.get_input_embeddings().weight.device
        self.kwarg = cache_kwarg(model)
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
        self.cache, self._before = new_cache(self.model), None
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
