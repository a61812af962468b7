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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_cache.drafters import Family
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.generate import lookup as prompt_lookup
from dflash_cache.generate.requests import Chooser
from dflash_cache.generate.targets import Target


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
