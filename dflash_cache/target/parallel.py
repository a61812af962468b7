"""A target sharded over several processes by transformers itself (tensor and expert parallelism).

Under a process group of N ranks, `from_pretrained(..., distributed_config=DistributedConfig(...))`
gives each rank its shard of every layer that the model's config plans (`base_model_tp_plan`,
and `base_model_ep_plan` for the experts of MoE layers), loading only that shard from the
checkpoint. Each rank then runs the whole forward on the same batch, and the sharded layers
exchange partial results, so every rank holds the full hidden states after each decoder layer.
`core.groups.Group` says which ranks form one copy; this module says how a copy loads and how much a
target needs.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import fields

import torch
from torch import nn

from dflash_cache.cache.spec import CacheSpec
from dflash_cache.target.load import TargetError, compute_dtype_for, local_snapshot
from dflash_cache.target.taps import TappedTarget, load_target

# The config fields that count a MoE layer's routed experts, by family (Qwen3-MoE and Qwen3.5-MoE,
# DeepSeek-V3, GPT-OSS); expert parallelism deals them out evenly.
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")


def plans(path: str, revision: str | None = None) -> tuple[dict, dict]:
    """The target's tensor-parallel and expert-parallel plans, as its transformers config class
    declares them for the language model (empty where it declares none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, revision=revision)
    text = config.get_text_config()
    return dict(getattr(text, "base_model_tp_plan", None) or {}), dict(getattr(text, "base_model_ep_plan", None) or {})


def layout(path: str, revision: str | None, config: dict, tp: int) -> dict:
    """How transformers shards the target `tp` ways, which cache.json records (for information: the
    layout never changes what the cache holds); refused where it cannot.

    The attention and dense layers are sharded by heads (tensor parallel) where the family has a
    plan and its heads split evenly, the routed experts dealt out (expert parallel) where it has
    an expert plan. A target whose key-value heads are fewer than `tp` (Qwen3.5-397B has 2) keeps
    its attention whole on every rank and shards its experts alone; a transformers without
    `DistributedConfig.ep_size` (5.18 and earlier) always does that for families with an expert plan."""
    if tp == 1:
        return {"tp": 1}
    from transformers.distributed import DistributedConfig

    names = {f.name for f in fields(DistributedConfig)}
    if "tp_size" not in names:
        raise TargetError(f"--tp {tp} needs transformers 5 or later (its DistributedConfig with tp_size)")
    tp_plan, ep_plan = plans(path, revision)
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    query = int(text.get("num_attention_heads") or 0)
    heads = [query, int(text.get("num_key_value_heads") or query)]
    by_heads = bool(tp_plan) and all(h % tp == 0 for h in heads) and (not ep_plan or "ep_size" in names)
    if not by_heads and not ep_plan:
        split = f"its heads ({heads[0]} query, {heads[1]} key-value) do not split evenly over {tp} processes"
        why = f"transformers has no tensor-parallel plan for {model_type} targets" if not tp_plan else split
        raise TargetError(f"--tp {tp}: {why}; run without --tp on a GPU that holds the whole target, or with a "
                          "--tp that divides the heads")  # fmt: skip
    experts = next((int(text[k]) for k in EXPERT_COUNTS if text.get(k)), 0)
    if ep_plan and experts % tp:
        raise TargetError(f"--tp {tp}: the target's {experts} experts do not split evenly over {tp} processes")
    return {"tp": tp, "tensor_parallel": by_heads, "expert_parallel": bool(ep_plan)}


def distributed_config(layout: dict):
    """The `DistributedConfig` of a `layout`: the experts are sharded through `ep_size` (with
    `tp_plan={}` for the experts alone) where transformers has it, else through
    `enable_expert_parallel`, which shards the experts alone."""
    from transformers.distributed import DistributedConfig

    tp = layout["tp"]
    if not layout["expert_parallel"]:
        return DistributedConfig(tp_size=tp)
    if "ep_size" in {f.name for f in fields(DistributedConfig)}:
        return DistributedConfig(tp_size=tp, ep_size=tp, **({} if layout["tensor_parallel"] else {"tp_plan": {}}))
    return DistributedConfig(tp_size=tp, enable_expert_parallel=True)


def local_bytes(module: nn.Module) -> int:
    """Bytes of the parameters that this rank holds: its shards of the sharded ones, all of the rest."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in module.parameters())


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FINAL_NORM = re.compile(r"(?:^|\.)norm\.weight$")  # the base model's final norm, cut with the layers above the taps
_SKIPPED = ("mtp.", "visual.", "model.visual.", "vision_tower.", "multi_modal_projector.")  # never loaded


def running_bytes(path: str, revision: str | None, last_layer: int | None, dtype: torch.dtype,
                  head: bool = False) -> int | None:  # fmt: skip
    """Bytes of the weights that a stage puts on the device, in `dtype`, from the checkpoint's
    safetensors headers (no weight is read): the embedding and the decoder layers up to
    `last_layer` (all, and the final norm, with None), the LM head only with `head` (generation),
    never a vision tower or a multi-token-prediction head. None where the checkpoint is not local
    safetensors."""
    root, _ = local_snapshot(path, revision)
    files = sorted(root.glob("*.safetensors")) if root is not None else []
    if not files:
        return None
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__" or name.startswith(_SKIPPED) or (not head and name.startswith("lm_head.")):
                continue
            layer = _LAYER.search(name)
            if last_layer is not None and (int(layer.group(1)) > last_layer if layer else _FINAL_NORM.search(name)):
                continue
            total += math.prod(info["shape"]) * size
    return total


def check_fits(need: int | None, free: int, tp: int, device: str, remedy: str | None = None) -> None:
    """Refuse, before loading, a target whose share of weights is more than the device has free,
    with how much it needs and `remedy`, by default the `--tp` that would fit (a CUDA out-of-memory
    error would come only after minutes of loading). Activations need room beside the weights, so
    a share over 90% of the free memory is refused too."""
    if need is None:
        return
    share = need / tp
    if share <= 0.9 * free:
        return
    fits = 2 ** math.ceil(math.log2(max(2, need / (0.9 * free))))
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    each = f"its 1/{tp} share, {gib(share)}," if tp > 1 else gib(share)
    remedy = remedy or f"shard it over more GPUs with --tp {fits}"
    raise TargetError(f"the target's weights need {gib(need)} on the device ({each} a process) and {device} "
                      f"has {gib(free)} free: {remedy}")  # fmt: skip


def bind_device(device: torch.device) -> None:
    """transformers' sharded loading puts each rank on the GPU of index LOCAL_RANK; this worker's
    GPU is the one `--gpus` or torchrun gave it."""
    import os

    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)


def load_copy(spec: CacheSpec, device: torch.device) -> tuple[TappedTarget, nn.Module]:
    """This rank's part of the target as `spec.parallel` lays it out: the whole target with no
    `--tp`, else its shards (under its copy's process group). On a GPU a target whose share does
    not fit is refused first (`check_fits`)."""
    tp = spec.parallel.get("tp", 1)
    if device.type == "cuda":
        last = None if spec.layers.final_hidden else max(spec.layers.ids)
        need = running_bytes(spec.target.path, spec.target.revision, last, compute_dtype_for(device))
        check_fits(need, torch.cuda.mem_get_info(device)[0], tp, str(device))
    distributed = None
    if tp > 1:
        bind_device(device)
        distributed = distributed_config(spec.parallel)
    target, model, _ = load_target(spec.target.path, spec.layers.ids, device, spec.target.revision,
                                   final=spec.layers.final_hidden, distributed=distributed)  # fmt: skip
    return target, model
