"""Hybrid targets: layers whose state is a recurrence (linear attention, SSM) beside attention
layers, and the optional kernels that transformers runs them with."""

from __future__ import annotations

import importlib

from torch import nn

from dflash_cache.target.config import text_config


def has_recurrent_layers(model: nn.Module) -> bool:
    """Layers whose state is a recurrence (linear attention, SSM) rather than cropable keys."""
    types = text_config(model.config.to_dict()).get("layer_types") or []
    return any(t not in ("full_attention", "sliding_attention", "chunked_attention") for t in types)


def linear_attention_kernels() -> dict[str, bool]:
    """Whether the optional kernels that transformers uses for gated delta-net layers import here:
    flash-linear-attention's `fla.ops.gated_delta_rule` (the pip package fla-core) and
    `causal_conv1d`. transformers takes them whenever they import, and its torch path otherwise;
    for extraction the torch path measured faster (`SLOW_KERNELS`)."""
    found = {}
    for name, module in (("fla", "fla.ops.gated_delta_rule"), ("causal_conv1d", "causal_conv1d")):
        try:
            importlib.import_module(module)
            found[name] = True
        except Exception:  # noqa: BLE001 - not installed, or its triton/CUDA build does not load: the torch path
            found[name] = False
    return found


SLOW_KERNELS = (
    "flash-linear-attention (fla-core) is installed, so transformers runs the gated delta-net layers through its "
    "kernels; on an H200 they made extraction of the Qwen3.5-9B shape far slower than the torch path (no 100K-token "
    "run finished in 140 s; the torch path runs at 0.97x the bare forward; BENCHMARKS.md, \"A hybrid target\"): "
    "uninstall fla-core for extraction")
