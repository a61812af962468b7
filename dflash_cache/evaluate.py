"""`dflash eval`: speculative decoding with the target and an exported drafter, and tau (docs/architecture.md).

Decoding runs through the generation engine (`dflash_cache.generate`), many prompts at once: every
prompt has a row of its own, at its own position, and keeps its own acceptance; rows end at
different steps and the next prompts take their places. Each step:

1. the drafter fills a block ``[last committed token, mask x (B-1)]`` at positions ``[p, p+B)``
   per row, from the target's tapped states of every position ``< p`` (layer id l = output of
   decoder layer l = ``hidden_states[l+1]``, captured by forward hooks: the target never runs with
   ``output_hidden_states``), whose keys and values the drafter keeps per row;
2. the target verifies ``[last, d1..d_{B-1}]`` in one forward; the longest accepted prefix of the
   draft plus the target's own next token (the bonus) is committed, and the tapped states of the
   committed positions join the context.

tau is the mean number of tokens committed per verification step (accepted drafts + bonus). Two
means are reported: ``tau`` pools every step of every prompt; ``tau_per_prompt`` is the mean over
prompts of each prompt's tau, the figure the DFlash reference benchmark prints ("Average
Acceptance length") and the one published numbers are.

Temperature 0 compares argmaxes, so greedy speculative decoding reproduces target-only greedy
decoding token for token, and a prompt's output and tau do not depend on the batch it ran in.
Temperature > 0 uses the speculative-sampling rule (Leviathan et al. 2023), whose output has
exactly the target's sampling distribution; each prompt's draws are keyed by (seed, prompt index,
position), so they too are independent of the batch.

The target-alone baseline decodes the same prompts in the same batches, so the speedup is that
of speculative decoding at this batch size (`--batch-size 1` gives the single-stream figure).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash_cache import drafters
from dflash_cache.app_config import EvalConfig
from dflash_cache.devices import Worker, flush_denormals, worker_threads
from dflash_cache.extract.data import (
    LINE,
    DataError,
    RowRejected,
    check_template_kwargs,
    conversation,
    read_rows,
    source_row,
)
from dflash_cache.extract.target import TargetError, first_line, load_tokenizer, stop_token_ids, text_config
from dflash_cache.generate import (
    BlockProposer,
    Engine,
    Request,
    StopRule,
    fit_slots,
    load_model,
    make_target,
    slot_bytes,
)
from dflash_cache.generate.proposer import proposer_slot_bytes
from dflash_cache.progress import ProgressSink

__all__ = [
    "EvalError",
    "EvalResult",
    "evaluate",
    "load_prompts",
    "stop_token_ids",
    "tau",
    "tau_per_prompt",
]


class EvalError(TargetError):
    """A drafter that does not fit the target, or settings that cannot run. A TargetError, so
    the CLI reports it as one `error:` line like the other user errors."""


@dataclass
class EvalResult:
    """What `dflash eval` reports. histogram[i] counts the steps that committed i+1 tokens.

    tau pools all verification steps of all prompts; tau_per_prompt is the mean over prompts of
    each prompt's own tau (the reference benchmark's figure; see the module docstring)."""

    tau: float
    tau_per_prompt: float
    histogram: list[int]
    steps: int
    new_tokens: int
    spec_tok_s: float
    target_tok_s: float
    speedup: float
    samples: list[dict]
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def tau(acceptance_lengths: list[int]) -> float:
    """Mean tokens committed per verification step (accepted drafts + the bonus); 0.0 when no
    step ran (e.g. the first token already ended the generation)."""
    if not acceptance_lengths:
        return 0.0
    return sum(acceptance_lengths) / len(acceptance_lengths)


def tau_per_prompt(per_prompt_lengths: list[list[int]]) -> float:
    """The DFlash reference benchmark's tau: the mean over prompts of each prompt's tau. A prompt
    with no verification step (its first token ended the generation) has no tau and is left out,
    as it would make the reference's mean NaN; 0.0 when no prompt has a step."""
    taus = [tau(lengths) for lengths in per_prompt_lengths if lengths]
    return sum(taus) / len(taus) if taus else 0.0


def histogram(acceptance_lengths: list[int], block_size: int) -> list[int]:
    """Counts of acceptance lengths 1..B: where the drafter fails, not just how often."""
    counts = [0] * block_size
    for n in acceptance_lengths:
        counts[n - 1] += 1
    return counts


