"""DSpark's heads (the Markov head's three types, the confidence head) and the draft model: DFlash's
backbone with them."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dflash.config import INITIALIZER_RANGE
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.drafters.dspark.config import DSparkConfig


class VanillaMarkov(nn.Module):
    """z = W1[prev]: the previous token's rank-r embedding; its logit bias is W2 z."""

    lookup = True  # z is a row of W1, as it is (what a drafting kernel may read in place)

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

    lookup = False

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

    lookup = False

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
