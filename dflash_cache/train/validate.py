"""Validation: the drafter on samples it never trains on, every N steps, and the best export.

Where the samples come from (`ValSet`):

- `--val-fraction F` holds out units of the training cache, `held_out_units(plan units, F)`: the
  units whose hashed ids rank lowest, round(F x units) of them (at least one when F > 0 and the
  plan has two or more). The choice is a pure function of the plan, which cache.json fixes when
  the cache is created, so it is known before any unit commits and never changes while a followed
  extraction grows the cache: a unit is held out from the start or never. Hashing spreads the held-
  out units over the plan, which orders units longest samples first, so they cover every length.
  The training loader is given `ValSet.train_units`, which excludes them.
- `--val-cache DIR`: every committed unit of a second cache, which must come from the same target
  weights and tokenizer and hold the drafter's layers (`check_val_cache`, through cache/spec.py).

`Validator` computes, over those samples, with the same blocks every time (anchors drawn by
generators seeded with (seed, VAL_KEY, batch, rank), never the global RNG, so training after a
validation is bitwise what it would have been without it):

- `val_loss`: the training loss (the drafter family's objective; DFlash: the slot-decayed
  cross-entropy), pooled over all validation blocks by their loss weight; and each of the
  family's named loss terms as `val_<name>` (DSpark: its CE, L1 and confidence terms);
- `val_slot_acc[i]`: how often the i-th drafted token's argmax is right (DFlash: slot i + 1's,
  the token at anchor + i + 1);
- `val_accept_len`: per block, 1 + the number of leading drafted tokens whose argmax
  equals the target token, averaged over blocks. This is what greedy speculative decoding would
  commit per verification step given the cached context: the block's context is the target's own
  hidden states before the anchor (exactly what the target hands the drafter at inference), the
  anchor is the last verified token, the target accepts the drafted tokens up to the first one
  that differs from its own greedy choice, and adds one token of its own (the 1). On data the
  target regenerated greedily (`dflash regen`), the cached next tokens are its greedy choices, so
  the figure is exact for those positions; on other data it measures agreement with the data.
  A slot the loss mask leaves out ends the run, as `metrics.block_metrics` counts it.

`BestExport` keeps `export/` on the best validation acceptance and `export-last/` on the last weights.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_cache.cache.spec import CacheSpec, SpecError, check_drafter_fits, read_spec
from dflash_cache.cache.store import committed_units
from dflash_cache.drafters import Objective
from dflash_cache.train.loader import CacheLoader
from dflash_cache.train.metrics import all_reduce_sums, block_metrics, summarize_metrics
from dflash_cache.train.stream import PackedBatch

if TYPE_CHECKING:
    from dflash_cache.train.config import TrainConfig

VAL_KEY = 0x7A1  # in the validation anchors' seed, apart from training's (seed, epoch, batch, rank)
EXPORT, EXPORT_LAST = "export", "export-last"
# what must be equal for a second cache's samples to be valid for a drafter of the training cache
_SAME_TARGET = ("target.weights_fingerprint", "target.config_digest", "tokenizer.digest",
                "tokenizer.chat_template_digest")  # fmt: skip


def held_out_units(num_units: int, fraction: float) -> frozenset[int]:
    """The plan's units held out for validation: round(fraction x num_units) of them, at least one
    when fraction > 0 and num_units > 1, never all; those whose ids hash lowest (blake2b)."""
    if not 0 <= fraction < 1:
        raise SpecError(f"val_fraction: {fraction} is outside [0, 1)")
    if fraction == 0 or num_units < 2:
        return frozenset()
    k = min(max(1, round(fraction * num_units)), num_units - 1)
    rank = sorted(range(num_units), key=lambda u: hashlib.blake2b(b"dflash-val-%d" % u, digest_size=8).digest())
    return frozenset(rank[:k])


def check_val_cache(train_dir: Path, val_dir: Path, layer_ids: list[int], final_hidden: bool = False,
                    train_spec: CacheSpec | None = None) -> CacheSpec:  # fmt: skip
    """Refuse a validation cache that is the training cache, comes from other target weights or
    another tokenizer, or lacks the drafter's layers (or the final hidden state it trains on),
    naming the field; returns its spec. `train_spec`: the training cache's, when already read."""
    train, val = train_spec or read_spec(train_dir), read_spec(val_dir)
    if Path(train_dir).resolve() == Path(val_dir).resolve() or (train.created, train.data.fingerprint) == (
            val.created, val.data.fingerprint):  # fmt: skip
        raise SpecError(f"--val-cache {val_dir} is the training cache; hold out part of it with --val-fraction")
    diffs = [d for d in train.differences(val) if d.split(" ", 1)[0] in _SAME_TARGET]
    if diffs:
        raise SpecError(f"--val-cache {val_dir} does not fit the training cache: " + "; ".join(diffs))
    basis = [s.projection and (s.projection.digest, s.layers.ids) for s in (train, val)]
    if basis[0] != basis[1]:  # its values would mean something else to the drafter's fc

        def stored(s: CacheSpec) -> str:
            return "projected" if s.projection else "as they are"

        other = " onto another basis" if train.projection and val.projection else ""
        raise SpecError(f"--val-cache {val_dir} stores its tapped layers {stored(val)}{other}, the training cache "
                        f"{stored(train)} (projection); hold out part of the training cache with --val-fraction")
    try:
        check_drafter_fits(val, layer_ids=layer_ids, final_hidden=final_hidden)
    except SpecError as e:
        raise SpecError(f"--val-cache {val_dir}: {e}") from None
    return val


