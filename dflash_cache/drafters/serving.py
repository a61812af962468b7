"""The serving export's files, shared by the families: config.json's geometry fields (the target's,
which a drafter copies) and RoPE in either transformers spelling, and the atomic write of an export
directory (config.json, model.safetensors, the remote-code modeling files)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from dflash_cache.core.damage import load_safetensors, read_json

FAMILY_KEY = "drafter_family"  # where a non-DFlash export's config.json names its family
REEXPORT = "export the drafter again from its run directory (`dflash export RUN OUT`)"


def write_export(out_dir: Path, config: dict, tensors: dict[str, Tensor], modeling_source: Path,
                 modeling_file: str, extra: dict[str, Path] | None = None) -> None:  # fmt: skip
    """Write config.json + model.safetensors + the remote-code modeling file (and `extra` files:
    name -> source) into out_dir, atomically: everything is written to a temporary sibling
    directory that is then renamed into place (an existing out_dir is moved aside first and
    removed after)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        files = {modeling_file: modeling_source, **(extra or {})}
        for name, source in files.items():
            shutil.copyfile(source, tmp / name)
        for name in ("model.safetensors", *files):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            out_dir.rename(old)
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_export(path: Path, config: Any, model_class: Callable[[Any], nn.Module], *, dtype: torch.dtype | None,
                device: torch.device | str, skip: tuple[str, ...] = ()) -> nn.Module:  # fmt: skip
    """The model of the export in `path`, whose config is `config`: built on the meta device (no
    wasted init: the weights come from the file) and given model.safetensors' tensors but those
    named in `skip`. dtype None keeps the file's."""
    state = load_safetensors(Path(path) / "model.safetensors", REEXPORT, device=str(device))
    state = {k: v for k, v in state.items() if k not in skip}
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None:
        model.to(dtype)
    return model


def bf16_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict as contiguous bf16 CPU tensors: what an export stores."""
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def geometry(d: dict) -> dict:
    """The Qwen3/Llama geometry fields shared by a target's and a drafter's config.json."""
    heads = d["num_attention_heads"]
    theta, scaling = rope_from(d)
    return {
        "hidden_size": d["hidden_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": d.get("num_key_value_heads") or heads,
        "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
        "intermediate_size": d["intermediate_size"],
        "vocab_size": d["vocab_size"],
        "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": d.get("max_position_embeddings", 32768),
        "hidden_act": d.get("hidden_act", "silu"),
    }


def rope_from(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config dict in the transformers 4 style (rope_theta,
    rope_scaling) or the 5 style (rope_parameters). Scaling is None for plain RoPE."""
    params = dict(d.get("rope_parameters") or {})
    theta = d.get("rope_theta") or params.pop("rope_theta", None) or 10000.0
    scaling = dict(d.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def target_text_config(target_config: dict) -> dict:
    """The text model's part of a target config.json (a multimodal config nests it)."""
    if "hidden_size" not in target_config and "text_config" in target_config:
        return target_config["text_config"]
    return target_config


def read_config(path: Path) -> dict:
    """An export's config.json."""
    return read_json(Path(path) / "config.json", REEXPORT)
