"""The extract stage's settings: one dataclass whose defaults are the CLI's, the config files' and bench's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ExtractConfig:
    target: str
    data: str
    out: Path
    layers: list[int] | None = None
    num_layers: int = 5  # K, used when `layers` is not given
    revision: str | None = None
    max_length: int = 3072
    truncate: bool = False
    storage: str = "bf16"
    zstd_level: int = 3
    token_budget: int | None = None  # padded tokens per forward; default by device
    unit_mb: int = 512  # hidden-state MiB per unit
    gpus: list[int] | None = None
    procs: int = 1
    tokenize_procs: int = field(default_factory=lambda: max(1, min(8, (os.cpu_count() or 2) - 1)))
    writers: int | None = None  # writer processes (each holds one unit buffer); default 6 on GPU, 2 on CPU
    mask_token_id: int | None = None  # default: the tokenizer's mask token, else len(tokenizer) (see `mask_token_id`)
    chat_template_kwargs: dict[str, Any] | None = None  # passed to every apply_chat_template call
    data_split: str | None = None  # split of a hub dataset or saved DatasetDict
    max_samples: int | None = None  # read only the first N rows of the source