@dataclass(frozen=True)
class ValSet:
    """The validation samples: the `units` of `cache` (None: every unit of a second cache), and the
    cache's `spec` when it has been read."""

    cache: Path
    units: frozenset[int] | None = None
    spec: CacheSpec | None = field(default=None, compare=False, repr=False)

    @classmethod
    def choose(cls, train_cache: Path, spec: CacheSpec, *, fraction: float = 0.0, val_cache: Path | None = None,
               layer_ids: list[int], final_hidden: bool = False) -> ValSet | None:  # fmt: skip
        """The set `--val-fraction`/`--val-cache` ask for, checked; None without validation, or when
        the cache has a single unit to hold out from."""
        if val_cache is not None and fraction > 0:
            raise SpecError("--val-cache and --val-fraction: choose one")
        if val_cache is not None:
            return cls(Path(val_cache), spec=check_val_cache(train_cache, val_cache, layer_ids, final_hidden, spec))
        held = held_out_units(spec.plan.num_units, fraction)
        return cls(Path(train_cache), held, spec) if held else None

    def includes(self, unit: int) -> bool:
        return self.units is None or unit in self.units

    @property
    def train_units(self) -> Callable[[int], bool] | None:
        """The training loader's unit filter: every unit but the held-out ones (None: all)."""
        held = self.units
        return None if held is None else (lambda u: u not in held)

    def committed(self) -> frozenset[int]:
        """The validation units committed so far (a cache may still be extracted)."""
        return frozenset(u for u in committed_units(self.cache) if self.includes(u))


def val_generator(seed: int, batch: int, rank: int) -> torch.Generator:
    """The anchors' generator of validation batch `batch` on `rank`: the same blocks every time."""
    key = 0
    for part in (seed, VAL_KEY, batch, rank):
        key = (key * 1_000_003 + part) % (1 << 63)
    g = torch.Generator()
    g.manual_seed(key)
    return g


class Validator:
    """Validation every `every` steps over a `ValSet`, on every DDP rank (each takes its share of
    the batches; the sums are reduced), returning a metrics record.

    `objective` is the drafter family's, bound to the run's settings (each rank's own loss
    normalisation: validation sums across ranks itself). `loader(units)` opens a loader restricted
    to the given units (see `open_loader`). It is opened once, and again only when more validation
    units have committed since (a followed cache)."""

    def __init__(self, vset: ValSet, *, every: int, objective: Objective, seed: int, rank: int,
                 loader: Callable[[frozenset[int]], CacheLoader]):  # fmt: skip
        self.vset, self.every, self.seed, self.rank = vset, every, seed, rank
        self.objective = objective
        self.open_loader = loader
        self.loader: CacheLoader | None = None
        self.units: frozenset[int] = frozenset()

    @classmethod
    def of(cls, vset: ValSet, cfg: TrainConfig, objective: Objective, training: CacheLoader) -> Validator:
        """The validator of a training run: `objective` (its family's, bound to the run, each rank's own
        loss normalisation), the run's seed and readers, the layers, batch size, rank and device of its
        `training` loader, every `val_every` steps (default: every `save_every`, so each checkpoint
        follows a validation)."""
        loader = partial(open_loader, vset, layer_ids=training.layer_ids, token_budget=training.token_budget,
                         seed=cfg.seed, rank=training.rank, world_size=training.world_size, device=training.device,
                         readers=cfg.readers, final_hidden=training.final_hidden, spec=vset.spec)  # fmt: skip
        return cls(vset, every=cfg.val_every or cfg.save_every, objective=objective, seed=cfg.seed,
                   rank=training.rank, loader=loader)  # fmt: skip

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _batches(self) -> Iterable[PackedBatch]:
        units = self.vset.committed()
        if self.loader is None or units != self.units:
            self.close()
            self.loader, self.units = self.open_loader(units), units
        return self.loader.epoch(0)

    @torch.no_grad()
    def run(self, model: torch.nn.Module, embed: torch.Tensor, head: torch.Tensor, step: int) -> dict[str, Any]:
        """Validate `model` (the module itself, not its DDP wrapper) at `step`; every rank calls it."""
        t0 = time.perf_counter()
        device = embed.device
        empty = torch.zeros(0, model.config.block_size, device=device)
        sums = {k: v.clone() for k, v in block_metrics(empty.bool(), empty).items()}
        # name -> [numerator, denominator]; every rank validates as many batches (the loader deals
        # them evenly), so every rank has the same terms to reduce
        terms: dict[str, torch.Tensor] = {}
        pooled = torch.zeros(4, dtype=torch.float64, device=device)  # loss x weight, weight, samples, tokens
        first = 1
        training = model.training
        model.eval()
        try:
            for i, batch in enumerate(self._batches()):
                out = self.objective(model, embed, head, batch, val_generator(self.seed, i, self.rank))
                blocks, first = out.blocks, out.blocks.first_slot
                weight = blocks.weights.sum().double()
                counts = torch.tensor([len(batch.sample_index), batch.num_tokens], device=device)
                pooled += torch.cat([torch.stack([out.loss.detach().double() * weight, weight]), counts])
                for k, v in block_metrics(out.correct, blocks.weights, first).items():
                    sums[k] += v
                for name, (num, den) in out.terms.items():
                    pair = torch.stack([num.detach().double(), den.detach().double()])
                    terms[name] = terms[name] + pair if name in terms else pair
        finally:
            model.train(training)
        sums = all_reduce_sums({**sums, "pooled": pooled, **{f"term.{k}": v for k, v in terms.items()}})
        stats = summarize_metrics(sums, first)
        loss_w, weight, samples, tokens = sums["pooled"].tolist()
        named = {f"val_{k[5:]}": float(v[0] / v[1]) if v[1] > 0 else 0.0 for k, v in sums.items()
                 if k.startswith("term.")}  # fmt: skip
        return {"step": step, "val_loss": loss_w / weight if weight > 0 else 0.0, **named,
                "val_slot_acc": stats["slot_acc"],
                "val_accept_len": stats["accept_len"], "val_blocks": stats["blocks"], "val_samples": int(samples),
                "val_tokens": int(tokens), "val_units": len(self.units), "val_seconds": time.perf_counter() - t0,
                "time": time.time()}  # fmt: skip

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None


