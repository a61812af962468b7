"""Speculative decoding with the target and an exported drafter, and tau (ARCHITECTURE.md).

The loop follows the DFlash reference (z-lab/dflash), batch size 1:

1. The target prefills the prompt with a KV cache (transformers ``DynamicCache``) and gives the
   first token. Forward hooks on the tapped decoder layers (layer id l = output of decoder layer
   l = ``hidden_states[l+1]``) capture the context of every prompt position; the model never
   runs with ``output_hidden_states``, so only the K tapped layers are kept.
2. Each step the drafter fills a block ``[last committed token, mask x (B-1)]`` at positions
   ``[p, p+B)`` from the context of all positions ``< p`` (``DFlashDrafter.forward`` with a
   one-block ``BlockLayout``, the exact attention path). The target verifies
   ``[last, d1..d_{B-1}]`` in one forward pass over its cache; the longest accepted prefix of the
   draft plus the target's own next token (the bonus) is committed, the cache is cropped back to
   the committed length and the tapped states of the committed positions join the context.
3. tau is the mean number of tokens committed per verification step (accepted drafts + bonus).
   Two means are reported: ``tau`` pools every step of every prompt; ``tau_per_prompt`` is the
   mean over prompts of each prompt's tau, the figure the DFlash reference benchmark prints
   ("Average Acceptance length") and the one published numbers are. Long answers weigh more in
   the first, every prompt the same in the second.

Temperature > 0 uses the standard speculative-sampling rule (Leviathan et al. 2023; Chen et al.
2023): draft token d_k, sampled from the drafter's q_k, is kept with probability
min(1, p_k(d_k) / q_k(d_k)); at the first rejection the target's token is drawn from
norm(max(0, p_k - q_k)); when every draft is kept the bonus is drawn from p_B. The output then
has exactly the target's sampling distribution. Temperature 0 compares argmaxes, so greedy
speculative decoding reproduces target-only greedy decoding token for token (up to float
rounding between a B-token and a 1-token forward, which never showed in the tests).

The drafter recomputes its projections of the whole context at every step (the library's
forward takes the raw context): exact and simple, and cheap at evaluation lengths, where a
serving engine would cache them.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

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
from dflash_cache.extract.target import (
    LayerTaps,
    TargetError,
    first_line,
    load_tokenizer,
    stop_token_ids,
    text_config,
)
from dflash_cache.progress import ProgressSink
from dflash_cache.train.drafter import DFlashDrafter, DrafterConfig, load_serving
from dflash_cache.train.objective import BlockLayout

__all__ = [
    "EvalError",
    "EvalResult",
    "evaluate",
    "load_prompts",
    "propose",
    "speculative_generate",
    "stop_token_ids",
    "target_generate",
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


# ----------------------------------------------------------------------------- target plumbing


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5 calls the KV cache argument `cache`; 4.x (and 5 until 5.40, deprecated)
    `past_key_values`. Use the one this version's forward declares, so nothing warns."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions. A negative argument means "remove that many" both in
    transformers 4 (crop(max_length)) and 5 (crop(tokens_to_remove), which refuses positives)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _forward(model: nn.Module, ids: list[int], cache, kwarg: str, keep: int = 0) -> Tensor:
    """One target forward over `ids` after the cached positions; logits [len(ids) or keep, V]."""
    device = model.get_input_embeddings().weight.device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = model(input_ids=x, use_cache=True, logits_to_keep=keep, **{kwarg: cache})
    return out.logits[0]


def _fused(taps: LayerTaps) -> Tensor:
    """[T, K*H]: the tapped layers side by side, the layout the drafter's fc (and the cache) use."""
    return torch.cat([t[0] for t in taps.take()], dim=-1)


