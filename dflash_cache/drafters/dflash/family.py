"""The DFlash family (`FAMILY`): its config from a run's settings and the cache, its objective (blocks
from anchors, the frozen embedding, the drafter, the chunked slot-decayed cross-entropy), its
useful-FLOPs count, its serving export and its draft head."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache.cache.spec import CacheSpec, check_drafter_fits
from dflash_cache.core.devices import to_device
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.base import Choose, Family, Output, TrainingBatch
from dflash_cache.drafters.blocks import Blocks, make_blocks
from dflash_cache.drafters.decoding import choose_each, mask_block
from dflash_cache.drafters.dflash.config import (
    ARCHITECTURE,
    BLOCK_SIZE,
    MODELING_FILE,
    MODELING_SOURCE,
    DrafterConfig,
)
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.drafters.dflash.settings import SETTINGS
from dflash_cache.drafters.losses import chunked_loss
from dflash_cache.drafters.serving import bf16_state, load_export, read_config, write_export
from dflash_cache.drafters.settings import DrafterSettings
from dflash_cache.kernels.tiles import DEFAULT_LOSS_TILES, LossTiles


def config(settings: DrafterSettings, spec: CacheSpec) -> DrafterConfig:
    """The drafter's geometry from the target's config recorded in the cache (ValueError on
    settings the drafter refuses; a SpecError when it does not fit the cache)."""
    layers = settings.layers or list(spec.layers.ids)
    dcfg = DrafterConfig.from_target(spec.target.config, target_layer_ids=layers,
                                     mask_token_id=spec.tokenizer.mask_token_id,
                                     num_draft_layers=settings.draft_layers,
                                     block_size=settings.block_size or BLOCK_SIZE,
                                     sliding_window=settings.window(),
                                     layer_types=settings.layer_types())  # fmt: skip
    check_drafter_fits(spec, layer_ids=layers, hidden_size=dcfg.hidden_size, vocab_size=dcfg.vocab_size,
                       mask_token_id=dcfg.mask_token_id)  # fmt: skip
    if spec.projection is not None:
        dcfg.context_width = spec.context_width(layers)
    return dcfg


def forward_blocks(model: nn.Module, embed: Tensor, head: Tensor, batch: TrainingBatch, *, block_size: int,
                   mask_token_id: int, max_anchors: int, gamma: float | None, loss_chunk: int,
                   generator: torch.Generator,
                   loss_tiles: LossTiles | None = DEFAULT_LOSS_TILES) -> tuple[Tensor, Tensor, Blocks]:  # fmt: skip
    """Blocks from anchors, frozen embedding, drafter, chunked decayed loss: the forward of a
    training step (the trainer adds the backward) and of validation. Returns the loss, which block
    tokens the argmax predicted right, and the blocks."""
    ids, mask, offsets = batch.host
    blocks = make_blocks(ids, mask, offsets, block_size=block_size, mask_token_id=mask_token_id,
                         max_anchors=max_anchors, generator=generator, gamma=gamma)  # fmt: skip
    # Only weighted slots reach the LM head: never slot 0 (the given anchor), nor unsupervised ones.
    scored = to_device(blocks.weights.flatten().nonzero().squeeze(1), embed.device)
    blocks = blocks.to(embed.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if embed.is_cuda else nullcontext()
    with autocast:
        block_embeds = F.embedding(blocks.input_ids.flatten(), embed)
        hidden = model(block_embeds, batch.context.to(embed.dtype), blocks.layout)
        loss, hits = chunked_loss(hidden[scored], head, blocks.labels.flatten()[scored],
                                  blocks.weights.flatten()[scored], loss_chunk, loss_tiles)  # fmt: skip
    correct = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=hits.device).index_copy_(0, scored, hits)
    return loss, correct.view_as(blocks.labels), blocks


def objective(model: nn.Module, embed: Tensor, head: Tensor, batch: TrainingBatch, dcfg: DrafterConfig,
              settings: DrafterSettings, generator: torch.Generator, reduce: bool = False,
              loss_tiles: LossTiles | None = DEFAULT_LOSS_TILES) -> Output:  # fmt: skip
    """Blocks from anchors, frozen embedding, drafter, chunked slot-decayed cross-entropy
    (`forward_blocks`). The loss is each rank's own weighted mean (`reduce` unused)."""
    loss, correct, blocks = forward_blocks(model, embed, head, batch, block_size=dcfg.block_size,
                                           mask_token_id=dcfg.mask_token_id, max_anchors=settings.max_anchors,
                                           gamma=settings.gamma, loss_chunk=settings.loss_chunk,
                                           generator=generator, loss_tiles=loss_tiles)  # fmt: skip
    return Output(loss=loss, correct=correct, blocks=blocks)


