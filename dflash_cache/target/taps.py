"""Load the target, tap the chosen layers with forward hooks, and run only as deep as needed.

The layers above the last tapped one, the final norm and the LM head never run (they are cut off
the model before it moves to the device), and `output_hidden_states` is never used, so memory
holds only the activations of the layer being computed and the tapped outputs. A cache of the
final hidden state (`--final-hidden`) needs every layer and the final norm: then only the LM head
is cut, and the base model's last_hidden_state (after the final norm) is kept too.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_cache.target.config import text_config
from dflash_cache.target.hybrid import SLOW_KERNELS, has_recurrent_layers, linear_attention_kernels
from dflash_cache.target.kv_cache import cache_kwarg, new_cache
from dflash_cache.target.load import TargetError, compute_dtype_for, load_causal_lm, whole
from dflash_cache.target.prefill_attention import no_mask_prefill


def decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, str, nn.ModuleList]:
    """The module holding the decoder layer list, the attribute name, and the list itself."""
    for owner in model.modules():
        for name, child in owner.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == num_layers:
                return owner, name, child
    raise TargetError(f"cannot find the {num_layers} decoder layers in {type(model).__name__}")


# The SDPA kernels a forward of many shapes keeps to: every extract batch and every prefill has a
# shape of its own (its longest length), and cuDNN's attention, which torch prefers on Hopper,
# builds a plan per new shape: about 50 ms each on an H200, 10% of an extract forward and 40 ms of
# a SmolLM2-135M prefill. Flash attention has no per-shape setup and runs as fast (BENCHMARKS.md).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class LayerTaps:
    """Forward hooks on the tapped decoder layers of `model` (a causal LM or its base model).

    After a forward, `take()` returns layer `layer_ids[k]`'s output for each k: layer id l is the
    output of decoder layer l, which is `hidden_states[l + 1]` of `output_hidden_states=True`
    (index 0 there is the embedding). Extract caches these; eval feeds them to the drafter. Use as
    a context manager to remove the hooks on exit.
    """

    def __init__(self, layers: nn.ModuleList, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self._outputs: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        self._handles = [layers[lid].register_forward_hook(self._hook(k)) for k, lid in enumerate(self.layer_ids)]

    @classmethod
    def of(cls, model: nn.Module, layer_ids: list[int]) -> LayerTaps:
        """Taps on a whole (uncut) model's decoder layers."""
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        num_layers = int(text_config(model.config.to_dict())["num_hidden_layers"])
        return cls(decoder_layers(base, num_layers)[2], layer_ids)

    def _hook(self, k: int):
        def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor | tuple) -> None:
            self._outputs[k] = whole(output[0] if isinstance(output, tuple) else output)

        return hook

    def take(self) -> list[torch.Tensor]:
        """Each tapped layer's output [b, T, H] from the last forward, in `layer_ids` order."""
        outputs, self._outputs = self._outputs, [None] * len(self.layer_ids)
        if any(t is None for t in outputs):
            raise RuntimeError("LayerTaps.take() before a forward through every tapped layer")
        return outputs  # type: ignore[return-value]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> LayerTaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Carry:
    """What one sample's forwards pass on to the next (`TappedTarget(ids, carry)`): the target's
    key/value cache, made by the target on the first forward (it knows its layers' kinds: full,
    sliding, linear attention). Dropping the carry frees the cache."""

    def __init__(self) -> None:
        self.cache = None


class TappedTarget:
    """The target's base model cut after its last tapped layer, with `LayerTaps` on the tapped layers;
    with `final`, the whole base model (every layer and the final norm; the LM head is not part of it)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], num_layers: int, final: bool = False):
        self.layer_ids = list(layer_ids)
        self.final = final
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        owner, attr, layers = decoder_layers(base, num_layers)
        if not final:
            setattr(owner, attr, nn.ModuleList(list(layers)[: max(layer_ids) + 1]))
            if hasattr(base, "norm"):
                base.norm = nn.Identity()
        self.base = base
        self.taps = LayerTaps(getattr(owner, attr), layer_ids)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, carry: Carry | None = None) -> list[torch.Tensor]:
        """Hidden states [b, T, H] of each tapped layer for right-padded `input_ids` [b, T], and
        with `final` the final-normed last hidden state after them.

        Right padding needs no attention mask: under the causal mask a real token never sees
        the padding after it, so its hidden states are those of the unpadded sequence.

        With `carry` (one sample, extract/prefill.py) the tokens continue those of the earlier
        calls with the same carry: they attend to them through the key/value cache it holds, at
        the positions after them. Only the layers that run (up to the last tapped one) fill it,
        and their attention takes no mask where none is needed (`prefill_attention`).
        """
        cache = {"use_cache": False}
        if carry is not None:
            if carry.cache is None:
                carry.cache = new_cache(self.base)
            cache = {"use_cache": True, cache_kwarg(self.base): carry.cache}
        with sdpa_kernel(SDPA_BACKENDS), no_mask_prefill(self.base) if carry is not None else nullcontext():
            out = self.base(input_ids=input_ids, **cache)
        taps = self.taps.take()
        return [*taps, whole(out.last_hidden_state)] if self.final else taps


def load_target(
    path: str, layer_ids: list[int], device: torch.device, revision: str | None = None, final: bool = False,
    distributed=None,
) -> tuple[TappedTarget, nn.Module, torch.dtype]:  # fmt: skip
    """Load the target on the CPU, cut it (after the last tapped layer, or with `final` before the
    LM head), move what runs to `device`.

    Returns the tapped target, the full model (still holding the embedding and LM head on the
    CPU, for the cache's frozen weights), and the compute dtype. With `distributed` (a
    transformers `DistributedConfig`, under the process group of one copy: target/parallel.py),
    each rank loads only its shards, straight onto its device.
    """
    dtype = compute_dtype_for(device)
    model = load_causal_lm(path, dtype, revision, distributed)
    model.eval().requires_grad_(False)
    if device.type == "cuda" and has_recurrent_layers(model) and linear_attention_kernels()["fla"]:
        warnings.warn(SLOW_KERNELS, stacklevel=2)
    num_layers = int(text_config(model.config.to_dict())["num_hidden_layers"])
    tapped = TappedTarget(model, layer_ids, num_layers, final)
    if distributed is None:
        tapped.base.to(device)
    return tapped, model, dtype