def open_loader(vset: ValSet, units: frozenset[int], *, layer_ids: list[int], token_budget: int, seed: int,
                rank: int, world_size: int, device: torch.device, readers: int = 4, final_hidden: bool = False,
                spec: CacheSpec | None = None) -> CacheLoader:  # fmt: skip
    """A loader of the validation `units` only, not following: one host slot (validation is
    short and rare), this rank's share of the batches (and the final hidden state, if asked).
    `spec`: the validation cache's, when the caller has read it."""
    kwargs = {} if vset.units is None else {"units": lambda u: u in units}
    return CacheLoader(vset.cache, spec=spec, layer_ids=layer_ids, token_budget=token_budget, seed=seed, rank=rank,
                       world_size=world_size, device=device, prefetch=0, readers=readers, follow=False,
                       final_hidden=final_hidden, **kwargs)  # fmt: skip


class BestExport:
    """`export/` holds the drafter of the best validation acceptance so far, `export-last/` the last
    weights; without validation, `export/` is the last, as it always was.

    Acceptance is compared only between validations of the same samples: while a followed
    extraction is still committing held-out units the set grows, and the first validation on a
    larger set starts the comparison again. `save(dir)` writes the serving format of the current
    weights (rank 0 only; pass a no-op elsewhere). Its state goes into checkpoints, so a resumed run
    compares against the best before the checkpoint; steps redone after it reach the same weights
    and validations, so they decide export/ as the first attempt did."""

    def __init__(self, run_dir: Path, save: Callable[[Path], None]):
        self.best_dir, self.last_dir = Path(run_dir) / EXPORT, Path(run_dir) / EXPORT_LAST
        self.save = save
        self.best: dict[str, Any] | None = None  # {"step", "accept_len", "samples"}
        self.validated: int | None = None  # the step of the last validation

    def update(self, record: Mapping[str, Any]) -> bool:
        """Take a validation record; export the current weights to export/ if they are the best."""
        self.validated = record["step"]
        if not record.get("val_blocks"):
            return False
        same = self.best is not None and self.best["samples"] == [record["val_units"], record["val_samples"]]
        if same and record["val_accept_len"] <= self.best["accept_len"]:
            return False
        self.save(self.best_dir)
        self.best = {"step": record["step"], "accept_len": record["val_accept_len"],
                     "samples": [record["val_units"], record["val_samples"]]}  # fmt: skip
        return True

    def finish(self) -> Path:
        """At the end of the run: the last weights to export-last/ (export/ when there was no
        validation). Returns where they went."""
        where = self.last_dir if self.best is not None else self.best_dir
        self.save(where)
        return where

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "validated": self.validated}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.validated = state.get("best"), state.get("validated")
