"""The settings of the `dflash bench` commands, one dataclass a command, declared with `setting()`
as the stages' are (dflash_cache/core/settings.py): the CLI builds each command's options from them
and the benchmark functions take their defaults from them. A setting that means what a stage's
setting means is declared `same_as` it (its default, help and checks); where a benchmark's default
differs from the stage's, its help says why.

Light: importing it loads no torch (the CLI reads it at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dflash_cache.core.settings import same_as, setting
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.train.config import TrainConfig


@dataclass
class DiskBenchConfig:
    size_mb: int = setting(2048, "MiB to write and read back.")


@dataclass
class CodecBenchConfig:
    level: int = setting(ExtractConfig.zstd_level, "zstd level (dflash extract's --zstd-level).")


@dataclass
class CommitBenchConfig:
    units: int = setting(8, "Units to commit per variant.")
    writers: int = setting(2, "Writer threads / processes.")


@dataclass
class ExtractBenchConfig:
    out: Path = setting(help="Where to write the benchmark cache.")
    tokens: int = setting(1_000_000, "Tokens of the synthetic log-normal length mix.")
    storage: Literal["auto", "bf16", "fp8"] = same_as(ExtractConfig, "storage")
    token_budget: int | None = same_as(ExtractConfig, "token_budget")
    writers: int = setting(6, "Unit writer processes (dflash extract's default with --gpus, here on a CPU too).")
    peer: bool = setting(False, "Also run the one-torch.save-per-sample baseline and both loaders.")
    long: bool = setting(False, "Samples of 16K to 32K tokens instead of the chat mix.")
    length: int | None = setting(None, "Every sample this many tokens instead of the chat mix: as many as --tokens "
                                 "holds, at least one.", min=1)  # fmt: skip
    prefill_chunk: int | None = same_as(ExtractConfig, "prefill_chunk")
    shape: str = setting("qwen3-8b", "The random target's shape: qwen3-8b, or the hybrid (linear attention) "
                         "qwen3.5-9b or qwen3.5-27b.")  # fmt: skip
    like: str | None = setting(None, "A target (model directory) whose shape the random target takes instead of "
                               "--shape's; only its config.json is read.")  # fmt: skip
    final_hidden: bool = same_as(ExtractConfig, "final_hidden")
    project: int | None = setting(None, "Projected values a token (the stage's basis fitted on the random target's "
                                  "features); default: the tapped layers as they are, where dflash extract "
                                  "projects to H values in fp8 unless told --project none.")  # fmt: skip
    project_basis: Literal["joint", "per-layer"] = same_as(ExtractConfig, "project_basis")


@dataclass
class TrainBenchConfig:
    cache: Path = setting(help="A cache, e.g. the one `dflash bench extract` wrote.")
    steps: int = setting(20, "Measured steps per phase.")
    token_budget: int | None = same_as(TrainConfig, "token_budget", "On a small cache the default is the one "
                                       "dflash train picks for a large one.")  # fmt: skip
    max_anchors: int = same_as(TrainConfig, "max_anchors")
    readers: int = same_as(TrainConfig, "readers")
    cold: bool = setting(False, "Drop the cache from the page cache: read the disk.")
    drafter: str = same_as(TrainConfig, "drafter")
    block_size: int | None = same_as(TrainConfig, "block_size")
    draft_layers: int = same_as(TrainConfig, "draft_layers", "(dflash recipe trains 2.)")
    sliding_window: int | Literal["full"] | None = same_as(
        TrainConfig, "sliding_window", "The useful FLOPs count only the keys a window lets a block attend.")
    full_attention_layers: list[int] | None = same_as(TrainConfig, "full_attention_layers")
    length: int | None = setting(None, "Write a cache of samples of this many tokens to --cache first (random "
                                 "values of what dflash extract stores at --shape's width, as --project and "
                                 "--storage say, through the extract stage's own path: a drafter's step costs the "
                                 "same whatever their values), as many as the warm-up and measured steps take, and "
                                 "measure on it.", min=1)  # fmt: skip
    shape: str = same_as(ExtractBenchConfig, "shape", "(With --length.)")
    like: str | None = same_as(ExtractBenchConfig, "like", "(With --length.)")
    project: int | Literal["auto", "none"] = setting(
        ExtractConfig.project, "With --length, the values a token the cache holds, as dflash extract --project "
        "stores them: R, auto (H under one basis over the tapped layers: what dflash extract writes by default), or "
        "none (the layers as they are). A projected cache holds random values beside a random orthonormal basis, "
        "which the train stage loads and checks as a fitted one.", min=1)  # fmt: skip
    storage: Literal["auto", "bf16", "fp8"] = same_as(ExtractConfig, "storage", "(With --length.)")
    profile: Path | None = setting(None, "Then profile two more in-memory steps (torch.profiler) and write their "
                                   "operators by device time, as a table, to this file, under their wall and "
                                   "device time and, on a GPU, the kernel classes' shares.")  # fmt: skip


@dataclass
class RanksBenchConfig:
    cache: Path | None = setting(None, "Use this cache's sample lengths (default: the synthetic mix).")
    samples: int = setting(4000, "Samples of the synthetic log-normal mix, without --cache.")
    token_budget: int = setting(4096, "Context tokens per batch (a fixed figure: dflash train's default follows "
                                "the GPU's memory, and the prediction runs without one).")  # fmt: skip
    max_anchors: int = same_as(TrainConfig, "max_anchors")
    block_size: int | None = same_as(TrainConfig, "block_size")
    ranks: list[int] = setting(help="Rank counts to predict.", factory=lambda: [2, 4, 8],
                               expects="rank counts like 2,4,8")  # fmt: skip


@dataclass
class RegenBenchConfig:
    target: str | None = setting(None, "A model directory (default: a random model of --shape).")
    shape: str | None = setting(None, "A random model of this shape: qwen3-8b or smollm2-135m.")
    data: str | None = setting(None, "Prompts (any row form; default: random tokens).")
    prompts: int = setting(1024, "Requests to decode.")
    prompt_tokens: int = setting(128, "Mean length of the random prompts.")
    max_new_tokens: int = setting(256, "Tokens per request: a random model never stops early, so every request "
                                  "decodes this many (dflash regen's --max-new-tokens, 512, only caps a "
                                  "reply).")  # fmt: skip
    batch_size: int = setting(256, "Rows decoded at once (fewer if they do not fit; dflash regen's default on a "
                              "GPU).")  # fmt: skip
