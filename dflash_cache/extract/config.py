"""The extract stage's settings: one dataclass whose defaults and help texts are the CLI's, the
config files' and bench's (see dflash_cache/core/settings.py). Light: importing it loads no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_cache.core.settings import setting

DATA_HELP = ("Rows: a JSONL / JSON / Parquet file, a saved `datasets` directory, or a hub dataset name; "
             "messages, ShareGPT conversations, Alpaca instruction/output, prompt/response or text.")  # fmt: skip
KWARGS_HELP = """Chat-template kwargs as a JSON object, e.g. '{"enable_thinking": false}'."""
SPLIT_HELP = "Split of a hub dataset or saved DatasetDict (default: train)."
MAX_SAMPLES_HELP = "Read only the first N rows."
TARGET_HELP = "Target model: local directory or a hub id in the local cache."
GPUS_HELP = "GPUs, one process each: 0-4 or 0,2,5."
GPU_IDS = "GPU ids like 0-4 or 0,2,5"


def resolve_rank(project: int | str, basis: str, num_layers: int, hidden_size: int) -> int | None:
    """The stored values a token for `--project` (None: the tapped layers as they are). auto is
    H, rounded up to a multiple of K for a per-layer basis; a rank of every tapped value or more
    projects nothing."""
    if project == "none":
        return None
    rank = hidden_size if project == "auto" else int(project)
    if basis == "per-layer":
        rank = -(-rank // num_layers) * num_layers if project == "auto" else rank
    return None if project == "auto" and rank >= num_layers * hidden_size else rank


def resolve_storage(storage: str, projected: bool) -> str:
    """`--storage auto` is fp8 for a projected cache and bf16 for the layers as they are: the
    smallest storage measured to keep tau for each (QUALITY.md, "Projected caches")."""
    if storage != "auto":
        return storage
    return "fp8" if projected else "bf16"


def resolve_forward_token_budget(token_budget: int | None, cuda: bool) -> int:
    """Padded tokens per forward: the setting, else 16384 on a GPU and 4096 on a CPU."""
    return token_budget or (16384 if cuda else 4096)


@dataclass
class ExtractConfig:
    target: str = setting(help=TARGET_HELP)
    data: str = setting(help=DATA_HELP)
    out: Path = setting(help="Cache directory (created, or resumed if it exists).")
    layers: list[int] | None = setting(None, "Tapped layer ids, e.g. 1,9,17,25,33 (default: DFlash's 5).",
                                       expects="layer ids like 1,9,17")  # fmt: skip
    num_layers: int = setting(5, "How many layers to tap when --layers is not given.", min=1)
    revision: str | None = setting(None, "Hub revision of the target.")
    max_length: int = setting(3072, "Longest sample in tokens; longer rows are rejected.", min=1)
    truncate: bool = setting(False, "Cut rows over --max-length instead of rejecting them.")
    storage: Literal["auto", "bf16", "fp8"] = setting(
        "auto", "bf16, fp8 (float8_e4m3fn with a per-token scale for each layer or basis), or auto: fp8 for a "
        "projected cache, bf16 for the layers as they are.")  # fmt: skip
    final_hidden: bool = setting(False, "Also cache the target's last hidden state after its final norm (the LM "
                                 "head's input), which DSpark drafters train on; the target then runs all its "
                                 "layers (never the LM head).")  # fmt: skip
    project: int | Literal["auto", "none"] = setting(
        "auto", "Store each token's tapped layers projected to R values (a basis fitted on the target's own "
        "features, which the drafter's fc folds back at export, exactly): R, auto (H), or none (the layers "
        "as they are).", min=1)  # fmt: skip
    project_basis: Literal["joint", "per-layer"] = setting(
        "joint", "One basis over the tapped layers together, or one per layer (R/K values each; lets a "
        "drafter read a subset of the layers).")  # fmt: skip
    project_scaling: Literal["layer-rms", "none"] = setting(
        "layer-rms", "Divide each tapped layer by its RMS before fitting the basis, so that quiet layers "
        "count as much as loud ones.", tuning=True)  # fmt: skip
    project_fit_tokens: int = setting(131072, "Tokens of the data the basis is fitted on, spread over the plan.",
                                      min=1, tuning=True)  # fmt: skip
    zstd_level: int = setting(3, "zstd level for the shards.", tuning=True)
    token_budget: int | None = setting(None, "Padded tokens per forward (default 16384 GPU, 4096 CPU).", min=1)
    prefill_chunk: int | None = setting(
        None, "A sample longer than this many tokens runs alone, in chunks of this many tokens that attend to its "
        "earlier ones through the target's key/value cache, for samples one forward cannot hold in GPU memory; the "
        "cache is the same up to rounding. Default: none, one forward a batch, until a sample alone runs out of GPU "
        "memory in one: it and every longer sample after it then run in chunks of at most half its length.",
        min=1)  # fmt: skip
    unit_mb: int = setting(512, "Hidden-state MiB per work unit.", min=1)
    gpus: list[int] | None = setting(None, GPUS_HELP, expects=GPU_IDS)
    procs: int = setting(1, "CPU processes when no --gpus.", min=1)
    tp: int = setting(1, "Processes (GPUs) that shard one copy of the target, by heads and experts where transformers "
                      "has a plan for its family: --gpus 0-7 --tp 4 runs two copies. The cache is the same at any "
                      "--tp.", min=1)  # fmt: skip
    tokenize_procs: int = setting(factory=lambda: max(1, min(8, (os.cpu_count() or 2) - 1)), min=1, tuning=True,
                                  help="Processes that tokenize the data (default: the cores less one, up to 8).")
    writers: int | None = setting(None, "Writer processes: units compressed and written at once, one host buffer "
                                  "each (default 6 with --gpus, else 2).", min=1, tuning=True)  # fmt: skip
    mask_token_id: int | Literal["auto"] | None = setting(
        "auto", "Id for the drafter's masked block slots, or auto: the tokenizer's mask token, else len(tokenizer) "
        "where the embedding table has a spare row, else an added special token (a reserved one first) that no "
        "data row holds and the chat template never writes. cache.json records the choice and why.")  # fmt: skip
    chat_template_kwargs: dict[str, Any] | None = setting(None, KWARGS_HELP)
    data_split: str | None = setting(None, SPLIT_HELP)
    max_samples: int | None = setting(None, MAX_SAMPLES_HELP, min=1)

    @staticmethod
    def record_path(path: Path) -> Path:
        """`--config CACHE` reads the settings a cache was made with from its cache.json."""
        return path / "cache.json" if path.is_dir() else path

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A cache.json as the settings that made it (rerunning them resumes that cache); any other
        mapping as it is."""
        if "format_version" not in data or "plan" not in data:
            return data
        from dflash_cache.cache.spec import CacheSpec
        from dflash_cache.cache.unit.layout import RowFormat

        spec = CacheSpec.from_dict(data)
        return {
            "target": spec.target.path, "revision": spec.target.revision, "data": spec.data.source,
            "out": str(path.parent), "layers": list(spec.layers.ids), "max_length": spec.data.max_length,
            "truncate": spec.data.truncate, "storage": spec.storage.dtype, "final_hidden": spec.layers.final_hidden,
            "zstd_level": spec.storage.codec.get("level", 3), "token_budget": spec.plan.token_budget,
            "unit_mb": round(spec.plan.unit_tokens * RowFormat.of(spec).hidden_bytes / (1 << 20)),
            "mask_token_id": spec.tokenizer.mask_token_id,
            "project": spec.projection.rank if spec.projection else "none",
            **({"project_basis": spec.projection.basis, "project_scaling": spec.projection.scaling,
                "project_fit_tokens": spec.projection.fit_tokens} if spec.projection else {}),
            "chat_template_kwargs": spec.tokenizer.chat_template_kwargs or None,
            "data_split": spec.data.split, "max_samples": spec.data.max_samples,
        }  # fmt: skip
