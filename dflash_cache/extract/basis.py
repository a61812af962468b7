"""Fitting a projected cache's basis on the run's own data, before its first unit, and the target
whose taps come out projected through it.

The first worker runs the target over a sample of the plan's batches, spread evenly over the plan
(so every length bucket is in it), as the forward loop runs its units (`fit_projection`), sums the
tapped layers' second moment (`projection.Moments`) and fits W (`projection.fit`). The basis is a
property of the target and the data, not of any one drafter, so one cache still serves every run;
it is fitted once, whatever the number of GPUs or nodes, and stored before cache.json names its
digest.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from dflash_cache.cache.projection import Basis, Moments, fit
from dflash_cache.cache.spec import CacheSpec
from dflash_cache.extract.forward import unit_batches, unit_tokens
from dflash_cache.extract.plan import ForwardBatch, Plan, Unit
from dflash_cache.extract.prefill import Chunking, Target

# The share of a tapped layer's energy under which a basis has been seen to cost tau: on the real
# SmolLM2, H/2 kept 94-95% of three taps and its drafters lost 1-3% per prompt, H kept 97.4-97.5%
# and lost under 1%; the code targets' bases kept 98% or more and lost nothing (QUALITY.md).
LOW_ENERGY = 0.97


def fit_sample(plan: Plan, tokens: int) -> list[tuple[Unit, ForwardBatch]]:
    """Batches of the plan holding about `tokens` real tokens (all of them when the plan holds
    fewer), evenly spaced over the plan's order."""
    batches = [(u, b) for u in plan.units for b in u.batches]
    sizes = np.array([int(u.lengths[b.start : b.stop].sum()) for u, b in batches])
    total = int(sizes.sum())
    if total <= tokens:
        return batches
    step = total / tokens  # take the batch that holds every step-th token, more or less
    picked, taken = [], 0
    for i in np.unique(np.floor(np.arange(0, len(batches), step)).astype(np.int64)):
        picked.append(batches[int(i)])
        taken += int(sizes[i])
        if taken >= tokens:
            break
    return picked


def fit_basis(features: Iterable[tuple[list[torch.Tensor], torch.Tensor]], spec: CacheSpec,
              device: torch.device) -> tuple[Basis, CacheSpec]:  # fmt: skip
    """Fit the basis `spec.projection` asks for on the target's own features: each of `features`
    is a forward's outputs (padded [b, T, H] each) and the flat indices of their real tokens, as
    the stage runs the target (`fit_projection`); returns the basis and the spec completed with
    what the fit measured (its digest is filled in when the basis is saved)."""
    proj = spec.projection
    assert proj is not None
    k, h = len(spec.layers.ids), spec.target.hidden_size
    moments = Moments(k, h, device)
    with torch.inference_mode():
        for outputs, rows in features:
            taps = outputs[:k]
            moments.add([t.reshape(-1, h).index_select(0, rows) for t in taps])
        basis, kept = fit(moments, proj, k)
    done = dataclasses.replace(proj, fitted_tokens=moments.tokens, retained_energy=kept)
    return basis, dataclasses.replace(spec, projection=done)


def energy_note(spec: CacheSpec) -> str:
    """The fit's energy kept per tapped layer, and which layers keep under LOW_ENERGY with a larger
    rank to try: the figure a user needs to choose --project for a real target."""
    proj = spec.projection
    assert proj is not None and proj.retained_energy
    shown = [f"{100 * e:.1f}" for e in proj.retained_energy]  # judged as shown: no "97.0%" said to be under 97%
    note = "energy kept per tapped layer: " + ", ".join(f"{e}%" for e in shown)
    low = [str(layer) for layer, e in zip(spec.layers.ids, shown, strict=True) if float(e) < 100 * LOW_ENERGY]
    if not low:
        return note
    k = len(spec.layers.ids)
    largest = k * spec.target.hidden_size - (k if proj.basis == "per-layer" else 1)  # a rank extract takes
    more = min(2 * proj.rank, largest)
    larger = f"--project {more} keeps more, " if more > proj.rank else ""
    return (f"{note}; layer{'s' * (len(low) > 1)} {', '.join(low)} keep{'s' * (len(low) == 1)} under "
            f"{LOW_ENERGY:.0%} (on a real target, 94-95% cost its drafters 1-3% of tau): {larger}--project none "
            "everything")  # fmt: skip


def fit_projection(target: Target, spec: CacheSpec, plan: Plan, dataset, device: torch.device,
                   chunk: Chunking | int | None = None) -> tuple[Basis, CacheSpec]:  # fmt: skip
    """Fit the basis `spec.projection` asks for (`fit_basis`) on the plan's fit sample, run
    as the stage runs its units (batched, long samples in chunks); the spec it returns has what the
    fit measured, not yet a digest."""
    pad_id = spec.tokenizer.pad_token_id or 0
    chunking = Chunking.of(chunk)

    def features() -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        for _, picked in itertools.groupby(fit_sample(plan, spec.projection.fit_tokens), key=lambda ub: ub[0].id):
            chosen = list(picked)  # one unit's batches, in plan order
            unit = chosen[0][0]
            ids = unit_tokens(dataset, unit)[0]
            for _, _, lengths, _, inp, rows in unit_batches(unit, ids, pad_id, device, [b for _, b in chosen]):
                for *_, outputs, index in chunking.forwards(target, inp, rows, lengths):
                    yield outputs, index

    return fit_basis(features(), spec, device)


def projecting(target: Target, basis: Basis, num_layers: int) -> Target:
    """`target` whose tapped layers come out projected: one output per group of the basis, then the
    final hidden state as it is, when the cache holds it."""

    def projected(inp: torch.Tensor, **kwargs) -> list[torch.Tensor]:
        outputs = target(inp, **kwargs)
        return basis.project(outputs[:num_layers]) + outputs[num_layers:]

    return projected
