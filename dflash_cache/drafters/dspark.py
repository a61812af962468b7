"""The DSpark family (arXiv 2607.05147; deepseek-ai/DeepSpec): DFlash's parallel block backbone,
a Markov head and a confidence head, trained with CE + L1 (total variation) + confidence BCE.

What the reference's code does, and this module with it (DESIGN.md 2b; QUALITY.md has the check):

- **Blocks.** Slot 0 holds the anchor token, slots 1..B-1 the mask token, at positions anchor + k,
  as in DFlash; but slot k (k = 0..B-1) predicts the token at anchor + k + 1, so a block of B slots
  drafts B tokens (DFlash: B - 1). An anchor is a position p < len - 1 with loss_mask[p] and
  loss_mask[p + 1]; slot k is trained while anchor + k + 1 is inside the sequence and supervised,
  and only as a contiguous prefix (the reference's cumprod "eval mask"). Slot weights are
  exp(-k / gamma) on that prefix, gamma 4 by default.
- **Markov head** (`markov_rank` r > 0): slot k's logits get a bias W2(z_k), z_k a rank-r latent of
  the previous token (the one at anchor + k: the anchor for slot 0), teacher-forced in training
  and the token just drafted when decoding. `vanilla`: z = W1[prev]; `gated`: z = sigmoid(G [h_k;
  W1[prev]]) * W1[prev]; `rnn`: a GRU-like state over the block's slots, z = tanh(output).
- **Confidence head**: a linear map of [h_k; W1[prev]] (`confidence_head_with_markov`) or of h_k
  to a logit, trained with BCE against a = clamp(1 - |p_draft - p_target|_1 / 2, 0, 1), detached,
  where p_target at label position t is softmax(lm_head(h_last[t - 1])): the target's final hidden
  state, which the cache holds (`extract --final-hidden`).
- **Loss**: (ce_alpha CE + l1_alpha L1 + confidence_alpha BCE), each term a sum over trained slots
  weighted as above, over their summed weights; during training the denominator is summed across
  data-parallel ranks and the loss scaled by the world size (the reference's). Defaults: the
  reference's configs (block 7, r 256 vanilla, confidence with Markov, 0.1 / 0.9 / 1.0, gamma 4).

The export is DeepSpec's released-checkpoint layout, which vLLM's `dspark` method reads:
architectures ["Qwen3DSparkModel"], the target's geometry, top-level `block_size`,
`target_layer_ids`, `mask_token_id`, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`; weights `layers.*`, `fc`, `hidden_norm`, `norm`, `markov_head.*`,
`confidence_head.proj.*`, and the target's `embed_tokens` and `lm_head` copies, as the reference
saves them (vLLM takes the target's when they are absent).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from dflash_cache.drafters.base import (
    FAMILY_KEY,
    Choose,
    Family,
    Output,
    batch_final,
    bf16_state,
    choose_each,
    mask_block,
    read_config,
    write_export,
)
from dflash_cache.drafters.dflash import INITIALIZER_RANGE, DFlashDrafter, DrafterConfig, StepFlops
from dflash_cache.drafters.dflash import config as dflash_config
from dflash_cache.train.objective import (
    BlockLayout,
    Blocks,
    anchors_by_sequence,
    chunked_tv_loss,
    pick_anchors,
)

if TYPE_CHECKING:
    from dflash_cache.cache.spec import CacheSpec
    from dflash_cache.train.config import TrainConfig
    from dflash_cache.train.loader import Batch

NAME = "dspark"
ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's and vLLM's
BLOCK_SIZE = 7  # the DSpark paper's configs
GAMMA = 4.0  # DeepSpec's loss_decay_gamma
HEAD_TYPES = ("vanilla", "gated", "rnn")
MODELING_SOURCE = Path(__file__).with_name("modeling_dspark.py")
MODELING_FILE = "dspark.py"
AUTO_MAP = {"AutoModel": "dspark.Qwen3DSparkModel"}
DEN_EPS = 1e-6  # the reference's: each term is num / (den + 1e-6)


@dataclass
class DSparkConfig(DrafterConfig):
    """A DFlash backbone's geometry, DSpark's heads and its loss weights."""

    block_size: int = BLOCK_SIZE
    markov_rank: int = 256  # 0: no Markov head
    markov_head_type: str = "vanilla"
    confidence_head_with_markov: bool = True
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0  # 0: no confidence head
    gamma: float = GAMMA
    num_anchors: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(HEAD_TYPES)}, got {self.markov_head_type!r}")
        if min(self.ce_alpha, self.l1_alpha, self.confidence_alpha) < 0:
            raise ValueError("the loss weights (ce_alpha, l1_alpha, confidence_alpha) must be >= 0")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs the Markov head (markov_rank > 0)")

    @property
    def enable_confidence_head(self) -> bool:
        return self.confidence_alpha > 0

    @property
    def needs_target(self) -> bool:
        """Whether the loss needs the target's distribution (the L1 term or the confidence head)."""
        return self.l1_alpha > 0 or self.enable_confidence_head

    def to_serving_config(self) -> dict:
        """DeepSpec's config.json of a released DSpark drafter (what vLLM's `dspark` reads)."""
        d = super().to_serving_config()
        d.pop("dflash_config")
        d.update({
            "architectures": [ARCHITECTURE], "auto_map": dict(AUTO_MAP), FAMILY_KEY: NAME,
            "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
            "num_anchors": self.num_anchors, "markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.enable_confidence_head and self.confidence_head_with_markov,
            "dspark_loss": {"ce_alpha": self.ce_alpha, "l1_alpha": self.l1_alpha,
                            "confidence_alpha": self.confidence_alpha, "gamma": self.gamma},
        })  # fmt: skip
        return d

    @classmethod
    def from_serving_config(cls, d: dict) -> DSparkConfig:
        """From our export, a DeepSpec checkpoint (the DSpark fields at the top level) or a SpecForge
        one (them in `dflash_config`); the loss weights, which neither records, are the defaults."""
        nested = d.get("dflash_config") or {}

        def get(key: str, default: Any) -> Any:
            return d.get(key, nested.get(key, default))

        base = DrafterConfig.from_serving_config({**d, "dflash_config": {
            "target_layer_ids": get("target_layer_ids", None), "mask_token_id": get("mask_token_id", None)}})
        loss = d.get("dspark_loss") or {}
        confidence = bool(get("enable_confidence_head", float(get("confidence_head_alpha", 0.0) or 0.0) > 0))
        return cls(**{**dataclasses.asdict(base), "block_size": d.get("block_size", BLOCK_SIZE)},
                   markov_rank=int(get("markov_rank", 0) or 0), markov_head_type=get("markov_head_type", "vanilla"),
                   confidence_head_with_markov=bool(get("confidence_head_with_markov", False)),
                   confidence_alpha=loss.get("confidence_alpha", 1.0) if confidence else 0.0,
                   ce_alpha=loss.get("ce_alpha", 0.1), l1_alpha=loss.get("l1_alpha", 0.9),
                   gamma=loss.get("gamma", GAMMA), num_anchors=int(d.get("num_anchors", 512)))  # fmt: skip


