"""What a drafter family is: the one small interface the trainer, validation, metrics, bench,
export and decoding call (docs/architecture.md, "Drafter families").

A family module (`dflash.py`, `dspark.py`, ...) builds one `Family` and registers it by name
(`drafters.register`); everything else looks it up with `drafters.family(name)`, never by an `if`
on the name. The shared pieces a family is built from stay in `train/objective.py`: the block
layout, the block attention rule and the chunked loss.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

if TYPE_CHECKING:
    from dflash_cache.cache.spec import CacheSpec
    from dflash_cache.train.config import TrainConfig
    from dflash_cache.train.loader import Batch
    from dflash_cache.train.objective import Blocks

# choose(logits [b, V]) -> (tokens [b], the probabilities they were drawn from [b, V] or None)
Choose = Callable[[Tensor], tuple[Tensor, Tensor | None]]
FAMILY_KEY = "drafter_family"  # where a non-DFlash export's config.json names its family


@dataclass
class Output:
    """What a family's objective returns for one batch.

    `loss` is what backward sees. `terms` are the named loss terms as (numerator, denominator)
    sums, detached, so that a window of steps or a validation pass over many batches and ranks
    reduces them exactly (metrics log num/den under the name; DFlash has none beside its loss).
    `correct` [nb, B] says which block slots the argmax predicted right, `blocks` are the batch's
    blocks (their weights say which slots count), and `scored` how many slots reached the LM head
    (the useful-FLOPs count needs it)."""

    loss: Tensor
    correct: Tensor
    blocks: Blocks
    terms: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    scored: Tensor | None = None


@dataclass(frozen=True)
class Family:
    """One drafter family. Every member is a plain function of the family's module.

    - `architectures`: the config.json architectures its exports have, and those of checkpoints of
      other tools in the same layout that it loads;
    - `default_block_size`: the block size when the run sets none;
    - `needs_final_hidden`: trains on the target's final hidden state (`extract --final-hidden`);
    - `config(cfg, spec)`: the family's config (geometry and heads) from the run's settings and the
      cache's target, refusing settings that cannot work (TrainError naming the setting);
    - `identity(cfg)`: the settings beyond the common ones that change the math (a resume must match);
    - `model(config)`: the draft model. It keeps DFlash's backbone attributes (`fc`, `hidden_norm`,
      `layers`, `norm`, `_rope`) and `forward(block_embeds, context, layout, attention=None)`, which
      returns the final-normed block hidden states;
    - `objective(model, embed, head, batch, config, cfg, generator, reduce=False) -> Output`: blocks
      from anchors, the model, the loss; `reduce`: the loss's denominators are summed over the
      data-parallel ranks (training) rather than taken per rank (validation);
    - `flops(model)`: a callable (blocks, context tokens, sum of anchors, scored slots) -> useful
      FLOPs of a training step, forward and backward (MFU);
    - `serving_config(config)` / `from_serving_config(dict)`: the export's config.json and back;
    - `save_serving(model, config, out_dir, frozen=None)`: the export (config.json,
      model.safetensors, the family's self-contained remote-code file); `frozen` is the target's
      (embedding, LM head) for families whose serving layout carries them;
    - `load_serving(path, dtype=None, device="cpu") -> (model, config)`;
    - `block_input(anchor_tokens [b], block_size, mask_token_id) -> [b, B]`: the block's input ids;
    - `draft(model, hidden [b, B, H], block_ids [b, B], head_weight [V, H], choose) -> (drafts [b, n],
      probs [b, n, V] or None)`: the proposals for the positions right after the anchor, the i-th
      for anchor + 1 + i; `choose` is called once per drafted position, in order.
    """

    name: str
    architectures: tuple[str, ...]  # the `architectures` of the exports (and foreign checkpoints) it loads
    default_block_size: int
    needs_final_hidden: bool
    config: Callable[[TrainConfig, CacheSpec], Any]
    identity: Callable[[TrainConfig], dict[str, Any]]
    model: Callable[[Any], nn.Module]
    objective: Callable[..., Output]
    flops: Callable[[nn.Module], Callable[[int, int, int, int], float]]
    serving_config: Callable[[Any], dict]
    from_serving_config: Callable[[dict], Any]
    save_serving: Callable[..., None]
    load_serving: Callable[..., tuple[nn.Module, Any]]
    block_input: Callable[[Tensor, int, int], Tensor]
    draft: Callable[[nn.Module, Tensor, Tensor, Tensor, Choose], tuple[Tensor, Tensor | None]]


def mask_block(anchor_tokens: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[b, B]: slot 0 the anchor (the last committed token), the other slots the mask token: the
    block input of DFlash and of DSpark alike."""
    block = torch.full((anchor_tokens.shape[0], block_size), mask_token_id, dtype=torch.long,
                       device=anchor_tokens.device)  # fmt: skip
    block[:, 0] = anchor_tokens
    return block


def choose_each(logits: Tensor, choose: Choose) -> tuple[Tensor, Tensor | None]:
    """Tokens for logits [b, n, V], one position at a time, in order (`choose` may keep state)."""
    picked = [choose(logits[:, i]) for i in range(logits.shape[1])]
    tokens = torch.stack([t for t, _ in picked], dim=1)
    probs = None if any(p is None for _, p in picked) else torch.stack([p for _, p in picked], dim=1)
    return tokens, probs


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
    return json.loads((Path(path) / "config.json").read_text())


def batch_final(batch: Batch) -> Tensor:
    """The batch's final hidden state; the loader hands it over when the family asks for it."""
    if batch.final is None:
        raise ValueError("this drafter family trains on the target's final hidden state: load the batches with "
                         "final_hidden=True from a cache extracted with --final-hidden")  # fmt: skip
    return batch.final
