"""The decoding helpers the families share: a block's input ids, and drafts chosen position by
position from a block's logits."""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_cache.drafters.base import Choose


def mask_block(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, B]: slot 0 the anchor (the last committed token), the other slots the mask token: the
    block input of DFlash and of DSpark alike."""
    block = torch.full((anchor_tokens.shape[0], block_size), mask_token_id, dtype=torch.long,
                       device=anchor_tokens.device)  # fmt: skip
    block[:, 0] = anchor_tokens
    return block


def choose_each(logits: Tensor, choose: Choose) -> tuple[Tensor, Tensor | None]:
    """Tokens for logits [b, n, V], one position at a time, in order (`choose` may keep state), or
    all at once where `choose` offers that (an `each` method that gives what the n calls give)."""
    if hasattr(choose, "each"):
        return choose.each(logits)
    picked = [choose(logits[:, i]) for i in range(logits.shape[1])]
    tokens = torch.stack([t for t, _ in picked], dim=1)
    probs = None if any(p is None for _, p in picked) else torch.stack([p for _, p in picked], dim=1)
    return tokens, probs