# ----------------------------------------------------------------------------- heads


class VanillaMarkov(nn.Module):
    """z = W1[prev]: the previous token's rank-r embedding; its logit bias is W2 z."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def embed(self, prev: Tensor) -> Tensor:
        return self.markov_w1(prev.long())

    def init_state(self, rows: int, like: Tensor) -> Tensor | None:
        return None

    def step(self, state: Tensor | None, prev: Tensor, hidden: Tensor) -> tuple[Tensor | None, Tensor]:
        """(the next state, the latent z) of one slot: prev [b], hidden [b, H]."""
        return state, self.embed(prev)

    def block(self, prev: Tensor, hidden: Tensor) -> Tensor:
        """Teacher-forced latents [nb, B, r] of whole blocks: prev [nb, B], hidden [nb, B, H]."""
        return self.embed(prev)


class GatedMarkov(VanillaMarkov):
    """z = sigmoid(G [h; W1[prev]]) * W1[prev]."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__(vocab, rank, hidden)
        self.gate_proj = nn.Linear(hidden + rank, rank)

    def step(self, state: Tensor | None, prev: Tensor, hidden: Tensor) -> tuple[Tensor | None, Tensor]:
        return state, self.block(prev, hidden)

    def block(self, prev: Tensor, hidden: Tensor) -> Tensor:
        e = self.embed(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e.to(hidden.dtype)], dim=-1)))
        return gate.to(e.dtype) * e


