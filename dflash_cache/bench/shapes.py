"""The shapes benchmarks run at: random targets' configs at real sizes (`SHAPES`: Qwen3-8B,
SmolLM2-135M, the hybrid Qwen3.5-9B and -27B, or a target's own with `shape_of`), and synthetic
sample-length mixes. Throughput does not depend on the weights, so a random model of the right
shape stands in for the real one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dflash_cache.core.errors import UserError
from dflash_cache.train.cost import QWEN3_8B


def _qwen3_5(layers: int, hidden: int, intermediate: int, heads: int, linear_value_heads: int) -> dict:
    """A Qwen3.5 text model (the hub checkpoints' text_config): gated delta-net layers, three to
    each full-attention layer; full attention with 256-dim heads, a quarter of each rotated."""
    return {
        "model_type": "qwen3_5_text", "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 256,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": linear_value_heads, "vocab_size": 248320,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }  # fmt: skip


QWEN3_5_9B = _qwen3_5(32, 4096, 12288, 16, 32)
QWEN3_5_27B = _qwen3_5(64, 5120, 17408, 24, 48)
SMOLLM2_135M = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3.5-9b": QWEN3_5_9B, "qwen3.5-27b": QWEN3_5_27B, "smollm2-135m": SMOLLM2_135M}


class BenchError(UserError, ValueError):
    """A benchmark asked for something it cannot do."""


def shape_config(name: str) -> dict:
    """The config of a random target shape by name (`dflash bench extract --shape`)."""
    if name not in SHAPES:
        raise BenchError(f"--shape {name!r}: expected one of {', '.join(SHAPES)}")
    return SHAPES[name]


def shape_of(target: str | Path) -> dict[str, Any]:
    """A target's text config (its shape: layers, widths, vocabulary) for a random benchmark model."""
    from dflash_cache.target.config import text_config
    from dflash_cache.target.load import load_config

    config = text_config(load_config(str(target)))
    keep = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("transformers_version", "dtype")}
    return {**keep, "model_type": config.get("model_type") or "llama"}


LONG_MAX = 32768


def long_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Long-context samples: uniform from 16K to 32K tokens."""
    return np.random.default_rng(seed).integers(LONG_MAX // 2, LONG_MAX, size=n)


def fixed_lengths(length: int, num_tokens: int) -> np.ndarray:
    """Samples of `length` tokens each, as many as `num_tokens` holds (at least one): a figure at
    one context length (64K, 128K, 256K) rather than over a mix."""
    return np.full(max(1, num_tokens // length), length, dtype=np.int64)


def lognormal_lengths(n: int, lo: int = 64, hi: int = 3072, seed: int = 0) -> np.ndarray:
    """A realistic chat length mix: log-normal, median about 600 tokens, clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(600), 0.8, size=n), lo, hi).astype(np.int64)
