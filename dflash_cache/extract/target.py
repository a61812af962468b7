"""Load the target, tap the chosen layers with forward hooks, and run only as deep as needed.

The layers above the last tapped one, the final norm and the LM head never run (they are cut off
the model before it moves to the device), and `output_hidden_states` is never used, so memory
holds only the activations of the layer being computed and the tapped outputs. A cache of the
final hidden state (`--final-hidden`) needs every layer and the final norm: then only the LM head
is cut, and the base model's last_hidden_state (after the final norm) is kept too.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from dflash_cache.cache.spec import TargetInfo, digest
from dflash_cache.core.errors import UserError


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
    refuse_gguf(path)
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except (OSError, ValueError) as e:
        raise TargetError(f"--target {path}: cannot load its tokenizer ({first_line(e)})") from None


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it)."""
    return config.get("text_config") or config


def max_positions(config: dict) -> int | None:
    """The positions the target was built for (``max_position_embeddings``, GPT-2's ``n_positions``):
    a prompt and its answer beyond them would run at positions it never saw. None where the config
    names none."""
    tc = text_config(config)
    value = tc.get("max_position_embeddings", tc.get("n_positions"))
    return int(value) if value else None


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


def decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, str, nn.ModuleList]:
    """The module holding the decoder layer list, the attribute name, and the list itself."""
    for owner in model.modules():
        for name, child in owner.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == num_layers:
                return owner, name, child
    raise TargetError(f"cannot find the {num_layers} decoder layers in {type(model).__name__}")


