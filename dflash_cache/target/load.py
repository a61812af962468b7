"""Loading the target: its config, tokenizer and causal LM (a local directory or a hub id), what
identifies it in cache.json, its frozen weights, and where its replies end.

A GGUF checkpoint is refused with the command that converts it once (`dflash convert`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dflash_cache.cache.spec import TargetInfo, digest
from dflash_cache.core.errors import UserError
from dflash_cache.target.config import text_config


class TargetError(UserError, ValueError):
    """A target that cannot be loaded or tapped as asked."""


def refuse_gguf(path: str) -> None:
    """A GGUF checkpoint (a .gguf file, or a directory holding one and no config.json) is converted
    once by `dflash convert` rather than dequantized by every stage (dflash_cache/pipelines/convert.py)."""
    p = Path(path)
    if (p.is_file() and p.suffix == ".gguf") or (
        p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))
    ):
        raise TargetError(f"--target {path} is a GGUF checkpoint; convert it once to a model directory with "
                          f"`dflash convert {path} OUT` and pass --target OUT")  # fmt: skip


def load_config(path: str, revision: str | None = None) -> dict:
    """The target's config as a dict, without loading weights."""
    refuse_gguf(path)
    try:
        return AutoConfig.from_pretrained(path, revision=revision).to_dict()
    except (OSError, ValueError) as e:
        raise TargetError(f"--target {path}: not a model directory or cached model id ({first_line(e)})") from None


def load_tokenizer(path: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """The target's tokenizer, with its chat template."""
    refuse_gguf(path)
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except (OSError, ValueError) as e:
        raise TargetError(f"--target {path}: cannot load its tokenizer ({first_line(e)})") from None


def first_line(e: Exception) -> str:
    """An exception's first line, for an error message of one line (its type where it has no text)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def weights_fingerprint(root: Path | None) -> str:
    """A cheap fingerprint of a local checkpoint: file names, sizes, safetensors headers, and
    sampled bytes. Hashing every byte of a 60 GB checkpoint would take minutes."""
    if root is None:
        return "unavailable"
    h = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            header_len = int.from_bytes(head, "little") if f.suffix == ".safetensors" and len(head) == 8 else 0
            h.update(fh.read(min(header_len, 64 << 20)))
            for pos in (0, size // 2, max(0, size - (1 << 20))):
                fh.seek(pos)
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def target_info(path: str, revision: str | None, config: dict, compute_dtype: torch.dtype) -> TargetInfo:
    """What identifies the target in cache.json: where it is, its weights' fingerprint and its config."""
    tc = text_config(config)
    local, revision = local_snapshot(path, revision)
    volatile = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"}
    return TargetInfo(
        path=str(Path(path).resolve()) if Path(path).is_dir() else str(path),
        revision=revision,
        weights_fingerprint=weights_fingerprint(local),
        config_digest=digest({k: v for k, v in config.items() if k not in volatile}),
        model_type=str(config.get("model_type", "")),
        num_layers=int(tc["num_hidden_layers"]),
        hidden_size=int(tc["hidden_size"]),
        vocab_size=int(tc["vocab_size"]),
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        tied_embeddings=bool(config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
        config={k: v for k, v in tc.items() if k not in volatile},
    )


def compute_dtype_for(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; float32 on CPU, where it is the dtype that runs well everywhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_causal_lm(path: str, dtype: torch.dtype, revision: str | None = None, distributed=None) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained`, with every weight from the checkpoint.

    A multimodal checkpoint (Qwen3.5's `Qwen3_5ForConditionalGeneration`) loads as its text model,
    under its `text_config`. When only the top level of its config says that the LM head is the
    embedding (as a small model's may), transformers leaves the text model's head newly
    initialised, which would put a random head in the cache: it is tied here. Any other weight
    missing from the checkpoint is refused. `distributed` (a `DistributedConfig`) shards it.
    """
    shard = {} if distributed is None else {"distributed_config": distributed}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype,
                                                           output_loading_info=True, **shard)  # fmt: skip
    except (OSError, ValueError) as e:
        raise TargetError(f"--target {path}: cannot load the model ({first_line(e)})") from None
    missing = set(info.get("missing_keys") or ())
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_name = next((n for n, p in model.named_parameters() if head is not None and p is head.weight), None)
    if head_name in missing and load_config(path, revision).get("tie_word_embeddings"):
        head.weight = embed.weight
        missing.discard(head_name)
    if missing:
        names = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise TargetError(f"--target {path}: the checkpoint lacks {len(missing)} of the model's weights ({names})")
    return model


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor of a sharded target (`extract --tp`) gathered whole on every rank of its copy, such
    as a layer output that a plan leaves split along the sequence (every rank must take it); any
    other tensor as it is. The plans of today's families leave the layer outputs whole already."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def frozen_weights(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (embedding, LM head) weights in bf16; the head is None when tied to the embedding. Those
    of a sharded target are gathered whole: every rank of its copy must call."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embed or (not isinstance(head, DTensor) and head.data_ptr() == embed.data_ptr())
    embed = whole(embed.detach()).to("cpu", torch.bfloat16)
    return embed, None if tied else whole(head.detach()).to("cpu", torch.bfloat16)


def local_snapshot(path: str, revision: str | None = None) -> tuple[Path | None, str | None]:
    """The local folder holding a target's files, and the hub revision it is a snapshot of.

    A hub id resolves only from the local hub cache: nothing is downloaded to fingerprint it.
    """
    if Path(path).is_dir():
        real = Path(os.path.realpath(path))
        return real, real.name if real.parent.name == "snapshots" else revision
    try:
        from huggingface_hub import snapshot_download

        real = Path(snapshot_download(path, revision=revision, local_files_only=True))
        return real, real.name
    except Exception:  # noqa: BLE001 - not in the local cache: no fingerprint, not an error here
        return None, revision


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module | None = None) -> set[int]:
    """Where a reply ends: the tokenizer's eos, the generation config's eos (one id or a list; a
    chat model lists its end-of-turn token there: <|im_end|>, <|eot_id|>, <end_of_turn>) and
    ChatML's <|im_end|> where the vocabulary has it."""
    ids: set[int] = set()
    candidates = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        candidates.append(gen.eos_token_id)
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, (list, tuple)):
            ids.update(int(i) for i in c)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    return ids
