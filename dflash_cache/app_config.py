"""The settings of the apps above the stages, `dflash regen` and `dflash eval`: dataclasses whose
defaults and help texts are the CLI's and the config files' (see dflash_cache/settings.py).

They live apart from regen.py and evaluate.py so that reading them loads no torch: the CLI builds
every command's options from them at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cache.extract.config import (
    DATA_HELP,
    GPU_IDS,
    GPUS_HELP,
    KWARGS_HELP,
    MAX_SAMPLES_HELP,
    SPLIT_HELP,
    TARGET_HELP,
)
from dflash_cache.settings import SettingsError, setting


def regen_record(out: Path) -> Path:
    """Beside regen's output: what it was regenerated from, so a rerun never passes off old rows."""
    return out.with_name(f".{out.name}.regen.json")


@dataclass
class RegenConfig:
    target: str = setting(help=TARGET_HELP)
    data: str = setting(help=DATA_HELP)
    out: Path = setting(help="Output .jsonl (parts are kept in OUT.parts/ until done; rerun to resume).")
    max_new_tokens: int = setting(512, "Longest regenerated turn.", min=1)
    temperature: float = setting(0.0, "0: greedy.", min=0)
    seed: int = setting(0, "Sampling seed (each part is seeded by its id).")
    batch_size: int = setting(32, "Prompts per generate call.", min=1)
    part_rows: int = setting(64, "Rows per part, the unit of resume.", min=1, tuning=True)
    revision: str | None = setting(None, "Hub revision of the target.")
    gpus: list[int] | None = setting(None, GPUS_HELP, expects=GPU_IDS)
    procs: int = setting(1, "CPU processes when no --gpus.", min=1)
    chat_template_kwargs: dict[str, Any] | None = setting(None, KWARGS_HELP)
    data_split: str | None = setting(None, SPLIT_HELP)
    max_samples: int | None = setting(None, MAX_SAMPLES_HELP, min=1)

    @staticmethod
    def record_path(path: Path) -> Path:
        """`--config OUT.jsonl` reads the settings that output was regenerated with."""
        return regen_record(path) if path.suffix == ".jsonl" else path

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        if "config" in data and "part_rows" in data:
            return data["config"]
        if "part_rows" in data:
            raise SettingsError(f"--config {path}: recorded by an older dflash regen, without the settings to rerun")
        return data


@dataclass
class EvalConfig:
    target: str = setting(help=TARGET_HELP)
    drafter: Path = setting(help="Exported drafter (config.json + model.safetensors), e.g. RUN/export.")
    data: str = setting(help="Prompts: " + DATA_HELP + " Trailing assistant turns are dropped.")
    max_new_tokens: int = setting(128, "Tokens to generate per prompt.", min=1)
    temperature: float = setting(0.0, "0: greedy; above 0: speculative sampling.", min=0)
    seed: int = setting(0, "Seed of the sampling generators.")
    block_size: int | None = setting(None, "Block size B (default: the drafter's).", min=2)
    limit: int | None = setting(None, "Use only the first N prompts.", min=1)
    chat_template_kwargs: dict[str, Any] | None = setting(
        None, KWARGS_HELP + " The DFlash reference benchmark runs Qwen3 with thinking off.")  # fmt: skip
    data_split: str | None = setting(None, SPLIT_HELP)

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A result that `dflash eval --json` wrote: the settings it ran with."""
        if "settings" in data and "tau" in data:
            return {k: v for k, v in data["settings"].items() if k in EvalConfig.__dataclass_fields__}
        return data
