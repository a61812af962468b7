"""The DSpark family (`FAMILY`): its config from a run's settings and the cache, its useful-FLOPs
count, DeepSpec's serving layout, and its draft head (the Markov head slot by slot)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from dflash_cache.cache.spec import CacheSpec
from dflash_cache.drafters.base import Choose, Family
from dflash_cache.drafters.decoding import choose_each, mask_block
from dflash_cache.drafters.dflash.config import MODELING_FILE as DFLASH_FILE
from dflash_cache.drafters.dflash.config import MODELING_SOURCE as DFLASH_SOURCE
from dflash_cache.drafters.dflash.family import StepFlops
from dflash_cache.drafters.dflash.family import config as dflash_config
from dflash_cache.drafters.dspark.config import (
    ARCHITECTURE,
    BLOCK_SIZE,
    GAMMA,
    MODELING_FILE,
    MODELING_SOURCE,
    NAME,
    DSparkConfig,
)
from dflash_cache.drafters.dspark.model import DSparkDrafter
from dflash_cache.drafters.dspark.objective import objective
from dflash_cache.drafters.dspark.settings import SETTINGS, DSparkSettings
from dflash_cache.drafters.serving import bf16_state, load_export, read_config, write_export
from dflash_cache.kernels import markov as markov_kernel
from dflash_cache.kernels.tiles import DEFAULT_MARKOV_TILES, MarkovTiles


def config(settings: DSparkSettings, spec: CacheSpec) -> DSparkConfig:
    """The backbone's geometry as for DFlash, at DSpark's block size, with the heads and loss
    weights of the run's settings."""
    block_size = settings.block_size or BLOCK_SIZE
    base = dflash_config(dataclasses.replace(settings, block_size=block_size), spec)
    return DSparkConfig(**dataclasses.asdict(base) | {"block_size": block_size},
                        markov_rank=settings.markov_rank, markov_head_type=settings.markov_head,
                        confidence_head_with_markov=settings.confidence_with_markov, ce_alpha=settings.ce_alpha,
                        l1_alpha=settings.l1_alpha, confidence_alpha=settings.confidence_alpha,
                        gamma=GAMMA if settings.gamma is None else settings.gamma,
                        num_anchors=settings.max_anchors)  # fmt: skip


class DSparkFlops(StepFlops):
    """Useful FLOPs of a DSpark step: the DFlash backbone's (`StepFlops.backbone`), and per slot that
    reaches the loss (the `scored` slots, all B of a block's trained prefix):

    - the frozen LM head on the draft, forward and input gradient: 4 V H;
    - the LM head on the target's final hidden state for the L1 term and the confidence target,
      forward only: 2 V H;
    - the Markov bias W2 z, forward and both gradients: 6 V r (vanilla's W1 lookup computes nothing),
      and the gated head's gate or the rnn head's joint projection, forward and backward;
    - the confidence head, forward and backward: 6 (H + r) (H without the Markov features).
    """

    def __init__(self, model: DSparkDrafter) -> None:
        super().__init__(model)
        cfg: DSparkConfig = model.config
        r, h, v = cfg.markov_rank, cfg.hidden_size, cfg.vocab_size
        extra = {"vanilla": 0, "gated": (h + r) * r, "rnn": (2 * r + h) * 3 * r}[cfg.markov_head_type] if r else 0
        conf = (h + (r if cfg.confidence_head_with_markov else 0)) if cfg.enable_confidence_head else 0
        markov = 6 * v * r + 6 * extra if r else 0
        self.per_slot = 4 * v * h + (2 * v * h if cfg.needs_target else 0) + markov + 6 * conf

    def __call__(self, num_blocks: int, context_tokens: int, anchor_sum: int, scored: int = 0) -> float:
        return self.backbone(num_blocks, context_tokens, anchor_sum) + self.per_slot * scored


