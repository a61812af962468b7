"""Training metrics: summed across DDP ranks, appended to a JSONL file in the run directory; the
useful FLOPs of a step, and the hardware peak they are measured against (MFU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Dense bf16 peak FLOP/s by GPU name (vendor datasheets; SXM parts). MFU is left out elsewhere.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device`, or None where it is not known (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


class StepFlops:
    """Useful FLOPs of a training step, from the model's geometry and the batch's layout:

    - draft layers, forward and backward: 6 * P_layers * blocks * B;
    - frozen LM head, forward and input gradient: 4 * V * H * blocks * (B - 1);
    - `fc` and the per-layer k/v projections of the context: 4 * P_ctx * context_tokens;
    - attention: 14 * layers * (query heads * head_dim) * B * sum over blocks of (anchor + B).

    Recomputation, padding and masked-out work are not useful, so MFU from this count is honest.
    """

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.block_size = cfg.block_size
        self.p_layers = sum(p.numel() for p in model.layers.parameters())
        attn = [layer.self_attn for layer in model.layers]
        self.p_ctx = model.fc.weight.numel() + sum(a.k_proj.weight.numel() + a.v_proj.weight.numel() for a in attn)
        self.head = cfg.vocab_size * cfg.hidden_size
        self.attn = 14 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * cfg.block_size

    def __call__(self, num_blocks: int, context_tokens: int, anchor_sum: int) -> float:
        B = self.block_size
        return (6 * self.p_layers * num_blocks * B + 4 * self.head * num_blocks * (B - 1)
                + 4 * self.p_ctx * context_tokens + self.attn * (anchor_sum + num_blocks * B))  # fmt: skip


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum counters over ranks (a no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        for value in sums.values():
            dist.all_reduce(value)
    return sums


class MetricsLog:
    """`metrics.jsonl`: one JSON object per logged step. On resume the lines past the checkpoint's
    step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and _step(ln) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 1 << 62
