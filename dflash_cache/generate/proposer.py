"""The drafter side of speculative decoding: a block drafter that keeps, per row, the keys and values
of the context it has seen.

The DFlash-family backbone (DFlash, DSpark) reads the target's tapped states of every committed
position through each draft layer's k_proj/v_proj, once: `add_context` fuses the new positions'
states (fc, hidden_norm) and writes their keys and values into the row's slots at those
positions. `propose` runs the block [last token, mask x (B-1)] at positions p..p+B-1: its own keys
and values are written at those positions too, and each block query sees every slot position
below p + B, i.e. the context before the anchor and the whole block, bidirectionally: the
attention rule of training (`drafters.attention.block_attention`). In a sliding layer (the
config's `windows`) a query sees only the positions within W of its own, as in training, and the
attention reads only those. Entries past a row's committed length are never visible before they
are rewritten with the committed tokens' context.

The family decides the block's input and how drafts come out of the block's hidden states
(`block_input`, `draft`): DFlash reads slots 1..B-1 through the LM head at once; DSpark runs its
Markov head slot by slot. On a GPU the draft is compiled too (`torch.compile` for the step's fixed
shapes): DSpark's slot loop is an embedding, a rank-r product, an add and an argmax per slot,
launched as separate kernels when eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache import drafters
from dflash_cache.drafters import Family
from dflash_cache.drafters.compile import compiled_or_eager
from dflash_cache.generate.decoder import LayerStack, activation
from dflash_cache.generate.slots import SlotCache, SlotStep
from dflash_cache.kernels.settings import DEFAULT_KERNELS, KernelSettings


def proposer_slot_bytes(model: nn.Module, length: int) -> int:
    """Bytes of the context keys and values one row of `length` positions takes."""
    cfg = model.config
    return SlotCache.bytes_per_slot(len(model.layers), length, cfg.num_key_value_heads, cfg.head_dim,
                                    model.fc.weight.dtype)  # fmt: skip


class BlockProposer:
    """A DFlash-family drafter over `slots` rows of up to `length` positions (module docstring).
    Its layers run as `decoder.LayerStack`s do, compiled on a GPU (`compile`), their kernels as
    `kernels` says."""

    graphable = True  # a proposal reads and writes only device tensors: the engine may capture it and run ahead

    def __init__(self, model: nn.Module, *, embed: Tensor, head: Tensor, slots: int, length: int,
                 block_size: int | None = None, family: Family | None = None, compile: bool = True,
                 kernels: KernelSettings = DEFAULT_KERNELS) -> None:  # fmt: skip
        cfg = model.config
        family = family or drafters.family("dflash")
        self.model, self.embed, self.head = model, embed, head
        self.block_size, self.mask_token_id = block_size or cfg.block_size, cfg.mask_token_id
        self.layer_ids = list(cfg.target_layer_ids)
        self.block_input = family.block_input
        weight = model.fc.weight
        fused = compile and weight.is_cuda
        self.draft = compiled_or_eager(family.draft, "the draft") if fused else family.draft
        self._block = compiled_or_eager(self._block_of, "the block input") if fused else self._block_of
        self._offsets = torch.arange(self.block_size, device=weight.device)  # the block's, from its anchor
        self.cache = SlotCache(len(model.layers), slots, -(-length // 16) * 16, cfg.num_key_value_heads, cfg.head_dim,
                               dtype=weight.dtype, device=weight.device)  # fmt: skip
        self.slots, self.length = slots, self.cache.length
        self.num_drafts = 0  # tokens a block drafts: the family's, known from the first proposal
        self.layers = LayerStack(list(model.layers), eps=cfg.rms_norm_eps, heads=cfg.num_attention_heads,
                                 kv_heads=cfg.num_key_value_heads, scale=cfg.head_dim**-0.5,
                                 act=activation(cfg.hidden_act), norm=model.norm.weight, prologue=self._prologue,
                                 context_in=self._context_in, compile=compile, kernels=kernels,
                                 windows=cfg.windows)  # fmt: skip
        self._rope(torch.zeros(1, 1, dtype=torch.long, device=weight.device), weight.dtype)  # its tables on the device

    def start(self, rows: Tensor, prompts: Sequence[Sequence[int]], first: Tensor) -> None:
        """New requests' tokens: a block drafter reads the target's states (`add_context`) instead."""

    def commit(self, tokens: Tensor, pos: Tensor) -> None:
        """A step's tokens: likewise unread."""

    def _block_of(self, last: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """A proposal's block ids [b, B], their positions [b, B] and what its queries see [b]."""
        B = self.block_size
        return self.block_input(last, B, self.mask_token_id), positions[:, None] + self._offsets, positions + B

    def _prologue(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = F.embedding(ids, self.embed).to(self.model.fc.weight.dtype)
        return x, *self._rope(positions, x.dtype)

    def _context_in(self, states: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        m = self.model
        ctx = m.hidden_norm(m.fc(states.to(m.fc.weight.dtype)))
        return ctx, *self._rope(positions, ctx.dtype)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self.model._rope(positions.flatten(), dtype)
        return cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)

    @torch.inference_mode()
    def add_context(self, states: Tensor, positions: Tensor, rows: Tensor | None = None) -> None:
        """Tapped target states [b, T, K*H] of the tokens at positions [b, T] of rows `rows` [b]
        (all slots, in a step: the layers compiled for its fixed shape; else a prefill's, compiled
        for any shape)."""
        self.layers.context(
            states, self.cache, SlotStep(positions, rows=rows), compiled="fixed" if rows is None else "dynamic"
        )

    @torch.inference_mode()
    def propose(self, last: Tensor, positions: Tensor, choose: Callable) -> tuple[Tensor, Tensor | None]:
        """Drafts [slots, n] for every row whose last committed token `last` [slots] sits at
        `positions` [slots] (its context: every position before), and their probabilities
        [slots, n, V] when `choose` samples."""
        ids, pos, seen = self._block(last, positions)
        step = SlotStep(pos, seen=seen, causal=False)
        hidden, _ = self.layers.run(ids, self.cache, step, compiled="fixed")
        drafts, probs = self.draft(self.model, hidden, ids, self.head, choose)
        self.num_drafts = drafts.shape[1]
        return drafts, probs