# The SDPA kernels a forward of many shapes keeps to: every extract batch and every prefill has a
# shape of its own (its longest length), and cuDNN's attention, which torch prefers on Hopper,
# builds a plan per new shape: about 50 ms each on an H200, 10% of an extract forward and 40 ms of
# a SmolLM2-135M prefill. Flash attention has no per-shape setup and runs as fast (BENCHMARKS.md).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class LayerTaps:
    """Forward hooks on the tapped decoder layers of `model` (a causal LM or its base model).

    After a forward, `take()` returns layer `layer_ids[k]`'s output for each k: layer id l is the
    output of decoder layer l, which is `hidden_states[l + 1]` of `output_hidden_states=True`
    (index 0 there is the embedding). Extract caches these; eval feeds them to the drafter. Use as
    a context manager to remove the hooks on exit.
    """

    def __init__(self, layers: nn.ModuleList, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self._outputs: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        self._handles = [layers[lid].register_forward_hook(self._hook(k)) for k, lid in enumerate(self.layer_ids)]

    @classmethod
    def of(cls, model: nn.Module, layer_ids: list[int]) -> LayerTaps:
        """Taps on a whole (uncut) model's decoder layers."""
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        num_layers = int(text_config(model.config.to_dict())["num_hidden_layers"])
        return cls(decoder_layers(base, num_layers)[2], layer_ids)

    def _hook(self, k: int):
        def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor | tuple) -> None:
            self._outputs[k] = whole(output[0] if isinstance(output, tuple) else output)

        return hook

    def take(self) -> list[torch.Tensor]:
        """Each tapped layer's output [b, T, H] from the last forward, in `layer_ids` order."""
        outputs, self._outputs = self._outputs, [None] * len(self.layer_ids)
        if any(t is None for t in outputs):
            raise RuntimeError("LayerTaps.take() before a forward through every tapped layer")
        return outputs  # type: ignore[return-value]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> LayerTaps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Carry:
    """What one sample's forwards pass on to the next (`TappedTarget(ids, carry)`): the target's
    key/value cache, made by the target on the first forward (it knows its layers' kinds: full,
    sliding, linear attention). Dropping the carry frees the cache."""

    def __init__(self) -> None:
        self.cache = None


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5 calls the cache argument `cache` (5.40 onwards; `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model: nn.Module):
    """An empty transformers DynamicCache for `model`, with a layer of the right kind for each of
    its layers (a sliding layer keeps only its window, a linear-attention layer its state)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


class TappedTarget:
    """The target's base model cut after its last tapped layer, with `LayerTaps` on the tapped layers;
    with `final`, the whole base model (every layer and the final norm; the LM head is not part of it)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], num_layers: int, final: bool = False):
        self.layer_ids = list(layer_ids)
        self.final = final
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        owner, attr, layers = decoder_layers(base, num_layers)
        if not final:
            setattr(owner, attr, nn.ModuleList(list(layers)[: max(layer_ids) + 1]))
            if hasattr(base, "norm"):
                base.norm = nn.Identity()
        self.base = base
        self.taps = LayerTaps(getattr(owner, attr), layer_ids)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, carry: Carry | None = None) -> list[torch.Tensor]:
        """Hidden states [b, T, H] of each tapped layer for right-padded `input_ids` [b, T], and
        with `final` the final-normed last hidden state after them.

        Right padding needs no attention mask: under the causal mask a real token never sees
        the padding after it, so its hidden states are those of the unpadded sequence.

        With `carry` (one sample, extract/prefill.py) the tokens continue those of the earlier
        calls with the same carry: they attend to them through the key/value cache it holds, at
        the positions after them. Only the layers that run (up to the last tapped one) fill it.
        """
        cache = {"use_cache": False}
        if carry is not None:
            if carry.cache is None:
                carry.cache = new_cache(self.base)
            cache = {"use_cache": True, cache_kwarg(self.base): carry.cache}
        with sdpa_kernel(SDPA_BACKENDS):
            out = self.base(input_ids=input_ids, **cache)
        taps = self.taps.take()
        return [*taps, whole(out.last_hidden_state)] if self.final else taps


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor of a sharded target (`extract --tp`) gathered whole on every rank of its copy, such
    as a layer output that a plan leaves split along the sequence (every rank must take it); any
    other tensor as it is. The plans of today's families leave the layer outputs whole already."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def load_target(
    path: str, layer_ids: list[int], device: torch.device, revision: str | None = None, final: bool = False,
    distributed=None,
) -> tuple[TappedTarget, nn.Module, torch.dtype]:  # fmt: skip
    """Load the target on the CPU, cut it (after the last tapped layer, or with `final` before the
    LM head), move what runs to `device`.

    Returns the tapped target, the full model (still holding the embedding and LM head on the
    CPU, for the cache's frozen weights), and the compute dtype. With `distributed` (a
    transformers `DistributedConfig`, under the process group of one copy: extract/parallel.py),
    each rank loads only its shards, straight onto its device.
    """
    dtype = compute_dtype_for(device)
    model = load_causal_lm(path, dtype, revision, distributed)
    model.eval().requires_grad_(False)
    if device.type == "cuda" and has_recurrent_layers(model) and linear_attention_kernels()["fla"]:
        warnings.warn(SLOW_KERNELS, stacklevel=2)
    num_layers = int(text_config(model.config.to_dict())["num_hidden_layers"])
    tapped = TappedTarget(model, layer_ids, num_layers, final)
    if distributed is None:
        tapped.base.to(device)
    return tapped, model, dtype


def has_recurrent_layers(model: nn.Module) -> bool:
    """Layers whose state is a recurrence (linear attention, SSM) rather than cropable keys."""
    types = text_config(model.config.to_dict()).get("layer_types") or []
    return any(t not in ("full_attention", "sliding_attention", "chunked_attention") for t in types)


def linear_attention_kernels() -> dict[str, bool]:
    """Whether the optional kernels that transformers uses for gated delta-net layers import here:
    flash-linear-attention's `fla.ops.gated_delta_rule` (the pip package fla-core) and
    `causal_conv1d`. transformers takes them whenever they import, and its torch path otherwise;
    for extraction the torch path measured faster (`SLOW_KERNELS`)."""
    found = {}
    for name, module in (("fla", "fla.ops.gated_delta_rule"), ("causal_conv1d", "causal_conv1d")):
        try:
            importlib.import_module(module)
            found[name] = True
        except Exception:  # noqa: BLE001 - not installed, or its triton/CUDA build does not load: the torch path
            found[name] = False
    return found


SLOW_KERNELS = (
    "flash-linear-attention (fla-core) is installed, so transformers runs the gated delta-net layers through its "
    "kernels; on an H200 they made extraction of the Qwen3.5-9B shape far slower than the torch path (no 100K-token "
    "run finished in 140 s; the torch path runs at 0.97x the bare forward; BENCHMARKS.md, \"A hybrid target\"): "
    "uninstall fla-core for extraction")


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


def stop_token_ids(tokenizer, model: nn.Module | None = None) -> set[int]:
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
