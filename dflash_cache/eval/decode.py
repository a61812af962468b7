"""`dflash eval`: speculative decoding with the target and an exported drafter, and tau (docs/architecture.md).

Decoding runs through the generation engine (`dflash_cache.generate`), many prompts at once: every
prompt has a row of its own, at its own position, and keeps its own acceptance; rows end at
different steps and the next prompts take their places. Each step:

1. the drafter fills a block ``[last committed token, mask x (B-1)]`` at positions ``[p, p+B)``
   per row, from the target's tapped states of every position ``< p`` (layer id l = output of
   decoder layer l = ``hidden_states[l+1]``, taken as the target runs: `SlotTarget`'s decoder keeps
   the tapped layers' outputs, `CachedTarget` captures them by forward hooks; the target never runs
   with ``output_hidden_states``), whose keys and values the drafter keeps per row;
2. the target verifies ``[last, d1..d_{B-1}]`` in one forward; the longest accepted prefix of the
   draft plus the target's own next token (the bonus) is committed, and the tapped states of the
   committed positions join the context.

tau is the mean number of tokens committed per verification step (accepted drafts + bonus),
pooled (``tau``) and per prompt (``tau_per_prompt``, the reference benchmark's figure), and both by
the prompt's length in tokens (``by_context``): `eval.metrics`.

A prompt is never cut, and never run at positions the target was not built for: one whose tokens
and ``max_new_tokens`` exceed its ``max_position_embeddings`` is rejected, left out of the figures and
listed with the reason in ``rejected`` (a later turn that would, with the turns after it).

Temperature 0 compares argmaxes, so greedy speculative decoding reproduces target-only greedy
decoding token for token, and a prompt's output and tau do not depend on the batch it ran in.
Temperature > 0 uses the speculative-sampling rule (Leviathan et al. 2023), whose output has
exactly the target's sampling distribution; each prompt's draws are keyed by (seed, prompt index,
position), so they too are independent of the batch.

A ``turns`` row (MT-Bench's ``question.jsonl``) is a dialogue: its second turn is asked after the
target's own answer to the first (`dialogue.Dialogue`), as z-lab's benchmark runs MT-Bench; greedy
speculation gives the target's own answer, so both runs ask the same second turn. The engine is driven
turn by turn (`dialogue.turn_by_turn`): a turn's request is made when the turn before it completes.
Every turn is a prompt of its own in ``tau_per_prompt``; ``turns`` reports each turn's figures apart.
``first_turn`` asks the first turn only (DeepSpec's MT-Bench figure).

The target-alone baseline decodes the same prompts in the same batches, so the speedup is that
of speculative decoding at this batch size (`--batch-size 1` gives the single-stream figure).

``lookup`` = N mixes prompt lookup into the drafter (`generate.lookup_mix`): a step drafts from the
context's own n-grams where its last N tokens occurred before.

`eval.replay.replayed` gives another drafter's greedy tau on an evaluation's outputs without
decoding: one forward of each model per prompt, no speed figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_cache import drafters
from dflash_cache.core.damage import DamagedFile
from dflash_cache.core.devices import Worker, flush_denormals
from dflash_cache.core.progress import ProgressSink
from dflash_cache.core.threads import worker_threads
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.metrics import (
    EvalResult,
    acceptance,
    context_figures,
    figures,
    first_difference,
    tau,
    tau_per_prompt,
    timed,
    turn_figures,
)
from dflash_cache.generate import (
    ERROR,
    BlockProposer,
    Completion,
    Engine,
    LookupMix,
    Request,
    StopRule,
    fit_slots,
    load_model,
    lookup,
    make_target,
    slot_bytes,
)
from dflash_cache.generate.dialogue import (
    Dialogue,
    first_prompt,
    load_dialogues,
    reply_decoder,
    turn_by_turn,
)
from dflash_cache.generate.proposer import proposer_slot_bytes
from dflash_cache.rows.chat import DataError, RowRejected, check_template_kwargs
from dflash_cache.target.config import max_positions, text_config
from dflash_cache.target.load import TargetError, first_line, load_config, load_tokenizer, stop_token_ids

__all__ = ["EvalError", "check_config", "check_drafter_matches_target", "evaluate", "load_drafter"]

ANSWER_SLACK = 8  # positions an answer may take beyond its tokens once decoded and rendered again


class EvalError(TargetError):
    """A drafter that does not fit the target, or settings that cannot run. A TargetError, so
    the CLI reports it as one `error:` line like the other user errors."""


# ----------------------------------------------------------------------------- prompts, loading


def check_drafter_matches_target(dcfg, target_config: dict) -> None:
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


def check_config(cfg: EvalConfig) -> None:
    """A one-line EvalError for settings no evaluation can run with, before anything loads."""
    if cfg.max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0:
        raise EvalError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise EvalError(f"block size must be >= 2, got {cfg.block_size}")
    if cfg.lookup and cfg.temperature != 0:
        raise EvalError("--lookup needs greedy decoding (temperature 0): lookup's drafts have no probabilities")
    drafter = Path(cfg.drafter)
    if not (drafter / "config.json").is_file() or not (drafter / "model.safetensors").is_file():
        raise EvalError(f"--drafter {drafter}: not an exported drafter (needs config.json and model.safetensors)")


# ----------------------------------------------------------------------------- the two runs


@dataclass
class _Prompts:
    """The prompt set as both runs ask it: the dialogues, their first prompts, how to render the
    later ones and how to seed each request."""

    dialogues: list[Dialogue]
    first: list[list[int]]
    tokenizer: Any
    kwargs: dict
    max_new_tokens: int
    seed: int
    positions: int | None  # the target's (max_position_embeddings), None where its config names none
    rejected: dict[tuple[int, int], dict] = field(default_factory=dict)  # (prompt, turn) -> why

    def fits(self, i: int, k: int, prompt: list[int]) -> bool:
        """Whether turn k of prompt i and its answer stay inside the target's positions; one that
        does not is recorded in `rejected`, with how many turns of its dialogue go unasked."""
        need = len(prompt) + self.max_new_tokens
        if self.positions is None or need <= self.positions:
            return True
        self.rejected[(i, k)] = {
            "index": i, "turn": k + 1, "prompt_tokens": len(prompt), "turns_left_out": len(self.dialogues[i]) - k,
            "reason": f"{len(prompt):,} prompt tokens and --max-new-tokens {self.max_new_tokens:,} need {need:,} "
                      f"positions, more than the target's {self.positions:,} (max_position_embeddings)"}  # fmt: skip
        return False

    @cached_property
    def asked(self) -> list[int]:
        """The prompts whose first turn fits the target's positions (those that do not are recorded
        in `rejected` once, here)."""
        return [i for i, p in enumerate(self.first) if self.fits(i, 0, p)]

    def request(self, i: int, k: int, prompt: list[int]) -> Request:
        # turn 0 keeps the seed of a one-turn prompt; later turns draw other noise (the low 32 bits count)
        return Request(prompt, self.max_new_tokens, seed=self.seed * 1_000_003 + i + k * 0x9E3779B9, key=(i, k))

    def length(self, room: int) -> int:
        """Positions a row needs: a dialogue's last prompt with every earlier answer at its longest,
        and never more than the target's positions (a turn past them is not asked)."""
        longest = 0
        for i in self.asked:
            d, n = self.dialogues[i], len(self.first[i])
            if len(d) > 1:
                n = len(d.prompt(self.tokenizer, self.kwargs, [""] * (len(d) - 1)))
                n += (len(d) - 1) * (self.max_new_tokens + ANSWER_SLACK)
            longest = max(longest, n)
        need = longest + self.max_new_tokens
        return (need if self.positions is None else min(need, self.positions)) + room


