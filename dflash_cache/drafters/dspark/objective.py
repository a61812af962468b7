"""DSpark's blocks (slot k predicts the token at anchor + k + 1) and its loss: CE + L1 against the
target's own distribution + the confidence head's BCE, the denominators summed over the ranks in
training (the package's docstring has the rules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache.core.devices import to_device
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.base import Output, TrainingBatch, batch_final
from dflash_cache.drafters.blocks import Blocks, anchors_by_sequence, pick_anchors
from dflash_cache.drafters.dspark.config import GAMMA, DSparkConfig
from dflash_cache.drafters.dspark.settings import DSparkSettings
from dflash_cache.drafters.losses import chunked_tv_loss
from dflash_cache.kernels.tiles import DEFAULT_LOSS_TILES, LossTiles

DEN_EPS = 1e-6  # the reference's: each term is num / (den + 1e-6)


@dataclass
class DSparkBlocks:
    """DSpark's blocks of a packed batch and, per slot, the row (in the packed batch) of the token
    before its label: the previous token for the Markov head and the target's final hidden state
    that predicts the label (`rows` [nb, B], clamped inside the sequence)."""

    blocks: Blocks
    prev_ids: Tensor  # [nb, B]
    rows: Tensor  # [nb, B]


def dspark_anchors(loss_mask: Tensor, max_anchors: int, generator: torch.Generator) -> Tensor:
    """Sorted anchors of one sequence: p < len - 1 with loss_mask[p] and loss_mask[p + 1], at most
    max_anchors drawn uniformly without replacement."""
    m = loss_mask.cpu() != 0
    if m.shape[0] < 2 or max_anchors <= 0:
        return torch.zeros(0, dtype=torch.int64)
    return pick_anchors(torch.nonzero(m[:-1] & m[1:]).flatten(), max_anchors, generator)


def make_dspark_blocks(input_ids: Tensor, loss_mask: Tensor, offsets: Tensor, *, block_size: int,
                       mask_token_id: int, max_anchors: int, generator: torch.Generator,
                       gamma: float = GAMMA) -> DSparkBlocks:  # fmt: skip
    """Anchors per sequence and the blocks of a packed batch in DSpark's layout (the package's docstring):
    labels [nb, B] the tokens at anchor + 1 + k, weights exp(-k / gamma) on each block's contiguous
    prefix of supervised labels inside the sequence, 0 after it."""
    input_ids, loss_mask, offsets = input_ids.cpu(), loss_mask.cpu(), offsets.cpu().long()
    B = block_size
    block_seq, block_anchor = anchors_by_sequence(loss_mask, offsets,
                                                  lambda m: dspark_anchors(m, max_anchors, generator))  # fmt: skip
    start, end = offsets[block_seq][:, None], offsets[block_seq + 1][:, None]
    pos = start + block_anchor[:, None] + torch.arange(B)  # [nb, B] rows of the slots' previous tokens
    label_rows = pos + 1
    inside = label_rows < end
    valid = (inside & (loss_mask[label_rows.clamp(max=len(loss_mask) - 1)] != 0)).long().cumprod(dim=1)
    rows, label_rows = torch.minimum(pos, end - 1), torch.minimum(label_rows, end - 1)
    weights = torch.exp(-torch.arange(B, dtype=torch.float32) / gamma)[None, :] * valid.float()
    prev = input_ids[rows].long()
    ids = torch.full_like(prev, mask_token_id)
    ids[:, 0] = prev[:, 0]
    layout = BlockLayout.build(offsets, block_seq, block_anchor, B)
    blocks = Blocks(layout=layout, input_ids=ids, labels=input_ids[label_rows].long(), weights=weights, first_slot=0)
    return DSparkBlocks(blocks, prev, rows)


def objective(model: nn.Module, embed: Tensor, head: Tensor, batch: TrainingBatch, dcfg: DSparkConfig,
              settings: DSparkSettings, generator: torch.Generator, reduce: bool = False,
              loss_tiles: LossTiles | None = DEFAULT_LOSS_TILES) -> Output:  # fmt: skip
    """DSpark's loss on one batch (the package's docstring). With `reduce` (training) the weights'
    denominator is summed over the data-parallel ranks and the loss multiplied by their number,
    so that DDP's mean of the gradients is the gradient of the global weighted mean."""
    ids, mask, offsets = batch.host
    db = make_dspark_blocks(ids, mask, offsets, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                            max_anchors=settings.max_anchors, generator=generator,
                            gamma=dcfg.gamma if settings.gamma is None else settings.gamma)  # fmt: skip
    device = embed.device
    scored = to_device(db.blocks.weights.flatten().nonzero().squeeze(1), device)
    blocks = db.blocks.to(device)
    prev, rows = to_device(db.prev_ids, device), to_device(db.rows, device)
    w = blocks.weights.flatten()[scored]
    den = w.sum()
    world = 1
    if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        global_den = den.detach().clone()
        dist.all_reduce(global_den)
    else:
        global_den = den.detach()
    scale = world / (global_den + DEN_EPS)
    target = batch_final(batch)[rows.flatten()[scored]] if dcfg.needs_target else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if embed.is_cuda else torch.autocast("cpu", enabled=False)
    inner = model.module if hasattr(model, "module") else model  # DDP's wrapped model, for the head weights
    with autocast:
        block_embeds = F.embedding(blocks.input_ids.flatten(), embed)
        hidden, z, conf = model(block_embeds, batch.context.to(embed.dtype), blocks.layout, prev_ids=prev)
        w2 = None if z is None else inner.markov_head.markov_w2.weight
        tv, ce, l1, hits, accept = chunked_tv_loss(
            hidden[scored], head, blocks.labels.flatten()[scored], w * dcfg.ce_alpha * scale,
            w * dcfg.l1_alpha * scale, bias=None if z is None else z[scored], bias_weight=w2,
            target=None if target is None else target.to(head.dtype), chunk_size=settings.loss_chunk,
            kernel_tiles=loss_tiles,
        )  # fmt: skip
    loss = tv
    terms = {"ce": ((ce * w).sum(), den), "l1": ((l1 * w).sum(), den)} if dcfg.needs_target else {
        "ce": ((ce * w).sum(), den)}  # fmt: skip
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf[scored].float(), accept.float(), reduction="none")
        loss = loss + dcfg.confidence_alpha * scale * (bce * w).sum()
        terms["confidence"] = ((bce * w).sum().detach(), den)
    correct = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=device).index_copy_(0, scored, hits)
    if dcfg.needs_target:  # the expected acceptance length the reference logs: 1 + sum_k prod_{j<=k} a_j
        rate = torch.zeros(blocks.labels.numel(), dtype=accept.dtype, device=device).index_copy_(0, scored, accept)
        tau = 1 + rate.view_as(blocks.weights).cumprod(dim=1).sum(dim=1)
        trained = (blocks.weights > 0).any(dim=1)
        terms["tau_prob"] = ((tau * trained).sum(), trained.sum().to(tau.dtype))
    return Output(loss=loss, correct=correct.view_as(blocks.labels), blocks=blocks, terms=terms,
                  scored=scored.numel())  # fmt: skip
