"""The target's config as a dict: the language model's part of it and the lengths it was built for."""

from __future__ import annotations


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it)."""
    return config.get("text_config") or config


def max_positions(config: dict) -> int | None:
    """The positions the target was built for (``max_position_embeddings``, GPT-2's ``n_positions``):
    a prompt and its answer beyond them would run at positions it never saw. None where the config
    names none."""
    tc = text_config(config)
    value = tc.get("max_position_embeddings", tc.get("n_positions"))
    return int(value) if value else None
