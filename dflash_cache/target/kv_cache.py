"""The target's own key/value cache, through transformers: an empty one that knows the target's
layer kinds, and the name of the forward argument that takes it."""

from __future__ import annotations

import inspect

from torch import nn


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5 calls the cache argument `cache` (5.40 onwards; `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model: nn.Module):
    """An empty transformers DynamicCache for `model`, with a layer of the right kind for each of
    its layers (a sliding layer keeps only its window, a linear-attention layer its state)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