@dataclass
class _Run:
    """One engine's completions by (prompt, turn) and the seconds they took, warm-up excluded, of
    which `prefill_seconds` in prefills; at batch 1, each completion's (seconds, prefill seconds)
    in `timing`."""

    completions: dict[tuple[int, int], Completion]
    seconds: float
    prefill_seconds: float
    timing: dict[tuple[int, int], tuple[float, float]]


def _decode(engine: Engine, prompts: _Prompts, progress, skipped, device: torch.device) -> _Run:
    """Every turn of every dialogue through `engine`, a turn's request made when the turn before it
    completes, with the target's own answer in its prompt; a turn past the target's positions is not
    asked, nor are the turns after it (`skipped` is told how many)."""
    decode = reply_decoder(prompts.tokenizer)
    answers: dict[int, list[str]] = {i: [] for i in range(len(prompts.dialogues))}

    def follow(c: Completion) -> Request | None:
        i, k = c.request.key
        if c.finish == ERROR:
            raise EvalError(f"prompt {i} turn {k + 1}: {c.error}")
        answers[i].append(decode(c.reply_ids))
        if k + 1 == len(prompts.dialogues[i]):
            return None
        try:
            ids = prompts.dialogues[i].prompt(prompts.tokenizer, prompts.kwargs, answers[i])
        except RowRejected as e:
            raise DataError(f"prompt {i} turn {k + 2}: {e.reason}") from None
        if not prompts.fits(i, k + 1, ids):
            skipped(len(prompts.dialogues[i]) - k - 1)
            return None
        return prompts.request(i, k + 1, ids)

    asked = prompts.asked
    warm = Request(prompts.first[asked[0]], min(8, prompts.max_new_tokens), key=-1)  # allocations, kernels, graphs
    list(engine.stream([warm]))
    _sync(device)
    t0, prefilled = time.perf_counter(), engine.prefill_seconds
    done, timing, since, prefilled_since = {}, {}, t0, prefilled
    for c in turn_by_turn(engine, [prompts.request(i, 0, prompts.first[i]) for i in asked], follow):
        done[c.request.key] = c
        if engine.target.slots == 1:  # one request at a time: the time since the last one ended is this one's
            timing[c.request.key] = (time.perf_counter() - since, engine.prefill_seconds - prefilled_since)
        progress(c)
        since, prefilled_since = time.perf_counter(), engine.prefill_seconds
    _sync(device)
    return _Run(done, time.perf_counter() - t0, engine.prefill_seconds - prefilled, timing)


