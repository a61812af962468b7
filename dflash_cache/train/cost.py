"""The train stage's cost model: what a drafter's step costs from its geometry (`StepCost`), the token
budget a GPU's memory and a run's length imply, and a packed batch's relative compute, by which
batches are dealt to DDP ranks (`drafter_cost`). Pure functions of the geometry and the lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dflash_cache.cache.spec import CacheSpec
    from dflash_cache.train.config import TrainConfig

# Below this many optimizer steps a drafter's held-out tau still climbs steeply with more steps
# (QUALITY.md, the GPU code target, tau per prompt: 3.09 after 300 steps, 4.8 after 580, 5.66 after
# 2,356; the CPU one: 2.63 after 420, 5.73 after 2,740 smaller steps on the same data).
FEW_STEPS = 1000

CPU_BUDGET = 2048
# 8192 context tokens x 512 anchors ran the default 8B-shaped drafter at 53% MFU on an H200 (51% at
# 4096) and fits even the batch of most blocks: 100.6 GB peak for 5,763 blocks of 16 in a batch of
# only 64-256-token samples (BENCHMARKS.md, "Training step").
GPU_BUDGET = 8192
QWEN3_8B = {
    "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
}  # fmt: skip
DENSEST_BLOCKS = 0.75  # blocks a context token in the densest batch: 0.70 measured (5,763 in 8,192)
MEMORY_USE = 0.92  # of the GPU's memory, the rest for the allocator's fragmentation and the CUDA context


@dataclass(frozen=True)
class StepCost:
    """What a drafter's training step costs per block token, from its geometry alone:

    - `flops`: useful FLOPs (DFlash's `StepFlops` terms): 6 x the draft layers' parameters, and 4 x the
      frozen LM head (forward and input gradient);
    - `bytes`: activations kept for the backward pass, 2 bytes x (10 H + 4 I) a draft layer (the
      norms, q/k/v, attention output and residuals; gate, up, SiLU and down's input);
    - `fixed_bytes`: what does not grow with the batch: fp32 weights, gradients and AdamW's two
      moments (16 bytes a parameter), the frozen embedding and head in bf16, and one loss chunk's
      float32 logits.

    Calibrated on the 8B-shaped drafter (0.90 MB a block token, 21.8 GB fixed: 104.8 GB predicted
    for the 5,763-block batch that peaked at 100.6 GB), so the estimate errs on the safe side."""

    flops: float
    bytes: float
    fixed_bytes: float
    block_size: int

    @classmethod
    def of(cls, geometry: Any, loss_chunk: int = 4096) -> StepCost:
        """`geometry`: a DrafterConfig, or any object with its fields."""
        g = geometry
        h, i, v, layers = g.hidden_size, g.intermediate_size, g.vocab_size, g.num_hidden_layers
        q, kv = g.num_attention_heads * g.head_dim, g.num_key_value_heads * g.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * g.head_dim
        params = layers * per_layer + len(g.target_layer_ids) * h * h + 2 * h
        return cls(flops=6 * per_layer * layers + 4 * v * h, bytes=2 * layers * (10 * h + 4 * i),
                   fixed_bytes=16 * params + 2 * 2 * v * h + 4 * loss_chunk * v, block_size=g.block_size)  # fmt: skip

    def tokens_that_fit(self, memory_bytes: float) -> float:
        """Context tokens a batch may hold so that its densest batch fits in `memory_bytes`."""
        return (MEMORY_USE * memory_bytes - self.fixed_bytes) / (DENSEST_BLOCKS * self.block_size * self.bytes)


def _reference_cost() -> StepCost:
    from types import SimpleNamespace

    default = {**QWEN3_8B, "num_hidden_layers": 5, "target_layer_ids": range(5), "block_size": 16}
    return StepCost.of(SimpleNamespace(**default))


def resolve_batch_token_budget(token_budget: int | None, cuda: bool, geometry: Any = None, *,
                         memory_bytes: float | None = None, run_tokens: int | None = None) -> int:  # fmt: skip
    """Context tokens per batch per rank: the setting; else 2048 on a CPU; on a GPU, from the
    drafter's geometry and the GPU's memory (both given), a pure function:

    - as much useful work a step as the default 8B-shaped drafter does at 8192 tokens (a
      hidden-576 drafter does 38x less a token, and at 8192 ran an H200 at 14% MFU);
    - no more than lets the densest batch fit in memory (`StepCost`);
    - and, given the run's context tokens (epochs x the cache's), no fewer than `FEW_STEPS`
      batches in the run, but never below 8192 for that: bigger batches only where the run keeps
      enough optimizer steps to generalise;

    rounded down to a power of two. The 8B-shaped drafter on an H200 gets 8192, as before; the
    SmolLM2-135M drafter (hidden 576) 65536 on a large cache. Without the geometry or the memory,
    8192."""
    if token_budget:
        return token_budget
    if not cuda:
        return CPU_BUDGET
    if geometry is None or memory_bytes is None:
        return GPU_BUDGET
    cost = StepCost.of(geometry)
    wanted = GPU_BUDGET * _reference_cost().flops / cost.flops
    if run_tokens:
        wanted = min(wanted, run_tokens / FEW_STEPS)
    budget = min(max(GPU_BUDGET, wanted), cost.tokens_that_fit(memory_bytes))
    return 1 << max(10, int(budget).bit_length() - 1)


def shared_budget(runs: list[tuple[Any, int]], cuda: bool, memory_bytes: float | None) -> int:
    """One token budget for runs compared side by side, each (geometry, run tokens): the least that
    `resolve_batch_token_budget` gives any of them alone, so that none has fewer than `FEW_STEPS`
    batches, none outgrows the memory, and their figures differ by what sets them apart, not by
    their batch sizes."""
    return min(resolve_batch_token_budget(None, cuda, g, memory_bytes=memory_bytes, run_tokens=n) for g, n in runs)


def run_token_budget(cfg: TrainConfig, dcfg: Any, spec: CacheSpec, device: Any, *,
                     few_steps_cap: bool = True) -> int:  # fmt: skip
    """The token budget of a run: `resolve_batch_token_budget` with the drafter, the total memory of the
    device (the same on every rank and every resume on that GPU model, unlike the free memory) and
    the run's tokens (`few_steps_cap=False`: as if the cache were large, for `dflash bench train`)."""
    cuda = getattr(device, "type", str(device)) == "cuda"
    memory = None
    if cuda:
        import torch

        memory = torch.cuda.get_device_properties(device).total_memory
    run_tokens = cfg.epochs * spec.plan.num_tokens if few_steps_cap else None
    return resolve_batch_token_budget(cfg.token_budget, cuda, dcfg, memory_bytes=memory, run_tokens=run_tokens)


def drafter_cost(lengths: np.ndarray, block_size: int, max_anchors: int) -> float:
    """A packed batch's relative drafter compute, from its sample lengths: its block tokens (an
    upper bound: anchors need supervised positions) plus its context tokens."""
    anchors = np.minimum(np.maximum(np.asarray(lengths) - block_size + 1, 0), max_anchors)
    return float(block_size * anchors.sum() + np.sum(lengths))