class RNNMarkov(VanillaMarkov):
    """A GRU-like state s over the block's slots: [gate; candidate; out] = J [s; W1[prev]; h],
    s' = g s + (1 - g) tanh(candidate), z = tanh(out)."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__(vocab, rank, hidden)
        self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def init_state(self, rows: int, like: Tensor) -> Tensor:
        return like.new_zeros(rows, self.markov_w1.embedding_dim)

    def step(self, state: Tensor, prev: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        gate, candidate, out = self.joint_proj(torch.cat([state, self.embed(prev).to(hidden.dtype), hidden], -1)
                                               ).chunk(3, dim=-1)  # fmt: skip
        gate = torch.sigmoid(gate)
        return gate * state + (1.0 - gate) * torch.tanh(candidate), torch.tanh(out)

    def block(self, prev: Tensor, hidden: Tensor) -> Tensor:
        state, out = hidden.new_zeros(*hidden.shape[:-2], self.markov_w1.embedding_dim), []
        for k in range(hidden.shape[-2]):
            state, z = self.step(state, prev[..., k], hidden[..., k, :])
            out.append(z)
        return torch.stack(out, dim=-2)


_HEADS = {"vanilla": VanillaMarkov, "gated": GatedMarkov, "rnn": RNNMarkov}


class ConfidenceHead(nn.Module):
    """A slot's acceptance-rate logit from its hidden state (and the previous token's W1 row)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """DFlash's backbone (same attributes, same `forward`) with the Markov and confidence heads.

    `forward(..., prev_ids=prev)` also runs the heads, inside the module's forward (so DDP sees every
    parameter used): it returns (hidden [nb*B, H], Markov latents [nb*B, r] or None, confidence
    logits [nb*B] float32 or None), `prev` [nb, B] being each slot's previous token."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__(cfg)
        h, r = cfg.hidden_size, cfg.markov_rank
        self.markov_head = _HEADS[cfg.markov_head_type](cfg.vocab_size, r, h) if r else None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(h + (r if cfg.confidence_head_with_markov else 0))
        for module in (self.markov_head, self.confidence_head):
            if module is not None:
                module.apply(self._init_head)

    @staticmethod
    def _init_head(m: nn.Module) -> None:
        """Qwen3PreTrainedModel's init, which the reference's heads get: normal(0.02), zero bias."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=INITIALIZER_RANGE)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, block_embeds: Tensor, context: Tensor, layout: BlockLayout, attention: str | None = None,
                prev_ids: Tensor | None = None):  # fmt: skip
        hidden = super().forward(block_embeds, context, layout, attention)
        if prev_ids is None:
            return hidden
        blocks = hidden.view(*prev_ids.shape, -1)
        z = None if self.markov_head is None else self.markov_head.block(prev_ids, blocks)
        conf = self.confidence(blocks, prev_ids)
        flat = None if z is None else z.reshape(hidden.shape[0], -1)
        return hidden, flat, None if conf is None else conf.reshape(-1)

    def confidence(self, hidden: Tensor, prev_ids: Tensor) -> Tensor | None:
        """Confidence logits (float32) of slots with hidden [..., H] and previous tokens [...]."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.embed(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features).float()


# ----------------------------------------------------------------------------- blocks, objective


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
    """Anchors per sequence and the blocks of a packed batch in DSpark's layout (module docstring):
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