class StepFlops:
    """Useful FLOPs of a training step, from the model's geometry and the batch's layout:

    - draft layers, forward and backward: 6 * P_layers * blocks * B;
    - frozen LM head, forward and input gradient: 4 * V * H * blocks * (B - 1);
    - `fc` and the per-layer k/v projections of the context: 4 * P_ctx * context_tokens;
    - attention: 14 * layers * (query heads * head_dim) * B * sum over blocks of (context keys + B),
      a block's context keys its anchor, in a sliding layer min(anchor, W - 1) (its first slot's
      window; `context_keys` averages them over the layers).

    Recomputation, padding and masked-out work are not useful, so MFU from this count is honest.
    """

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.block_size = cfg.block_size
        self.windows = cfg.windows
        self.p_layers = sum(p.numel() for p in model.layers.parameters())
        attn = [layer.self_attn for layer in model.layers]
        self.p_ctx = model.fc.weight.numel() + sum(a.k_proj.weight.numel() + a.v_proj.weight.numel() for a in attn)
        self.head = cfg.vocab_size * cfg.hidden_size
        self.attn = 14 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * cfg.block_size

    def context_keys(self, layout: BlockLayout) -> Tensor:
        """The context keys the blocks of `layout` attend to, summed over the blocks and averaged over
        the layers (what `__call__` takes as `anchor_sum`): the sum of the anchors with full
        attention everywhere."""
        anchors = layout.block_anchor
        if not any(self.windows):
            return anchors.sum()
        return sum(anchors.sum() if w is None else anchors.clamp(max=w - 1).sum() for w in self.windows
                   ) / len(self.windows)  # fmt: skip

    def backbone(self, num_blocks: int, context_tokens: int, anchor_sum: int) -> float:
        """The draft layers, the context projections and attention: what every family built on
        this backbone computes."""
        B = self.block_size
        return (6 * self.p_layers * num_blocks * B + 4 * self.p_ctx * context_tokens
                + self.attn * (anchor_sum + num_blocks * B))  # fmt: skip

    def __call__(self, num_blocks: int, context_tokens: int, anchor_sum: int, scored: int = 0) -> float:
        head = 4 * self.head * num_blocks * (self.block_size - 1)  # every block's B - 1 drafted slots
        return self.backbone(num_blocks, context_tokens, anchor_sum) + head


def block_input(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, B]: the anchor (the last committed token) in slot 0, the mask token after it."""
    return mask_block(anchor_tokens, block_size, mask_token_id)


def draft(model: nn.Module, hidden: Tensor, block_ids: Tensor, head_weight: Tensor, choose: Choose
          ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """B - 1 proposals from slots 1..B-1 of the block's hidden states [b, B, H]: slot k proposes
    the token at anchor + k. All at once from the LM head; `choose` picks each position's token."""
    logits = (hidden[:, 1:] @ head_weight.to(hidden.dtype).T).float()
    return choose_each(logits, choose)


def save_serving(model: DFlashDrafter, cfg: DrafterConfig, out_dir: Path,
                 frozen: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """Write config.json + model.safetensors (bf16) + the remote-code modeling file into out_dir,
    atomically (`serving.write_export`). `frozen` is not used: z-lab's layout has no embedding and
    no LM head, the serving engine takes the target's."""
    if model.fc.out_features != cfg.hidden_size or len(model.layers) != cfg.num_hidden_layers:
        raise ValueError("cfg does not describe this model")
    write_export(out_dir, cfg.to_serving_config(), bf16_state(model), MODELING_SOURCE, MODELING_FILE)


def load_serving(
    path: Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported drafter. dtype None keeps the checkpoint's (bf16)."""
    cfg = DrafterConfig.from_serving_config(read_config(path))
    return load_export(path, cfg, DFlashDrafter, dtype=dtype, device=device), cfg


FAMILY = Family(
    name="dflash",
    architectures=(ARCHITECTURE,),
    default_block_size=BLOCK_SIZE,
    needs_final_hidden=False,
    settings=SETTINGS,
    config=config,
    model=DFlashDrafter,
    objective=objective,
    flops=StepFlops,
    serving_config=DrafterConfig.to_serving_config,
    from_serving_config=DrafterConfig.from_serving_config,
    save_serving=save_serving,
    load_serving=load_serving,
    block_input=block_input,
    draft=draft,
)
