"""The train stage's settings: one flat set whose defaults and help texts are the CLI's, the config
files' and bench's (see dflash_cache/core/settings.py), and the drafter config they imply for a given
cache (through the drafter family, `dflash_cache.drafters`).

`TrainConfig` is the trainer's own settings (`TrainerSettings`) followed by every drafter family's
(`drafters/<family>/settings.py`: the backbone's `DrafterSettings` and each family's own fields), so
a family's settings are `dflash train` flags and config-file keys like any other, and a new family
adds its own without touching this module. A run hands its family only that family's settings
(`TrainConfig.drafter_settings`). Light: importing it loads no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dflash_cache import drafters
from dflash_cache.cache.spec import CacheSpec, SpecError, check_drafter_fits
from dflash_cache.core.errors import UserError
from dflash_cache.core.settings import setting
from dflash_cache.drafters.settings import DEFAULT_WINDOW, DrafterSettings

if TYPE_CHECKING:  # a family's code loads torch and transformers; the settings alone must not (the CLI reads them)
    from dflash_cache.drafters import Family


CACHE_APPEAR_S = 120.0  # how long `train --follow` waits for its extract to create the cache directory


class TrainError(UserError, RuntimeError):
    """A training run that cannot start or resume; the message says why."""


@dataclass
class TrainerSettings:
    """The trainer's own settings: the data, the optimisation, checkpoints, devices and validation."""

    cache: Path = setting(help="Cache directory written by `dflash extract`.")
    out: Path = setting(help="Run directory (created, or resumed if it exists).")
    epochs: int = setting(6, "Passes over the cache.", min=1)
    max_steps: int | None = setting(None, "Stop after this many optimizer steps (the schedule still spans all "
                                    "epochs).", min=1)  # fmt: skip
    lr: float = setting(6e-4, "Peak learning rate (AdamW, cosine schedule).", min=0)
    warmup: float = setting(0.04, "Warmup fraction of the run's tokens.", min=0)
    weight_decay: float = setting(0.0, "AdamW weight decay.", min=0, tuning=True)
    clip: float = setting(1.0, "Gradient clipping norm.")
    token_budget: int | None = setting(None, "Context tokens per batch per rank (default: 2048 on a CPU; on a GPU "
                                       "from the drafter's size and the GPU's memory, 8192 for an 8B-shaped "
                                       "drafter on an H200).", min=1)  # fmt: skip
    grad_accum: int = setting(1, "Batches per optimizer step.", min=1)
    grad_reduce: Literal["fp32", "bf16"] = setting("fp32", "Dtype of the DDP gradient all-reduce: fp32, or bf16 "
                                                   "(half the bytes, for slow links).")  # fmt: skip
    drafter: str = setting("dflash", "Drafter family (dflash_cache.drafters): dflash, or dspark (DFlash's backbone "
                           "with DSpark's Markov and confidence heads; it needs a cache extracted with "
                           "--final-hidden).", expects="a drafter family such as dflash or dspark")  # fmt: skip
    seed: int = setting(0, "Seed for weights, shuffling and anchors.")
    save_every: int = setting(200, "Checkpoint every N steps.", min=1)
    keep_checkpoints: int = setting(2, "Checkpoints kept in OUT/checkpoints (the newest).", min=1)
    log_every: int = setting(10, "Metrics every N steps.", min=1)
    gpus: list[int] | None = setting(None, "GPUs, one DDP process each: 5-7.", expects="GPU ids like 0-4 or 0,2,5")
    procs: int = setting(1, "CPU DDP processes (gloo) when no --gpus.", min=1)
    prefetch: int = setting(2, "Batches the loader keeps ready ahead of the step.", min=1, tuning=True)
    readers: int = setting(4, "Loader threads that decode batches.", min=1, tuning=True)
    skip_bad_units: bool = setting(False, "Train without units that fail their checks.")
    trace: bool = setting(False, "Log which samples every batch held to OUT/trace/rank<r>.jsonl.")
    follow: bool | None = setting(None, "On a cache still being extracted, epoch 1 follows the extraction (the "
                                  "default; --no-follow: train on the units committed so far). --follow also waits "
                                  f"up to {CACHE_APPEAR_S:.0f}s for the cache directory to be created.")  # fmt: skip
    wait_report: float = setting(60.0, "While following an extraction and no unit commits, say every N seconds "
                                 "what training waits for.", min=0, tuning=True)  # fmt: skip
    val_fraction: float = setting(0.0, "Hold out this fraction of the cache's units for validation, chosen by a hash "
                                  "of the unit id (at least one unit when above 0).", min=0)  # fmt: skip
    val_cache: Path | None = setting(None, "Validate on this second cache (same target and tokenizer) instead.")
    val_every: int | None = setting(None, "Validate every N steps (default: every --save-every), and at the end; "
                                    "export/ keeps the best by validation acceptance, export-last/ the last.",
                                    min=1)  # fmt: skip
    report_to: str = setting("none", "Also send the metrics to tensorboard (OUT/tensorboard), wandb (offline unless "
                             "WANDB_MODE is set), both (tensorboard,wandb), or none.",
                             expects="tensorboard, wandb, tensorboard,wandb or none")  # fmt: skip


