"""DSpark draft model for transformers' remote-code route, shipped inside every dflash-cache DSpark
export as ``dspark.py``, beside DFlash's ``dflash.py`` (its backbone, unchanged).

`save_serving` writes both files and config.json's ``auto_map`` points at this one, so an export
loads with ``AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto")``. It
imports only torch, transformers and ``dflash.py`` beside it, never dflash_cache. The weights and
config are DeepSpec's layout (class name ``Qwen3DSparkModel``, which vLLM's ``dspark`` method also
reads): the DFlash backbone's ``layers.*``, ``fc``, ``hidden_norm``, ``norm``; ``markov_head.markov_w1``
(an embedding of V by r) and ``markov_head.markov_w2`` (r to V), with ``gate_proj`` (gated) or
``joint_proj`` (rnn); ``confidence_head.proj``; and copies of the target's ``embed_tokens`` and
``lm_head`` when the export has them.

The block is DFlash's ([last committed token, mask x (B-1)] at positions p..p+B-1, attending to the
context before p), but slot k proposes the token at p + k + 1, so a block drafts B tokens: the
LM head gives every slot's base logits, and the Markov head adds, slot by slot, a bias from the
token drafted just before (the last committed token for slot 0). ``forward`` is the backbone's;
``spec_generate(target, input_ids, max_new_tokens, stop_token_ids, temperature)`` decodes one
prompt with the target verifying each block.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config

from .dflash import DFlashDraftModel


class DSparkMarkovHead(nn.Module):
    """The previous token's rank-r latent z (vanilla: W1[prev]; gated: a sigmoid gate of [h; W1[prev]]
    times it; rnn: a GRU-like state over the block's slots) and its logit bias W2 z."""

    def __init__(self, vocab: int, rank: int, hidden: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)
        elif kind != "vanilla":
            raise ValueError(f"unknown markov_head_type {kind!r}")

    def step(self, state: torch.Tensor | None, prev: torch.Tensor, hidden: torch.Tensor):
        """(next state, logit bias [b, V]) of one slot: prev [b] token ids, hidden [b, H]."""
        e = self.markov_w1(prev.long()).to(hidden.dtype)
        if self.kind == "gated":
            z = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e
        elif self.kind == "rnn":
            state = hidden.new_zeros(hidden.shape[0], e.shape[-1]) if state is None else state
            gate, candidate, out = self.joint_proj(torch.cat([state, e, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state, z = gate * state + (1.0 - gate) * torch.tanh(candidate), torch.tanh(out)
        else:
            z = e
        return state, self.markov_w2(z)


class DSparkConfidenceHead(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class Qwen3DSparkModel(DFlashDraftModel):
    """The DSpark drafter: DFlash's backbone and forward, the Markov and confidence heads."""

    config_class = Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        h, v = config.hidden_size, config.vocab_size
        self.markov_rank = int(getattr(config, "markov_rank", 0) or 0)
        # the target's embedding and LM head, as DeepSpec's checkpoints carry them (spec_generate uses the target's)
        self.embed_tokens = nn.Embedding(v, h)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.markov_head = None
        if self.markov_rank:
            kind = str(getattr(config, "markov_head_type", "vanilla"))
            self.markov_head = DSparkMarkovHead(v, self.markov_rank, h, kind)
        self.confidence_head = None
        if getattr(config, "enable_confidence_head", False):
            with_markov = bool(getattr(config, "confidence_head_with_markov", False))
            self.confidence_head = DSparkConfidenceHead(h + (self.markov_rank if with_markov else 0))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))

    def sample_draft_tokens(self, base_logits: torch.Tensor, first_prev: torch.Tensor, hidden: torch.Tensor,
                            pick) -> torch.Tensor:  # fmt: skip
        """Tokens [b, B] from base logits [b, B, V]: slot by slot, each slot's logits plus the Markov
        bias of the token drafted before it (`first_prev` [b] for slot 0); `pick` chooses a token."""
        if self.markov_head is None:
            return pick(base_logits)
        state, prev, out = None, first_prev, []
        for k in range(base_logits.shape[1]):
            state, bias = self.markov_head.step(state, prev, hidden[:, k])
            prev = pick(base_logits[:, k] + bias)
            out.append(prev)
        return torch.stack(out, dim=1)

    def draft_block(self, hidden: torch.Tensor, block: torch.Tensor, head: nn.Module, pick) -> torch.Tensor:
        """B drafts [1, B]: every slot's base logits from the LM head, and the Markov head's bias
        from the token before, slot by slot (``spec_generate`` is the backbone's)."""
        return self.sample_draft_tokens(head(hidden), block[:, 0], hidden, pick)


__all__ = ["Qwen3DSparkModel"]
