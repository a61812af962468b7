"""Greedy tau without speculative decoding: a drafter's acceptance replayed on the target's own output.

Under greedy decoding speculation reproduces the target alone's output, whatever the drafter, so
what a drafter accepts at each step follows from the prompt and that output alone (as prompt
lookup's does: `lookup.acceptance_lengths`). The target runs once over prompt + output (a prefill:
its tapped states at every position), the drafter once over a block at every anchor a decode could
start a step from (its training forward, in which each block sees the context before its anchor),
and the walk then takes the decode's steps: after t committed tokens the anchor is the t-th, the
drafts that equal the output's next tokens are accepted, and they and the target's own token are
committed.

That is one forward of each model per prompt instead of a decode per drafter, so many drafters can
be compared on the outputs of one target-alone run. It is the decode's tau up to rounding: the
decode takes the context's states from its verify steps and the drafter's attention from the slot
cache, the replay from one prefill and the training forward; in float32 they agree (tests).

`replayed` is the driver: `dflash eval`'s result for another drafter on an earlier evaluation's
greedy outputs (`dflash eval-sets --replay` compares drafters this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache.core.devices import Worker, flush_denormals
from dflash_cache.core.threads import worker_threads
from dflash_cache.drafters import Family
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.decode import EvalError, check_config, load_drafter
from dflash_cache.eval.metrics import EvalResult, acceptance, tau
from dflash_cache.generate import load_model, make_target
from dflash_cache.generate import lookup as prompt_lookup
from dflash_cache.generate.requests import Chooser
from dflash_cache.generate.targets import Target

__all__ = ["acceptance_lengths", "replayed"]


@torch.inference_mode()
def acceptance_lengths(target: Target, drafter: nn.Module, family: Family, embed: Tensor, head: Tensor,
                       prompt: Sequence[int], output: Sequence[int], block_size: int, lookup: int = 0
                       ) -> tuple[list[int], int]:  # fmt: skip
    """(tokens committed per verification step, drafts per block) when `drafter` (of `family`,
    reading `target`'s tapped states) speculates the greedy `output` of the target on `prompt` with
    blocks of `block_size`.

    `output` is what greedy decoding generated, stop token and length limit included; its first
    token comes from the prefill, so an output of length 1 has no step. `target` is a `Target` of
    the drafter's tapped layers with a row of room for prompt + output; its row 0 is overwritten.
    With `lookup` = N > 0, a step drafts by prompt lookup where the context's last N tokens occurred
    before (`generate.lookup_mix.LookupMix`)."""
    n = len(output)
    if n < 2:
        return [], 0
    seq = [*prompt, *output]
    base, device = len(prompt), embed.device
    _, states = target.prefill([0], [tuple(seq[:-1])])  # every position a block's context can hold
    anchors = torch.arange(base, base + n - 1, device=device)  # step t's anchor: the t-th output token
    ids = torch.tensor(seq, device=device)
    blocks = family.block_input(ids[anchors], block_size, drafter.config.mask_token_id)
    layout = BlockLayout.build(torch.tensor([0, states.shape[1]], device=device),
                               torch.zeros_like(anchors), anchors, block_size)  # fmt: skip
    dtype = drafter.fc.weight.dtype
    hidden = drafter(F.embedding(blocks.flatten(), embed).to(dtype), states[0].to(dtype), layout)
    drafts, _ = family.draft(drafter, hidden.view(*blocks.shape, -1), blocks, head, Chooser(0.0))
    # accepted[t - 1]: how many of step t's drafts equal output[t], output[t + 1], ...
    k = drafts.shape[1]
    padded = torch.cat([ids[base:], ids.new_full((k,), -1)])
    wanted = padded[torch.arange(1, n, device=device)[:, None] + torch.arange(k, device=device)]
    accepted = (drafts == wanted).long().cumprod(1).sum(1).tolist()
    if lookup:
        return prompt_lookup.acceptance_lengths(prompt, output, block_size=k + 1, drafter=accepted, trust=lookup,
                                                max_ngram=prompt_lookup.mixed_max_ngram(lookup)), k  # fmt: skip
    return prompt_lookup.walk(n, lambda t: accepted[t - 1]), k


def replayed(cfg: EvalConfig, earlier: EvalResult) -> EvalResult:
    """`cfg.drafter`'s greedy tau on the prompts and outputs of `earlier`, an evaluation of the same
    target (`acceptance_lengths`; the module docstring): what decoding with it would give, up
    to rounding, at one forward of each model per prompt. No speed is measured (its speed figures are
    0 and its spec_seconds None); the lookup figures are `earlier`'s, which are the outputs'."""
    check_config(cfg)
    if earlier.settings["temperature"] != 0:
        raise EvalError("a replay needs greedy outputs (temperature 0)")
    if Path(earlier.settings["target"]) != Path(cfg.target):
        raise EvalError(f"the outputs are {earlier.settings['target']}'s, not {cfg.target}'s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(cfg.target, device)
    drafter, dcfg, family = load_drafter(cfg, model, device)
    B = cfg.block_size or dcfg.block_size
    length = max(s["prompt_tokens"] + s["new_tokens"] for s in earlier.samples) + 16
    target = make_target(model, 1, length, dcfg.target_layer_ids)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    samples, drafts = [], 0
    with flush_denormals(device), worker_threads(Worker(0, 1, device)):
        for s in earlier.samples:
            lengths, k = acceptance_lengths(target, drafter, family, embed, head, s["prompt_ids"],
                                            s["output_ids"], B, cfg.lookup)  # fmt: skip
            drafts = max(drafts, k)
            # the decode's seconds are not this drafter's: its speed by context is left out
            samples.append(s | {"steps": len(lengths), "tau": tau(lengths), "acceptance_lengths": lengths,
                                "same_as_target": None, "first_difference": None, "seconds": None,
                                "prefill_seconds": None})  # fmt: skip
    return EvalResult(
        **acceptance(samples, drafts), new_tokens=sum(s["new_tokens"] for s in samples), spec_tok_s=0.0,
        target_tok_s=earlier.target_tok_s, speedup=0.0, samples=samples, lookup=earlier.lookup,
        rejected=earlier.rejected,
        settings=earlier.settings | {"drafter": str(cfg.drafter), "block_size": B, "drafter_family": family.name,
                                     "target_layer_ids": list(dcfg.target_layer_ids), "lookup": cfg.lookup,
                                     "spec_seconds": None,
                                     "spec_prefill_seconds": None, "replayed": True},
    )  # fmt: skip
