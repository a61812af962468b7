"""Training blocks of a packed batch: anchors, the block layout's inputs, labels and slot weights.

`make_blocks` samples anchors per sequence and builds blocks of B tokens in DFlash's layout:
slot 0 holds the anchor token, slots 1..B-1 the mask token, and slot k is trained to predict the
token at anchor+k (same position, not shifted). Anchor picking (`pick_anchors`,
`anchors_by_sequence`) is shared by every family; a family with another layout builds its own
blocks from them (DSpark).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_cache.core.devices import to_device
from dflash_cache.drafters.attention import BlockLayout

# gamma of the slot decay exp(-(k-1)/gamma), from the DFlash paper.
_PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """Slot-decay gamma: the paper's 7 / 5 / 4 for B = 16 / 10 / 8.

    Fallback for other B: linear interpolation between those points, extended past them along
    the nearest segment (slope 1/2 below 10, 1/3 above 10), and never below 1.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if block_size in _PUBLISHED_GAMMA:
        return _PUBLISHED_GAMMA[block_size]
    if block_size < 10:
        return max(1.0, 4.0 + (block_size - 8) / 2)
    return 5.0 + (block_size - 10) / 3


def slot_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """[B] loss weight per slot: 0 at slot 0 (the given anchor), exp(-(k-1)/gamma) at k >= 1.

    Early slots weigh most because a draft is accepted only up to its first wrong token.
    """
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(
    loss_mask: Tensor, block_size: int, max_anchors: int, generator: torch.Generator
) -> Tensor:
    """Sorted anchor positions of one sequence: supervised p with p + B <= len, at most
    max_anchors of them drawn uniformly without replacement (fresh for each generator state).
    """
    n_valid = loss_mask.shape[0] - block_size + 1
    if n_valid <= 0 or max_anchors <= 0:
        return torch.zeros(0, dtype=torch.int64)
    return pick_anchors(torch.nonzero(loss_mask[:n_valid].cpu() != 0).flatten(), max_anchors, generator)


def pick_anchors(candidates: Tensor, max_anchors: int, generator: torch.Generator) -> Tensor:
    """At most max_anchors of the sorted candidate positions, drawn uniformly without replacement,
    sorted; all of them when there are no more."""
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator, device=generator.device)
        candidates = candidates[pick[:max_anchors].cpu()].sort().values
    return candidates


def anchors_by_sequence(loss_mask: Tensor, offsets: Tensor, anchors: Callable[[Tensor], Tensor]
                        ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(sequence, anchor position) of every block of a packed batch, grouped by sequence in order:
    `anchors(loss_mask of one sequence)` gives a sequence's sorted anchors."""
    bounds = offsets.tolist()
    seq_of, anchor_of = [], []
    for s in range(len(bounds) - 1):
        a = anchors(loss_mask[bounds[s] : bounds[s + 1]])
        seq_of.append(torch.full_like(a, s))
        anchor_of.append(a)
    block_seq = torch.cat(seq_of) if seq_of else torch.zeros(0, dtype=torch.int64)
    block_anchor = torch.cat(anchor_of) if anchor_of else torch.zeros(0, dtype=torch.int64)
    return block_seq, block_anchor



@dataclass
class Blocks:
    """The training blocks of one packed batch; flatten [nb, B] to [nb*B] for the model."""

    layout: BlockLayout
    input_ids: Tensor  # [nb, B] anchor token at slot 0, mask token after
    labels: Tensor  # [nb, B] the token each slot predicts (DFlash: at anchor + slot)
    weights: Tensor  # [nb, B] float32 slot decay * loss mask; 0 where a slot is not trained (DFlash: slot 0)
    first_slot: int = 1  # the slot of the first drafted token (DFlash: 1; a family that drafts from slot 0: 0)

    def to(self, device: torch.device | str) -> Blocks:
        """The blocks on `device`, queued behind the GPU's work (`devices.to_device`)."""
        ids, labels, weights = (to_device(t, device) for t in (self.input_ids, self.labels, self.weights))
        return Blocks(self.layout.to(device), ids, labels, weights, self.first_slot)


def make_blocks(
    input_ids: Tensor,
    loss_mask: Tensor,
    offsets: Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    max_anchors: int = 512,
    generator: torch.Generator,
    gamma: float | None = None,
) -> Blocks:
    """Sample anchors per sequence and build the blocks of a packed batch.

    Index work runs on the CPU (anchor sampling needs host-side counts); call this on host
    tensors in the loader and move the result with Blocks.to(device).
    """
    input_ids, loss_mask, offsets = input_ids.cpu(), loss_mask.cpu(), offsets.cpu().long()
    B = block_size
    block_seq, block_anchor = anchors_by_sequence(loss_mask, offsets,
                                                  lambda m: sample_anchors(m, B, max_anchors, generator))  # fmt: skip

    rows = (offsets[block_seq] + block_anchor)[:, None] + torch.arange(B)  # [nb, B]
    labels = input_ids[rows].long()
    ids = torch.full_like(labels, mask_token_id)
    ids[:, 0] = labels[:, 0]
    weights = slot_weights(B, gamma)[None, :] * (loss_mask[rows] != 0).float()
    layout = BlockLayout.build(offsets, block_seq, block_anchor, B)
    return Blocks(layout=layout, input_ids=ids, labels=labels, weights=weights)