# ----------------------------------------------------------------------------- prompts, loading


def load_prompts(
    path: str | Path,
    tokenizer,
    limit: int | None = None,
    chat_template_kwargs: dict | None = None,
    split: str | None = None,
) -> list[list[int]]:
    """Prompt token ids from the rows `dflash extract` reads (a JSONL / JSON / Parquet file, a
    saved dataset or a hub dataset name; any form :func:`dflash_cache.extract.data.conversation` reads).

    A conversation goes through the chat template with the generation prompt, and with
    ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``); its trailing assistant turns
    are dropped first, so the training data works as a prompt set, and rows that stop before the
    reply (user-only ``messages``, a ``prompt`` without ``response``) are prompts as they are.
    ``text`` rows are plain text (special tokens as the tokenizer adds them).
    """
    kwargs = check_template_kwargs(chat_template_kwargs)
    rows = read_rows(path, split=split, max_samples=limit)
    prompts: list[list[int]] = []
    for i, row in enumerate(rows):
        where = f"{path} row {i}" if row.get(LINE) is None else f"{path} line {row[LINE]}"
        try:
            messages = conversation(row, reply_required=False)
        except RowRejected as e:
            raise DataError(f"{where}: {e.reason}") from None
        prompts.append(_encode_prompt(row, messages, tokenizer, kwargs, where))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def _encode_prompt(row: dict, messages: list[dict] | None, tokenizer, kwargs: dict, where: str) -> list[int]:
    if messages is not None:
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DataError(f"{where}: no message before the assistant's reply")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # jinja2 raises many types
            raise DataError(f"{where}: chat template failed ({first_line(e)})") from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = source_row(row)["text"]
        if not isinstance(text, str):
            raise DataError(f"{where}: text must be a string")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise DataError(f"{where}: empty prompt")
    return [int(t) for t in ids]


def check_fits(dcfg, target_config: dict) -> None:
    """Refuse a drafter built for another target, naming the field that differs."""
    tc = text_config(target_config)
    for name, want in (
        ("hidden_size", tc["hidden_size"]),
        ("vocab_size", tc["vocab_size"]),
        ("num_target_layers", tc["num_hidden_layers"]),
    ):
        if getattr(dcfg, name) != want:
            raise EvalError(f"drafter {name} is {getattr(dcfg, name)}, the target's is {want}")
    if not 0 <= dcfg.mask_token_id < tc["vocab_size"]:
        raise EvalError(f"drafter mask_token_id {dcfg.mask_token_id} is outside the target's vocabulary")




def _check(cfg: EvalConfig) -> None:
    if cfg.max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0:
        raise EvalError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise EvalError(f"block size must be >= 2, got {cfg.block_size}")
    drafter = Path(cfg.drafter)
    if not (drafter / "config.json").is_file() or not (drafter / "model.safetensors").is_file():
        raise EvalError(f"--drafter {drafter}: not an exported drafter (needs config.json and model.safetensors)")