@dataclass
class _Setup:
    """The target, the drafter and the engines, sized for the prompts."""

    model: nn.Module
    dcfg: Any
    family: Any
    target: Any
    proposer: BlockProposer | LookupMix
    engines: dict[str, Engine]
    block_size: int


def load_drafter(cfg: EvalConfig, model: nn.Module, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """(drafter, its config, its family), in the target's dtype, checked against the target."""
    dtype = model.get_input_embeddings().weight.dtype
    try:
        drafter, dcfg, family = drafters.load_serving(Path(cfg.drafter), dtype=dtype, device=device)
    except DamagedFile:  # names the file already
        raise
    except (KeyError, ValueError, RuntimeError) as e:
        raise EvalError(f"--drafter {cfg.drafter}: cannot load it ({first_line(e)})") from None
    drafter.eval().requires_grad_(False)
    check_drafter_matches_target(dcfg, model.config.to_dict())
    return drafter, dcfg, family


def _setup(cfg: EvalConfig, prompts: _Prompts, device: torch.device, baseline: bool) -> _Setup:
    model = load_model(cfg.target, device)
    drafter, dcfg, family = load_drafter(cfg, model, device)
    B = cfg.block_size or dcfg.block_size
    length = prompts.length(B + 1)
    wanted = min(len(prompts.asked), cfg.batch_size or (128 if device.type == "cuda" else 16))
    slots = fit_slots(wanted, slot_bytes(model, length) + proposer_slot_bytes(drafter, length), device)
    target = make_target(model, slots, length, dcfg.target_layer_ids)
    proposer = BlockProposer(drafter, embed=model.get_input_embeddings().weight,
                             head=model.get_output_embeddings().weight, slots=target.slots, length=length,
                             block_size=B, family=family)  # fmt: skip
    if cfg.lookup:
        proposer = LookupMix(proposer, cfg.lookup)
    stop = StopRule(stop_token_ids(prompts.tokenizer, model))
    engines = {"spec": Engine(target, stop, temperature=cfg.temperature, proposer=proposer)}
    if baseline:
        engines["target"] = Engine(target, stop, temperature=cfg.temperature)
    return _Setup(model, dcfg, family, target, proposer, engines, B)


def evaluate(cfg: EvalConfig, sink: ProgressSink | None = None, *, baseline: bool = True) -> EvalResult:
    """Speculative decoding vs target-only decoding on the same prompts, in batches of
    `cfg.batch_size` (see the module docstring; the defaults are EvalConfig's).

    The DFlash reference benchmark runs with thinking off (its published Qwen3 drafters are
    non-thinking), greedy, up to 2048 new tokens, and reports tau per prompt (``tau_per_prompt``):
    set those to compare with its numbers. Generation stops at the tokenizer's and the generation
    config's eos and at ``<|im_end|>``. Timings follow a short warm-up (which also captures the
    CUDA graphs). `sink` sees each decoded prompt (speculatively, then by the target alone) and the
    running tau per prompt. ``baseline=False`` skips the target-only run (no speed figures, ``same_as_target`` None)."""
    check_config(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(cfg.target)
    kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    dialogues = load_dialogues(cfg.data, split=cfg.data_split, limit=cfg.limit, first_turn=cfg.first_turn)
    first = [first_prompt(d, tokenizer, kwargs, f"{cfg.data} row {i}") for i, d in enumerate(dialogues)]
    prompts = _Prompts(dialogues, first, tokenizer, kwargs, cfg.max_new_tokens, cfg.seed,
                       max_positions(load_config(cfg.target)))  # bad rows fail first  # fmt: skip
    if not prompts.asked:
        raise DataError(f"{cfg.data}: no prompt fits the target's positions: row 0 has "
                        f"{prompts.rejected[(0, 0)]['reason']}")  # fmt: skip
    setup = _setup(cfg, prompts, device, baseline)
    total = sum(len(dialogues[i]) for i in prompts.asked)
    if sink is not None:
        sink.start(total * len(setup.engines), 0)
    per_prompt: dict[tuple[int, int], list[int]] = {}
    decoded = 0

    def progress(c: Completion | None, turns: int = 1) -> None:
        """`c` decoded, or (None) `turns` turns that are not asked."""
        nonlocal decoded
        decoded += turns
        if c is not None and c.accepted is not None:
            per_prompt[c.request.key] = c.accepted
        if sink is not None:
            sink.update({"prompts": decoded, "tau": tau_per_prompt(list(per_prompt.values()))}, {"prompts": turns})

    # a CPU slows down tenfold on denormal activations, and thrashes with more threads than idle cores
    with flush_denormals(device), worker_threads(Worker(0, 1, device)):
        threads = torch.get_num_threads()
        runs = {name: _decode(engine, prompts, progress, lambda n: progress(None, n), device)
                for name, engine in setup.engines.items()}  # fmt: skip
    if sink is not None:
        sink.close()
    return _result(cfg, setup, prompts, runs, {"device": str(device), "cpu_threads": threads})


def _result(cfg: EvalConfig, setup: _Setup, prompts: _Prompts, runs: dict[str, _Run], where: dict) -> EvalResult:
    spec, ref = runs["spec"], runs.get("target")
    keys = sorted(spec.completions)  # prompt by prompt, turn by turn
    greedy = cfg.temperature == 0
    drafts = setup.proposer.num_drafts or setup.block_size - 1  # 0 when nothing was ever drafted
    lookup_block = drafts + 1  # as many drafts a step as the drafter makes
    samples = [_sample(key, prompts.dialogues[key[0]].source, spec, ref, prompts.tokenizer,
                       lookup_block if greedy else None) for key in keys]  # fmt: skip
    spec_tokens = sum(s["new_tokens"] for s in samples)
    target_tokens = sum(len(c.ids) for c in ref.completions.values()) if ref else 0
    spec_tok_s = spec_tokens / spec.seconds if spec.seconds > 0 else 0.0
    target_tok_s = target_tokens / ref.seconds if ref and ref.seconds > 0 else 0.0
    dtype = setup.model.get_input_embeddings().weight.dtype
    return EvalResult(
        **acceptance(samples, setup.proposer.num_drafts), new_tokens=spec_tokens,
        spec_tok_s=spec_tok_s, target_tok_s=target_tok_s,
        speedup=spec_tok_s / target_tok_s if target_tok_s > 0 else 0.0, samples=samples,
        lookup=_lookup_figures(samples, lookup_block) if greedy else None,
        rejected=[prompts.rejected[k] for k in sorted(prompts.rejected)],
        settings={
            "target": str(cfg.target), "drafter": str(cfg.drafter), "data": str(cfg.data),
            "prompts": len(prompts.dialogues), "turn_prompts": len(samples), "first_turn": cfg.first_turn,
            "block_size": setup.block_size, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "seed": cfg.seed, "limit": cfg.limit, "lookup": cfg.lookup, "chat_template_kwargs": prompts.kwargs,
            "data_split": cfg.data_split, "batch_size": setup.target.slots, "engine": type(setup.target).__name__,
            "drafter_family": setup.family.name, **where, "dtype": str(dtype).removeprefix("torch."),
            "target_layer_ids": list(setup.dcfg.target_layer_ids), "target_new_tokens": target_tokens,
            "spec_seconds": spec.seconds, "target_seconds": ref.seconds if ref else None,
            "spec_prefill_seconds": spec.prefill_seconds,
            "target_prefill_seconds": ref.prefill_seconds if ref else None,
        },
    )  # fmt: skip


def _lookup_figures(samples: list[dict], block_size: int) -> dict:
    """Prompt lookup's figures on the samples' outputs, as a run's: overall, by turn, by context length."""
    return {**figures([s["lookup_lengths"] for s in samples]), "turns": turn_figures(samples, "lookup_lengths"),
            "by_context": context_figures(samples, "lookup_lengths"), "block_size": block_size}  # fmt: skip


def _sample(key: tuple[int, int], source: str | None, spec: _Run, ref: _Run | None, tokenizer,
            lookup_block: int | None) -> dict:  # fmt: skip
    """One prompt's figures, with its row's source; with `lookup_block` (greedy runs), prompt lookup's
    acceptance on its output; at batch 1, the seconds it took (`metrics.timed`) and the target alone's."""
    i, k = key
    c = spec.completions[key]
    other = None if ref is None else ref.completions.get(key)  # sampled answers may lead it to another turn
    lookup_lengths = None if lookup_block is None else lookup.acceptance_lengths(c.request.prompt, c.ids,
                                                                                 block_size=lookup_block)  # fmt: skip
    return {
        "index": i, "turn": k + 1, "source": source, "prompt_tokens": len(c.request.prompt),
        "prompt_ids": list(c.request.prompt),
        "new_tokens": len(c.ids),
        "steps": len(c.accepted), "tau": tau(c.accepted), "acceptance_lengths": c.accepted, "finish": c.finish,
        "same_as_target": None if other is None else c.ids == other.ids,
        "first_difference": None if other is None else first_difference(c.ids, other.ids),
        "output": tokenizer.decode(c.ids), "output_ids": c.ids, "lookup_lengths": lookup_lengths,
        **timed(spec.timing.get(key), None if ref is None else ref.timing.get(key),
                None if other is None else len(other.ids)),
    }  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
