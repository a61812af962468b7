"""The train stage's settings: one dataclass whose defaults and help texts are the CLI's, the config
files' and bench's (see dflash_cache/settings.py), and the drafter config they imply for a given
cache (through the drafter family, `dflash_cache.drafters`). Light: importing it loads no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dflash_cache.cache.spec import CacheSpec, SpecError, check_drafter_fits
from dflash_cache.errors import UserError
from dflash_cache.settings import setting

if TYPE_CHECKING:  # the drafters load torch and transformers; the settings alone must not (the CLI reads them)
    from dflash_cache.drafters import Family


class TrainError(UserError, RuntimeError):
    """A training run that cannot start or resume; the message says why."""


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

    - `flops`: useful FLOPs (metrics.StepFlops' terms): 6 x the draft layers' parameters, and 4 x the
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


def resolve_token_budget(token_budget: int | None, cuda: bool, geometry: Any = None, *,
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


def run_token_budget(cfg: TrainConfig, dcfg: Any, spec: CacheSpec, device: Any, *,
                     few_steps_cap: bool = True) -> int:  # fmt: skip
    """The token budget of a run: `resolve_token_budget` with the drafter, the total memory of the
    device (the same on every rank and every resume on that GPU model, unlike the free memory) and
    the run's tokens (`few_steps_cap=False`: as if the cache were large, for `dflash bench train`)."""
    cuda = getattr(device, "type", str(device)) == "cuda"
    memory = None
    if cuda:
        import torch

        memory = torch.cuda.get_device_properties(device).total_memory
    run_tokens = cfg.epochs * spec.plan.num_tokens if few_steps_cap else None
    return resolve_token_budget(cfg.token_budget, cuda, dcfg, memory_bytes=memory, run_tokens=run_tokens)


@dataclass
class TrainConfig:
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
    draft_layers: int = setting(5, "Drafter decoder layers.", min=1)
    block_size: int | None = setting(None, "Block size B (default: the family's, 16 for dflash, 7 for dspark).")
    layers: list[int] | None = setting(None, "Subset of the cached layer ids (default: all cached).",
                                       expects="layer ids like 1,9,17")  # fmt: skip
    max_anchors: int = setting(512, "Anchors sampled per sequence.", min=1)
    markov_rank: int = setting(256, "dspark: rank of the Markov head, which conditions each slot's logits on the "
                               "previous token (0: no Markov head).", min=0)  # fmt: skip
    markov_head: Literal["vanilla", "gated", "rnn"] = setting("vanilla", "dspark: the Markov head's type.")
    confidence_with_markov: bool = setting(True, "dspark: the confidence head also reads the previous token's "
                                           "Markov embedding.")  # fmt: skip
    ce_alpha: float = setting(0.1, "dspark: weight of the cross-entropy term.", min=0, tuning=True)
    l1_alpha: float = setting(0.9, "dspark: weight of the L1 (total-variation) term against the target's own "
                              "distribution.", min=0, tuning=True)  # fmt: skip
    confidence_alpha: float = setting(1.0, "dspark: weight of the confidence head's BCE term (0: no confidence "
                                      "head).", min=0, tuning=True)  # fmt: skip
    gamma: float | None = setting(None, "Loss decay over a block's drafted tokens, exp(-i/gamma) for the i-th "
                                  "(default: dflash 7 for B=16, dspark 4).", tuning=True)  # fmt: skip
    seed: int = setting(0, "Seed for weights, shuffling and anchors.")
    save_every: int = setting(200, "Checkpoint every N steps.", min=1)
    keep_checkpoints: int = setting(2, "Checkpoints kept in OUT/checkpoints (the newest).", min=1)
    log_every: int = setting(10, "Metrics every N steps.", min=1)
    gpus: list[int] | None = setting(None, "GPUs, one DDP process each: 5-7.", expects="GPU ids like 0-4 or 0,2,5")
    procs: int = setting(1, "CPU DDP processes (gloo) when no --gpus.", min=1)
    prefetch: int = setting(2, "Batches the loader keeps ready ahead of the step.", min=1, tuning=True)
    readers: int = setting(4, "Loader threads that decode batches.", min=1, tuning=True)
    skip_bad_units: bool = setting(False, "Train without units that fail their checks.")
    loss_chunk: int = setting(4096, "Block tokens per LM-head chunk of the loss.", min=1, tuning=True)
    trace: bool = setting(False, "Log which samples every batch held to OUT/trace/rank<r>.jsonl.")
    follow: bool = setting(True, "On a cache still being extracted, epoch 1 follows the extraction "
                           "(--no-follow: train on the units committed so far).")  # fmt: skip
    val_fraction: float = setting(0.0, "Hold out this fraction of the cache's units for validation, chosen by a hash "
                                  "of the unit id (at least one unit when above 0).", min=0)  # fmt: skip
    val_cache: Path | None = setting(None, "Validate on this second cache (same target and tokenizer) instead.")
    val_every: int | None = setting(None, "Validate every N steps (default: every --save-every), and at the end; "
                                    "export/ keeps the best by validation acceptance, export-last/ the last.",
                                    min=1)  # fmt: skip
    report_to: str = setting("none", "Also send the metrics to tensorboard (OUT/tensorboard), wandb (offline unless "
                             "WANDB_MODE is set), both (tensorboard,wandb), or none.",
                             expects="tensorboard, wandb, tensorboard,wandb or none")  # fmt: skip

    @staticmethod
    def record_path(path: Path) -> Path:
        """`--config RUN` reads the settings a run directory recorded in its train.json."""
        return path / "train.json" if path.is_dir() else path

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A run's train.json as its settings; any other mapping as it is."""
        return data["config"] if {"identity", "config"} <= data.keys() else data

    def family(self) -> Family:
        """The drafter family `drafter` names (TrainError for an unknown name)."""
        from dflash_cache import drafters

        try:
            return drafters.family(self.drafter)
        except ValueError as e:
            raise TrainError(f"--drafter: {e}") from None

    def identity(self) -> dict[str, Any]:
        """What a resume must match: everything that changes the math, not the run's length."""
        keep = ("lr", "warmup", "weight_decay", "clip", "token_budget", "grad_accum", "draft_layers", "block_size",
                "layers", "max_anchors", "gamma", "seed")  # fmt: skip
        family = self.family()
        settings = {k: getattr(self, k) for k in keep} | {"block_size": self.block_size or family.default_block_size}
        # a run of another family than DFlash says so (DFlash runs recorded no family, and resume as they are)
        other = {} if family.name == "dflash" else {"drafter": family.name, **family.identity(self)}
        # how batches are dealt to ranks (DDP steps of similar cost) changes which samples share a step
        held = {"val_fraction": self.val_fraction} if self.val_fraction else {}  # held-out units change the data
        return {**settings, "dealing": "cost-balanced", **other, **held}


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
        return family.config(cfg, spec)
    except ValueError as e:  # the drafter's own checks (block size, heads, layer ids)
        if isinstance(e, SpecError):
            raise
        raise TrainError(f"drafter settings: {e}") from None