def evaluate(cfg: EvalConfig, sink: ProgressSink | None = None, *, baseline: bool = True) -> EvalResult:
    """Speculative decoding vs target-only decoding on the same prompts, in batches of
    `cfg.batch_size` (see the module docstring; the defaults are EvalConfig's).

    The DFlash reference benchmark runs with thinking off (its published Qwen3 drafters are
    non-thinking), greedy, up to 2048 new tokens, and reports tau per prompt (``tau_per_prompt``):
    set those to compare with its numbers. Generation stops at the tokenizer's and the generation
    config's eos and at ``<|im_end|>``. Timings follow a short warm-up (which also captures the
    CUDA graphs). `sink` sees each decoded prompt (speculatively, then by the target alone) and the
    running tau per prompt. ``baseline=False`` skips the target-only run (no speed figures, ``same_as_target`` None)."""
    _check(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(cfg.target)
    template_kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    prompts = load_prompts(cfg.data, tokenizer, cfg.limit, template_kwargs, cfg.data_split)  # bad rows fail first
    model = load_model(cfg.target, device)
    dtype = model.get_input_embeddings().weight.dtype
    try:
        drafter, dcfg, family = drafters.load_serving(Path(cfg.drafter), dtype=dtype, device=device)
    except (KeyError, ValueError, RuntimeError) as e:
        raise EvalError(f"--drafter {cfg.drafter}: cannot load it ({first_line(e)})") from None
    drafter.eval().requires_grad_(False)
    check_fits(dcfg, model.config.to_dict())
    B = cfg.block_size or dcfg.block_size
    length = max(map(len, prompts)) + cfg.max_new_tokens + B + 1
    wanted = min(len(prompts), cfg.batch_size or (128 if device.type == "cuda" else 16))
    slots = fit_slots(wanted, slot_bytes(model, length) + proposer_slot_bytes(drafter, length), device)
    target = make_target(model, slots, length, dcfg.target_layer_ids)
    proposer = BlockProposer(drafter, embed=model.get_input_embeddings().weight,
                             head=model.get_output_embeddings().weight, slots=target.slots, length=length,
                             block_size=B, family=family)  # fmt: skip
    stop = StopRule(stop_token_ids(tokenizer, model))
    engines = {"spec": Engine(target, stop, temperature=cfg.temperature, proposer=proposer)}
    if baseline:
        engines["target"] = Engine(target, stop, temperature=cfg.temperature)
    requests = [Request(p, cfg.max_new_tokens, seed=cfg.seed * 1_000_003 + i, key=i) for i, p in enumerate(prompts)]

    if sink is not None:
        sink.start(len(prompts) * len(engines), 0)
    outputs, seconds, per_prompt, decoded = {}, {}, {}, 0
    # a CPU slows down tenfold on denormal activations, and thrashes with more threads than idle cores
    with flush_denormals(device), worker_threads(Worker(0, 1, device)):
        threads = torch.get_num_threads()
        for name, engine in engines.items():
            warm = Request(prompts[0], min(8, cfg.max_new_tokens), key=-1)  # allocations, kernels, CUDA graphs
            list(engine.stream([warm]))
            _sync(device)
            t0 = time.perf_counter()
            outputs[name] = {}
            for c in engine.stream(requests):
                outputs[name][c.request.key] = c
                if name == "spec":
                    per_prompt[c.request.key] = c.accepted
                decoded += 1
                if sink is not None:
                    sink.update({"prompts": decoded, "tau": tau_per_prompt(list(per_prompt.values()))}, {"prompts": 1})
            _sync(device)
            seconds[name] = time.perf_counter() - t0
    if sink is not None:
        sink.close()
    spec, ref = outputs["spec"], outputs.get("target")
    lengths = [spec[i].accepted for i in range(len(prompts))]
    samples = [{
        "index": i, "prompt_tokens": len(p), "new_tokens": len(spec[i].ids), "steps": len(lengths[i]),
        "tau": tau(lengths[i]), "acceptance_lengths": lengths[i], "finish": spec[i].finish,
        "same_as_target": None if ref is None else spec[i].ids == ref[i].ids,
        "output": tokenizer.decode(spec[i].ids), "output_ids": spec[i].ids,
    } for i, p in enumerate(prompts)]  # fmt: skip
    spec_tokens = sum(len(c.ids) for c in spec.values())
    target_tokens = sum(len(c.ids) for c in (ref or {}).values())
    spec_tok_s = spec_tokens / seconds["spec"] if seconds["spec"] > 0 else 0.0
    target_tok_s = target_tokens / seconds["target"] if ref and seconds["target"] > 0 else 0.0
    flat = [n for steps in lengths for n in steps]
    return EvalResult(
        tau=tau(flat), tau_per_prompt=tau_per_prompt(lengths), histogram=histogram(flat, proposer.num_drafts + 1),
        steps=len(flat),
        new_tokens=spec_tokens, spec_tok_s=spec_tok_s, target_tok_s=target_tok_s,
        speedup=spec_tok_s / target_tok_s if target_tok_s > 0 else 0.0, samples=samples,
        settings={
            "target": str(cfg.target), "drafter": str(cfg.drafter), "data": str(cfg.data), "prompts": len(prompts),
            "block_size": B, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "seed": cfg.seed, "limit": cfg.limit, "chat_template_kwargs": template_kwargs,
            "data_split": cfg.data_split, "batch_size": target.slots, "engine": type(target).__name__,
            "drafter_family": family.name,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "cpu_threads": threads,
            "target_layer_ids": list(dcfg.target_layer_ids), "target_new_tokens": target_tokens,
            "spec_seconds": seconds["spec"], "target_seconds": seconds.get("target"),
        },
    )  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
