"""RoPE on queries and keys, in transformers' rotate-half layout: the one rotation the drafters'
training forward and the slot decoder (a target's layers and a drafter's) both apply."""

from __future__ import annotations

import torch
from torch import Tensor


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [..., heads, D] with cos/sin [..., D] (x's leading dimensions, without the heads),
    taken in x's dtype."""
    cos, sin = cos.to(x.dtype)[..., None, :], sin.to(x.dtype)[..., None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