def save_serving(model: DSparkDrafter, cfg: DSparkConfig, out_dir: Path,
                 frozen: tuple[Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """DeepSpec's checkpoint layout (the package's docstring), atomically, with the remote-code files:
    `dspark.py`, which builds on DFlash's `dflash.py` (shipped beside it, unchanged). `frozen` (the
    target's embedding and LM head) is stored as `embed_tokens.weight` / `lm_head.weight` as the
    reference does; without it the export leaves them to the serving engine (vLLM shares the
    target's)."""
    if model.fc.out_features != cfg.hidden_size or len(model.layers) != cfg.num_hidden_layers:
        raise ValueError("cfg does not describe this model")
    tensors = bf16_state(model)
    if frozen is not None:
        embed, head = frozen
        tensors["embed_tokens.weight"] = embed.detach().to("cpu", torch.bfloat16).contiguous()
        tensors["lm_head.weight"] = head.detach().to("cpu", torch.bfloat16).clone().contiguous()
    write_export(out_dir, cfg.to_serving_config(), tensors, MODELING_SOURCE, MODELING_FILE,
                 extra={DFLASH_FILE: DFLASH_SOURCE})  # fmt: skip


def load_serving(path: Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
                 ) -> tuple[DSparkDrafter, DSparkConfig]:  # fmt: skip
    """Load our export or a DeepSpec checkpoint (its embed_tokens / lm_head copies are not part of
    the drafter: the target's are used)."""
    cfg = DSparkConfig.from_serving_config(read_config(path))
    model = load_export(path, cfg, DSparkDrafter, dtype=dtype, device=device, skip=("embed_tokens.weight",
                                                                                   "lm_head.weight"))  # fmt: skip
    return model, cfg


def block_input(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, B]: the anchor (the last committed token) in slot 0, the mask token after it (as DFlash)."""
    return mask_block(anchor_tokens, block_size, mask_token_id)


def draft(model: DSparkDrafter, hidden: Tensor, block_ids: Tensor, head_weight: Tensor, choose: Choose,
          markov_tiles: MarkovTiles = DEFAULT_MARKOV_TILES
          ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """B proposals from the block's hidden states [b, B, H]: slot k proposes the token at anchor + k +
    1. The base logits of every slot come from the LM head at once; the Markov head then runs slot by
    slot, its previous token the one just drafted (the anchor, block_ids[:, 0], for slot 0), as the
    reference's `sample_block_tokens` does. Greedy (`choose.greedy`) in half precision where Triton
    runs, each slot's token is `markov_kernel`'s: the argmax without the slot's logits written (and,
    for the vanilla head, without its latent W1[prev] copied out first), cut and launched by
    `markov_tiles`."""
    base = hidden @ head_weight.to(hidden.dtype).T  # [b, B, V]
    head = model.markov_head
    if head is None:
        return choose_each(base.float(), choose)
    state, prev = head.init_state(hidden.shape[0], hidden), block_ids[:, 0]
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    fused = getattr(choose, "greedy", False) and markov_kernel.fits(base, w2)
    lookup = fused and head.lookup and w1.dtype == base.dtype
    tokens, probs = [], []
    for k in range(hidden.shape[1]):
        if lookup:  # z = W1[prev], which the kernel reads in place
            tok, p = markov_kernel.markov_argmax(base[:, k], w1, w2, prev, markov_tiles), None
        else:
            state, z = head.step(state, prev, hidden[:, k])
            if fused:  # the argmax without the logits (markov_kernel)
                tok, p = markov_kernel.markov_argmax(base[:, k], z.to(hidden.dtype), w2, None, markov_tiles), None
            else:
                tok, p = choose((base[:, k] + head.markov_w2(z.to(hidden.dtype))).float())
        tokens.append(tok)
        probs.append(p)
        prev = tok
    return torch.stack(tokens, 1), None if any(p is None for p in probs) else torch.stack(probs, 1)


FAMILY = Family(
    name=NAME,
    architectures=(ARCHITECTURE, "DSparkDraftModel"),  # DeepSpec's and SpecForge's names
    default_block_size=BLOCK_SIZE,
    needs_final_hidden=True,
    settings=SETTINGS,
    config=config,
    model=DSparkDrafter,
    objective=objective,
    flops=DSparkFlops,
    serving_config=DSparkConfig.to_serving_config,
    from_serving_config=DSparkConfig.from_serving_config,
    save_serving=save_serving,
    load_serving=load_serving,
    block_input=block_input,
    draft=draft,
)