def _extended(base: type, parts: Iterable[type]) -> type:
    """A dataclass with `base`'s fields and, after them, the fields of every class of `parts` (a field
    that parts share through a common base, as every family shares `DrafterSettings`, counts once;
    two parts declaring the same name apart is a programming error)."""
    seen = {f.name: f for f in dataclasses.fields(base)}
    added = []
    for part in parts:
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            if f.name in seen:
                if seen[f.name] is not f:
                    raise TypeError(f"the setting {f.name!r} of {part.__qualname__} is declared elsewhere too")
                continue
            seen[f.name] = f
            added.append((f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                                   metadata=f.metadata)))  # fmt: skip
    cls = dataclasses.make_dataclass(f"{base.__name__}AndDrafters", added, bases=(base,))
    cls.__module__ = base.__module__
    return cls


@dataclass
class TrainConfig(_extended(TrainerSettings, [DrafterSettings, *map(drafters.settings, drafters.names())])):
    """The train stage's settings: the trainer's own, then every drafter family's (module docstring)."""

    def __post_init__(self) -> None:
        """Refuse a window the draft layers cannot take before anything is read or written (the
        drafter's own rule, `DrafterSettings.layer_types`)."""
        try:
            DrafterSettings(draft_layers=self.draft_layers, sliding_window=self.sliding_window,
                            full_attention_layers=self.full_attention_layers).layer_types()  # fmt: skip
        except ValueError as e:
            raise TrainError(f"drafter settings: {e}") from None

    @staticmethod
    def record_path(path: Path) -> Path:
        """`--config RUN` reads the settings a run directory recorded in its train.json."""
        return path / "train.json" if path.is_dir() else path

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A run's train.json as its settings, its window settled (`recorded_window`); any other
        mapping as it is."""
        if not {"identity", "config"} <= data.keys():
            return data
        return {**data["config"], "sliding_window": TrainConfig.recorded_window(data)}

    @staticmethod
    def recorded_window(record: dict[str, Any]) -> int | str:
        """The window of the run a train.json records: its settled setting, else (a record that left
        it unset, as older versions wrote) what its identity names, full attention where it names none."""
        settled = record.get("config", {}).get("sliding_window")
        return settled if settled is not None else record.get("identity", {}).get("sliding_window", "full")

    def family(self) -> Family:
        """The drafter family `drafter` names (TrainError for an unknown name)."""
        try:
            return drafters.family(self.drafter)
        except ValueError as e:
            raise TrainError(f"--drafter: {e}") from None

    def drafter_settings(self) -> DrafterSettings:
        """These settings as the family `drafter` names takes them: its own settings dataclass, without
        the trainer's."""
        try:
            cls = drafters.settings(self.drafter)
        except ValueError as e:
            raise TrainError(f"--drafter: {e}") from None
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def drafter_window(self) -> int | None:
        """The sliding layers' window these settings give (`DrafterSettings.window`), None for full."""
        return DrafterSettings(sliding_window=self.sliding_window).window()

    def for_run(self, recorded: dict[str, Any] | None) -> TrainConfig:
        """These settings with the window settled: an unset --sliding-window is the window the run
        recorded in `recorded` (its train.json) began with, full attention for a run that recorded
        none (older versions' full-attention runs), and DEFAULT_WINDOW for a new run."""
        if self.sliding_window is not None:
            return self
        window = DEFAULT_WINDOW if recorded is None else self.recorded_window(recorded)
        return dataclasses.replace(self, sliding_window=window)

    def identity(self) -> dict[str, Any]:
        """What a resume must match: everything that changes the math, not the run's length."""
        keep = ("lr", "warmup", "weight_decay", "clip", "token_budget", "grad_accum", "draft_layers", "block_size",
                "layers", "max_anchors", "gamma", "seed")  # fmt: skip
        family = self.family()
        settings = {k: getattr(self, k) for k in keep} | {"block_size": self.block_size or family.default_block_size}
        # a run of another family than DFlash says so, with the family's own settings (DFlash runs
        # recorded no family, and resume as they are)
        own = {k: getattr(self, k) for k in family.own_settings()}
        other = {} if family.name == "dflash" else {"drafter": family.name, **own}
        # how batches are dealt to ranks (DDP steps of similar cost) changes which samples share a step
        held = {"val_fraction": self.val_fraction} if self.val_fraction else {}  # held-out units change the data
        # sliding-window layers, only when they slide: runs with full attention everywhere resume as they are
        w = self.drafter_window()
        full = {"full_attention_layers": self.full_attention_layers} if self.full_attention_layers else {}
        window = {} if w is None else {"sliding_window": w, **full}
        return {**settings, "dealing": "cost-balanced", **other, **held, **window}


def drafter_config(cfg: TrainConfig, spec: CacheSpec) -> Any:
    """The drafter family's config (its geometry from the target's config recorded in the cache, and
    its heads) for these settings; refuses settings the drafter cannot take, and misfits."""
    if not spec.target.config:
        raise TrainError("cache.json has no target config (target.config): re-extract with this version")
    family = cfg.family()
    if family.needs_final_hidden:
        try:
            check_drafter_fits(spec, layer_ids=list(spec.layers.ids), final_hidden=True)
        except SpecError as e:
            raise TrainError(f"--drafter {family.name} trains on the target's final hidden state, which "
                             f"{cfg.cache} does not hold: extract it with `dflash extract --final-hidden` ({e})"
                             ) from None  # fmt: skip
    try:
        return family.config(cfg.drafter_settings(), spec)
    except ValueError as e:  # the drafter's own checks (block size, heads, layer ids)
        if isinstance(e, SpecError):
            raise
        raise TrainError(f"drafter settings: {e}") from None