def _choose(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """Token per row of logits [N, V]: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _sample_device(generator: torch.Generator | None, t: Tensor) -> Tensor:
    return t if generator is None else t.to(generator.device)


# ----------------------------------------------------------------------------- drafting


def propose(
    drafter: DFlashDrafter,
    dcfg: DrafterConfig,
    context: Tensor,
    last_token: int,
    position: int,
    *,
    block_size: int,
    embed: nn.Module,
    head: nn.Module,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], Tensor | None]:
    """The drafter's B-1 proposals for positions position+1 .. position+B-1.

    context [position, K*H] holds the tapped states of every position before the block. Returns
    the draft tokens and, at temperature > 0, the drafter's probabilities [B-1, V] they were
    sampled from (the speculative-sampling rule needs them); None at temperature 0. A module
    function, so tests can swap in an oracle.
    """
    dev = context.device
    block = torch.full((block_size,), dcfg.mask_token_id, dtype=torch.long, device=dev)
    block[0] = last_token
    layout = BlockLayout.build(
        torch.tensor([0, position], device=dev),
        torch.zeros(1, dtype=torch.long, device=dev),
        torch.tensor([position], device=dev),
        block_size,
    )
    # The exact (SDPA) path: flex would build and compile a new block mask for every one-block
    # step, which costs far more than it saves at this size.
    hidden = drafter(embed(block).to(context.dtype), context, layout, attention="sdpa")
    logits = head(hidden[1:]).float()
    if temperature <= 0:
        return logits.argmax(-1).tolist(), None
    q = torch.softmax(logits / temperature, dim=-1)
    drafts = torch.multinomial(_sample_device(generator, q), 1, generator=generator).squeeze(-1)
    return drafts.tolist(), q


def _verify(
    drafts: list[int],
    q: Tensor | None,
    logits: Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted draft count a, the target's token at slot a) for verification logits [B, V],
    where logits[k] is the target's distribution for the token after block slot k."""
    n = len(drafts)
    if temperature <= 0:
        target = logits.argmax(-1).tolist()
        a = 0
        while a < n and drafts[a] == target[a]:
            a += 1
        return a, target[a]
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if q is None:  # a proposer without probabilities: treat its drafts as certain (q = one-hot)
        q = torch.zeros_like(p[:n])
        q[torch.arange(n), torch.tensor(drafts)] = 1.0
    p, q = _sample_device(generator, p), _sample_device(generator, q).float()
    u = torch.rand(n, generator=generator, device=p.device)
    for k, d in enumerate(drafts):
        if u[k] * q[k, d] <= p[k, d]:  # u < min(1, p/q), without dividing by a zero q
            continue
        residual = (p[k] - q[k]).clamp_min(0)
        if residual.sum() <= 0:  # p == q up to rounding: the rejection had no mass; use p
            residual = p[k]
        return k, int(torch.multinomial(residual, 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


# ----------------------------------------------------------------------------- generation


@torch.inference_mode()
def speculative_generate(
    target_model: nn.Module,
    drafter: DFlashDrafter,
    dcfg: DrafterConfig,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_ids: set[int],
) -> tuple[list[int], list[int]]:
    """DFlash speculative decoding of one prompt: (generated ids, tokens committed per step).

    Generation ends at max_new_tokens or after a stop token (kept in the output, as target-only
    decoding keeps it). A step's count is what it actually committed, so a step cut short by
    either limit counts less than its accepted length.
    """
    if block_size < 2:
        raise EvalError(f"block size must be >= 2, got {block_size}")
    kwarg = _cache_kwarg(target_model)
    embed, head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
    cache = _new_cache(target_model)
    out: list[int] = []
    lengths: list[int] = []
    with LayerTaps.of(target_model, dcfg.target_layer_ids) as taps:
        logits = _forward(target_model, list(input_ids), cache, kwarg, keep=1)
        first = int(_choose(logits[-1:], temperature, generator)[0])
        rows = _fused(taps)  # [L, K*H]
        context = rows.new_empty((len(input_ids) + max_new_tokens + block_size, rows.shape[1]))
        context[: rows.shape[0]] = rows
        out.append(first)
        p = len(input_ids)  # position of the last committed token, which the target has not seen
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            last = out[-1]
            drafts, q = propose(
                drafter, dcfg, context[:p], last, p, block_size=block_size, embed=embed, head=head,
                temperature=temperature, generator=generator,
            )  # fmt: skip
            logits = _forward(target_model, [last, *drafts], cache, kwarg)
            a, bonus = _verify(drafts, q, logits, temperature, generator)
            committed = [*drafts[:a], bonus]
            context[p : p + a + 1] = _fused(taps)[: a + 1]  # states of last, d1..da
            _crop(cache, p + a + 1)
            p += a + 1
            committed = committed[: max_new_tokens - len(out)]
            for i, t in enumerate(committed):
                if t in stop_ids:
                    committed = committed[: i + 1]
                    break
            out.extend(committed)
            lengths.append(len(committed))
    return out, lengths


@torch.inference_mode()
def target_generate(
    target_model: nn.Module,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_ids: set[int],
) -> list[int]:
    """Target-only decoding, one token per forward with the KV cache: the speed baseline and
    the reference output of greedy speculative decoding."""
    kwarg = _cache_kwarg(target_model)
    cache = _new_cache(target_model)
    logits = _forward(target_model, list(input_ids), cache, kwarg, keep=1)
    out = [int(_choose(logits[-1:], temperature, generator)[0])]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        logits = _forward(target_model, [out[-1]], cache, kwarg, keep=1)
        out.append(int(_choose(logits[-1:], temperature, generator)[0]))
    return out


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


def _load_target_model(path: str, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise TargetError(f"--target {path}: cannot load the model ({first_line(e)})") from None
    return model.to(device).eval().requires_grad_(False)


def check_fits(dcfg: DrafterConfig, target_config: dict) -> None:
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


def evaluate(
    target: str,
    drafter_dir: Path,
    prompts: str | Path,
    *,
    max_new_tokens: int = EvalConfig.max_new_tokens,
    temperature: float = EvalConfig.temperature,
    seed: int = EvalConfig.seed,
    block_size: int | None = EvalConfig.block_size,
    limit: int | None = EvalConfig.limit,
    chat_template_kwargs: dict | None = EvalConfig.chat_template_kwargs,
    data_split: str | None = EvalConfig.data_split,
    sink: ProgressSink | None = None,
    baseline: bool = True,
) -> EvalResult:
    """Speculative decoding vs target-only decoding on the same prompts.

    Defaults: greedy (temperature 0), 128 new tokens per prompt, the drafter's block size, every
    prompt, and the chat template's own defaults: Qwen3's template thinks unless
    ``chat_template_kwargs={"enable_thinking": False}``. The DFlash reference benchmark runs with
    thinking off (its published Qwen3 drafters are non-thinking), greedy, up to 2048 new tokens,
    and reports tau per prompt (``tau_per_prompt`` here): set those to compare with its numbers.
    Generation stops at the tokenizer's and the generation config's eos and at ``<|im_end|>``.

    Both runs of a prompt draw from generators seeded with (seed, prompt index), so the result
    does not depend on --limit. Timings include the prefill and follow a short warm-up. `sink`
    sees the prompts done and the running tau per prompt. ``baseline=False`` skips the
    target-only runs (no speed figures, ``same_as_target`` None): for tau alone, at half the cost.
    """
    if max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise EvalError(f"temperature must be >= 0, got {temperature}")
    drafter_dir = Path(drafter_dir)
    if not (drafter_dir / "config.json").is_file() or not (drafter_dir / "model.safetensors").is_file():
        raise EvalError(f"--drafter {drafter_dir}: not an exported drafter (needs config.json and model.safetensors)")
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(target)
    template_kwargs = check_template_kwargs(chat_template_kwargs)
    prompt_ids = load_prompts(prompts, tokenizer, limit, template_kwargs, data_split)  # bad rows fail before loading
    model = _load_target_model(target, device)
    dtype = model.get_input_embeddings().weight.dtype
    try:
        drafter, dcfg = load_serving(drafter_dir, dtype=dtype, device=device)
    except (KeyError, ValueError, RuntimeError) as e:
        raise EvalError(f"--drafter {drafter_dir}: cannot load it ({first_line(e)})") from None
    drafter.eval().requires_grad_(False)
    check_fits(dcfg, model.config.to_dict())
    B = dcfg.block_size if block_size is None else block_size
    if B < 2:
        raise EvalError(f"block size must be >= 2, got {B}")
    stop_ids = stop_token_ids(tokenizer, model)

    def gen(i: int) -> torch.Generator | None:
        return torch.Generator(device).manual_seed(seed * 1_000_003 + i) if temperature > 0 else None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if sink is not None:
        sink.start(len(prompt_ids), 0)
    # a CPU slows down tenfold on denormal activations, and thrashes with more threads than idle cores
    with flush_denormals(device), worker_threads(Worker(0, 1, device)):
        threads = torch.get_num_threads()
        warm = min(8, max_new_tokens)  # first calls pay for allocations and kernel selection
        speculative_generate(model, drafter, dcfg, prompt_ids[0], max_new_tokens=warm, block_size=B,
                             temperature=temperature, generator=gen(0), stop_ids=stop_ids)  # fmt: skip
        if baseline:
            target_generate(model, prompt_ids[0], max_new_tokens=warm, temperature=temperature,
                            generator=gen(0), stop_ids=stop_ids)  # fmt: skip

        samples, per_prompt = [], []
        spec_time = target_time = 0.0
        spec_tokens = target_tokens = 0
        for i, ids in enumerate(prompt_ids):
            sync()
            t0 = time.perf_counter()
            out, lengths = speculative_generate(
                model, drafter, dcfg, ids, max_new_tokens=max_new_tokens, block_size=B,
                temperature=temperature, generator=gen(i), stop_ids=stop_ids,
            )  # fmt: skip
            sync()
            t1 = time.perf_counter()
            ref = None
            if baseline:
                ref = target_generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                      generator=gen(i), stop_ids=stop_ids)  # fmt: skip
            sync()
            t2 = time.perf_counter()
            spec_time, target_time = spec_time + t1 - t0, target_time + t2 - t1
            spec_tokens, target_tokens = spec_tokens + len(out), target_tokens + len(ref or ())
            per_prompt.append(lengths)
            samples.append({
                "index": i, "prompt_tokens": len(ids), "new_tokens": len(out), "steps": len(lengths),
                "tau": tau(lengths), "acceptance_lengths": lengths,
                "same_as_target": None if ref is None else out == ref, "output": tokenizer.decode(out),
                "output_ids": out,
            })  # fmt: skip
            if sink is not None:
                sink.update({"prompts": i + 1, "tau": tau_per_prompt(per_prompt)}, {"prompts": 1})
    if sink is not None:
        sink.close()
    spec_tok_s = spec_tokens / spec_time if spec_time > 0 else 0.0
    target_tok_s = target_tokens / target_time if target_time > 0 else 0.0
    all_lengths = [n for lengths in per_prompt for n in lengths]
    return EvalResult(
        tau=tau(all_lengths),
        tau_per_prompt=tau_per_prompt(per_prompt),
        histogram=histogram(all_lengths, B),
        steps=len(all_lengths),
        new_tokens=spec_tokens,
        spec_tok_s=spec_tok_s,
        target_tok_s=target_tok_s,
        speedup=spec_tok_s / target_tok_s if target_tok_s > 0 else 0.0,
        samples=samples,
        settings={
            "target": str(target), "drafter": str(drafter_dir), "data": str(prompts), "prompts": len(prompt_ids),
            "block_size": B, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
            "limit": limit, "chat_template_kwargs": template_kwargs, "data_split": data_split,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "cpu_threads": threads,
            "target_layer_ids": list(dcfg.target_layer_ids), "target_new_tokens": target_tokens,
        },
    )  # fmt: skip
