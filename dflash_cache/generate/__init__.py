"""Generation, the one seam that regen, eval and eval's target-alone baseline share.

A backend takes requests (prompt ids, max new tokens, seed) and yields completions (ids, finish
reason, per-step accepted counts where speculative, seconds): `requests.Backend`.

- `engine.Engine` over `targets.SlotTarget`: the embedded target, many rows at once with
  continuous batching and CUDA graphs, plainly or speculatively over a `proposer.BlockProposer`
  (with prompt lookup mixed in: `lookup_mix.LookupMix`);
- the same engine over `targets.CachedTarget`: one row at a time through transformers' own
  cache, for the models the slot target does not run (hybrid linear-attention models);
- `server.ServerBackend`: an OpenAI-compatible server (vLLM, SGLang, llama.cpp), token-id prompts.

Stop-token cutting (`requests.StopRule`) and per-request seeding (`requests.Chooser`) live here once.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_cache.generate.engine import Engine
from dflash_cache.generate.lookup_mix import LookupMix
from dflash_cache.generate.proposer import BlockProposer
from dflash_cache.generate.requests import ERROR, LENGTH, STOP, Backend, Completion, Request, StopRule
from dflash_cache.generate.slots import SlotCache
from dflash_cache.generate.targets import CachedTarget, SlotTarget, Target, slot_support
from dflash_cache.target.config import text_config

__all__ = [
    "ERROR",
    "LENGTH",
    "STOP",
    "Backend",
    "BlockProposer",
    "Completion",
    "Engine",
    "LookupMix",
    "Request",
    "StopRule",
    "Target",
    "fit_slots",
    "load_model",
    "make_target",
]


def load_model(path: str, device: torch.device, revision: str | None = None) -> nn.Module:
    """The target for generation: bf16 on a GPU, float32 on a CPU, frozen, in eval mode, with every
    weight from the checkpoint (`target.load.load_causal_lm`). It runs whole on one device: on a
    GPU a target whose weights do not fit is refused before loading."""
    from dflash_cache.target.load import compute_dtype_for, load_causal_lm
    from dflash_cache.target.parallel import check_fits, running_bytes

    if device.type == "cuda":
        need = running_bytes(path, revision, None, compute_dtype_for(device), head=True)
        check_fits(need, torch.cuda.mem_get_info(device)[0], 1, str(device), TOO_BIG)
    model = load_causal_lm(path, compute_dtype_for(device), revision)
    return model.to(device).eval().requires_grad_(False)


TOO_BIG = ("eval and regen without --server run the target whole on one GPU; regen such a target through "
           "--server (vLLM or SGLang with their own tensor parallelism) and see docs/guides/big-targets.md for eval")


def slot_bytes(model: nn.Module, length: int) -> int:
    """Bytes of the key/value buffers one row of `length` positions takes in a `SlotTarget`."""
    tc = text_config(model.config.to_dict())
    heads = tc["num_attention_heads"]
    return SlotCache.bytes_per_slot(tc["num_hidden_layers"], length, tc.get("num_key_value_heads") or heads,
                                    tc.get("head_dim") or tc["hidden_size"] // heads,
                                    model.get_input_embeddings().weight.dtype)  # fmt: skip


def fit_slots(wanted: int, per_slot: int, device: torch.device, *, share: float = 0.6) -> int:
    """`wanted` rows, or as many as fit in `share` of the GPU's free memory (the rest is left for
    the step's activations and logits). CPUs take what they are given."""
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(wanted, int(free * share) // max(1, per_slot)))


def make_target(model: nn.Module, slots: int, length: int, layer_ids: list[int] | None = None) -> Target:
    """A `SlotTarget` of `slots` rows where it can run the model, else a one-row `CachedTarget`."""
    if slot_support(model) is None:
        return SlotTarget(model, slots, length, layer_ids)
    return CachedTarget(model, length, layer_ids)
