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
    seed: int = setting(0, "Sampling seed (each request is seeded by it, its row and its turn).")
    batch_size: int | None = setting(None, "Rows decoded at once by the embedded engine (default 256 on a GPU, fewer "
                                     "if its memory does not hold them; 32 on a CPU); the output does not depend "
                                     "on it.", min=1)  # fmt: skip
    part_rows: int = setting(64, "Rows per part, the unit of resume.", min=1, tuning=True)
    max_length: int | None = setting(None, "Positions a row may reach, prompt and replies (default: the longest "
                                     "source conversation plus --max-new-tokens per reply).", min=2,
                                     tuning=True)  # fmt: skip
    drop_truncated: bool = setting(False, "Reject rows with a reply cut at --max-new-tokens (they are counted "
                                   "either way).")  # fmt: skip
    server: str | None = setting(None, "Generate with an OpenAI-compatible server (vLLM, SGLang, llama.cpp) at this "
                                 "URL instead of loading the target; --target still gives the tokenizer and chat "
                                 "template.")  # fmt: skip
    server_model: str | None = setting(None, "The server's model name (default: the one it lists).")
    concurrency: int = setting(16, "Requests in flight to --server.", min=1)
    retries: int = setting(5, "Retries of a failed --server request, with backoff, before its part is left for a "
                           "rerun.", min=0, tuning=True)  # fmt: skip
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
    data: str = setting(help="Prompts: " + DATA_HELP + " Trailing assistant turns are dropped; a turns row "
                        "(MT-Bench's question.jsonl) asks each turn after the target's own answer to the one before.")
    max_new_tokens: int = setting(128, "Tokens to generate per prompt.", min=1)
    temperature: float = setting(0.0, "0: greedy; above 0: speculative sampling.", min=0)
    seed: int = setting(0, "Seed of the sampling generators.")
    block_size: int | None = setting(None, "Block size B (default: the drafter's).", min=2)
    limit: int | None = setting(None, "Use only the first N prompts.", min=1)
    batch_size: int | None = setting(None, "Prompts decoded at once (default 128 on a GPU, as many as fit; 16 on a "
                                     "CPU). 1 gives the single-stream speedup.", min=1)  # fmt: skip
    chat_template_kwargs: dict[str, Any] | None = setting(
        None, KWARGS_HELP + " The DFlash reference benchmark runs Qwen3 with thinking off.")  # fmt: skip
    data_split: str | None = setting(None, SPLIT_HELP)
    first_turn: bool = setting(False, "Ask only the first turn of a turns row (DeepSpec's MT-Bench figure); by "
                               "default every turn is asked, as z-lab's benchmark does.")  # fmt: skip

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A result that `dflash eval --json` wrote: the settings it ran with."""
        if "settings" in data and "tau" in data:
            return {k: v for k, v in data["settings"].items() if k in EvalConfig.__dataclass_fields__}
        return data