def objective(model: nn.Module, embed: Tensor, head: Tensor, batch: Batch, dcfg: DSparkConfig, cfg: TrainConfig,
              generator: torch.Generator, reduce: bool = False) -> Output:  # fmt: skip
    """DSpark's loss on one batch (module docstring). With `reduce` (training) the weights'
    denominator is summed over the data-parallel ranks and the loss multiplied by their number,
    so that DDP's mean of the gradients is the gradient of the global weighted mean."""
    ids, mask, offsets = batch.host
    db = make_dspark_blocks(ids, mask, offsets, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                            max_anchors=cfg.max_anchors, generator=generator,
                            gamma=dcfg.gamma if cfg.gamma is None else cfg.gamma)  # fmt: skip
    device = embed.device
    scored = db.blocks.weights.flatten().nonzero().squeeze(1).to(device, non_blocking=True)
    blocks = db.blocks.to(device, non_blocking=True)
    prev, rows = db.prev_ids.to(device, non_blocking=True), db.rows.to(device, non_blocking=True)
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
            target=None if target is None else target.to(head.dtype), chunk_size=cfg.loss_chunk,
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


# ----------------------------------------------------------------------------- the family


def config(cfg: TrainConfig, spec: CacheSpec) -> DSparkConfig:
    """The backbone's geometry as for DFlash, at DSpark's block size, with the heads and loss
    weights of the run's settings."""
    base = dflash_config(dataclasses.replace(cfg, block_size=cfg.block_size or BLOCK_SIZE), spec)
    return DSparkConfig(**dataclasses.asdict(base) | {"block_size": cfg.block_size or BLOCK_SIZE},
                        markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head,
                        confidence_head_with_markov=cfg.confidence_with_markov, ce_alpha=cfg.ce_alpha,
                        l1_alpha=cfg.l1_alpha, confidence_alpha=cfg.confidence_alpha,
                        gamma=GAMMA if cfg.gamma is None else cfg.gamma, num_anchors=cfg.max_anchors)  # fmt: skip


def identity(cfg: TrainConfig) -> dict[str, Any]:
    """DSpark's own settings, which change the model and the loss."""
    return {k: getattr(cfg, k) for k in ("markov_rank", "markov_head", "confidence_with_markov", "ce_alpha",
                                         "l1_alpha", "confidence_alpha")}  # fmt: skip


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
    """DeepSpec's checkpoint layout (module docstring), atomically, with the remote-code files:
    `dspark.py`, which builds on DFlash's `dflash.py` (shipped beside it, unchanged). `frozen` (the
    target's embedding and LM head) is stored as `embed_tokens.weight` / `lm_head.weight` as the
    reference does; without it the export leaves them to the serving engine (vLLM shares the
    target's)."""
    from dflash_cache.drafters.dflash import MODELING_FILE as DFLASH_FILE
    from dflash_cache.drafters.dflash import MODELING_SOURCE as DFLASH_SOURCE

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
    path = Path(path)
    cfg = DSparkConfig.from_serving_config(read_config(path))
    state = load_file(str(path / "model.safetensors"), device=str(device))
    state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    with torch.device("meta"):
        model = DSparkDrafter(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None:
        model.to(dtype)
    return model, cfg


def block_input(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, B]: the anchor (the last committed token) in slot 0, the mask token after it (as DFlash)."""
    return mask_block(anchor_tokens, block_size, mask_token_id)


def draft(model: DSparkDrafter, hidden: Tensor, block_ids: Tensor, head_weight: Tensor, choose: Choose
          ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """B proposals from the block's hidden states [b, B, H]: slot k proposes the token at anchor + k +
    1. The base logits of every slot come from the LM head at once; the Markov head then runs slot by
    slot, its previous token the one just drafted (the anchor, block_ids[:, 0], for slot 0), as the
    reference's `sample_block_tokens` does."""
    base = hidden @ head_weight.to(hidden.dtype).T  # [b, B, V]
    head = model.markov_head
    if head is None:
        return choose_each(base.float(), choose)
    state, prev = head.init_state(hidden.shape[0], hidden), block_ids[:, 0]
    tokens, probs = [], []
    for k in range(hidden.shape[1]):
        state, z = head.step(state, prev, hidden[:, k])
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
    config=config,
    identity=identity,
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

__all__ = ["FAMILY", "DSparkConfig", "DSparkDrafter", "block_input", "draft", "make_dspark_blocks", "objective"]
