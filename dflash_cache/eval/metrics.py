"""Acceptance figures of speculative decoding, from the tokens each verification step committed.

tau is the mean number of tokens committed per verification step (accepted drafts + bonus). Two
means are reported: ``tau`` pools every step of every prompt; ``tau_per_prompt`` is the mean over
prompts of each prompt's tau, the figure the DFlash reference benchmark prints ("Average
Acceptance length") and the one published numbers are.

``by_context`` holds the same figures by the prompt's length (`context_figures`): a prompt's context
is its tokens, the chat template's rendering of it (a later turn's with the earlier turns and the
target's own answers), which is what the drafter sees at its first step. Buckets double from 1K
tokens (1,024): ``0-1K`` holds prompts of up to 1,024 tokens, ``1K-2K`` 1,025 to 2,048, then
``2K-4K``, ``4K-8K``, ... without end; only buckets that hold a prompt are reported. Where prompts
name their ``source`` (long-code's: each file asked at several lengths), a bucket's ``kept`` sets
its prompts' tau against the same files' at the shortest length each is asked at. A decode at
batch 1 times each prompt (`timed`), so its buckets also give the speed: tokens/s with prefills,
milliseconds a step without them, and against the target alone, the speedup.

Pure functions over lists of acceptance lengths and `dflash eval`'s sample dicts (no model, no
torch), so the decode driver (`eval.decode`), the replay driver (`eval.replay`) and the scripts that
merge results compute them the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = [
    "EvalResult",
    "acceptance",
    "context_bucket",
    "context_figures",
    "figures",
    "first_difference",
    "speed_figures",
    "histogram",
    "kept_figures",
    "tau",
    "tau_per_prompt",
    "timed",
    "turn_figures",
]


@dataclass
class EvalResult:
    """What `dflash eval` reports. histogram[i] counts the steps that committed i+1 tokens.

    tau pools all verification steps of all prompts; tau_per_prompt is the mean over prompts of
    each prompt's own tau (the reference benchmark's figure; see the module docstring). Each turn of
    a dialogue is a prompt; ``turns`` holds the same figures for each turn apart, ``by_context``
    for each bucket of prompt length (`context_figures`); ``rejected`` lists the turns left out,
    each with its reason (a prompt and its answer past the target's positions). ``lookup`` holds
    them for prompt lookup (`dflash_cache.generate.lookup`, n-grams of the prompt and the output so far, as
    many drafts a step as the drafter), the baseline that needs no training: under greedy decoding the output
    does not depend on the drafter, so its acceptance follows from each prompt and output alone."""

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
    turns: list[dict] = field(default_factory=list)
    lookup: dict | None = None  # the prompt-lookup drafter on the same prompts (greedy only)
    by_context: dict = field(default_factory=dict)  # bucket label -> figures (context_figures)
    rejected: list[dict] = field(default_factory=list)  # turns not asked: past the target's positions

    def to_dict(self) -> dict:
        return asdict(self)


CONTEXT_EDGE = 1024  # the first bucket's upper edge, in prompt tokens; each next one doubles it


def context_bucket(tokens: int) -> tuple[int, int]:
    """(fewest, most) prompt tokens of the bucket that holds a prompt of `tokens`: (1, 1024),
    (1025, 2048), (2049, 4096), ..."""
    high = CONTEXT_EDGE
    while tokens > high:
        high *= 2
    return (1 if high == CONTEXT_EDGE else high // 2 + 1, high)


def _bucket_label(low: int, high: int) -> str:
    return f"{'0' if low == 1 else f'{(low - 1) // 1024}K'}-{high // 1024}K"


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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs part (the shorter one's length when one is
    the other's prefix), None when they are equal: late partings point at rounding, early ones at
    a bug."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def acceptance(samples: list[dict], drafts: int) -> dict:
    """A run's acceptance figures from its samples, whose blocks drafted `drafts` tokens: tau pooled
    and per prompt, the histogram, the steps and each turn's figures."""
    lengths = [s["acceptance_lengths"] for s in samples]
    flat = [n for steps in lengths for n in steps]
    return {"tau": tau(flat), "tau_per_prompt": tau_per_prompt(lengths), "histogram": histogram(flat, drafts + 1),
            "steps": len(flat), "turns": turn_figures(samples), "by_context": context_figures(samples)}  # fmt: skip


def figures(lengths: list[list[int]]) -> dict:
    """tau pooled and per prompt and the steps, from each prompt's acceptance lengths."""
    flat = [n for steps in lengths for n in steps]
    return {"tau": tau(flat), "tau_per_prompt": tau_per_prompt(lengths), "steps": len(flat)}


def turn_figures(samples: list[dict], lengths: str = "acceptance_lengths") -> list[dict]:
    """Each turn's figures (the first turn of every prompt, the second of those that have one, ...)."""
    out = []
    for turn in sorted({s["turn"] for s in samples}):
        mine = [s for s in samples if s["turn"] == turn]
        out.append({"turn": turn, "prompts": len(mine), **figures([s[lengths] for s in mine]),
                    "new_tokens": sum(s["new_tokens"] for s in mine)})  # fmt: skip
    return out


def context_figures(samples: list[dict], lengths: str = "acceptance_lengths") -> dict[str, dict]:
    """Each non-empty bucket of prompt length (`context_bucket`, by each sample's ``prompt_tokens``),
    shortest first, labelled ``0-1K``, ``1K-2K``, ...: its token range, prompts, and figures, and what
    its prompts keep of their files' tau at shorter lengths (`kept_figures`)."""
    buckets: dict[tuple[int, int], list[dict]] = {}
    for s in samples:
        buckets.setdefault(context_bucket(s["prompt_tokens"]), []).append(s)
    return {_bucket_label(*b): {"tokens": list(b), "prompts": len(mine), **figures([s[lengths] for s in mine]),
                                "new_tokens": sum(s["new_tokens"] for s in mine),
                                **(speed_figures(mine) if lengths == "acceptance_lengths" else {}),
                                **kept_figures(mine, samples, lengths)}
            for b, mine in sorted(buckets.items())}  # fmt: skip


def kept_figures(mine: list[dict], samples: list[dict], lengths: str = "acceptance_lengths") -> dict:
    """Where prompts name their ``source`` (a file asked at several lengths, as long-code asks it):
    ``kept``, the tau per prompt of `mine`'s prompts whose file is asked in a shorter bucket too, over
    the tau per prompt of those files' prompts in the shortest bucket each is asked in; and
    ``kept_prompts``, how many of `mine` that counts. So a bucket that asks fewer files than a
    shorter one compares those files with themselves. Nothing where no prompt of `mine` has such a
    file (or the shorter prompts made no step)."""
    shortest: dict[str, tuple[int, int]] = {}  # each file's shortest bucket
    for s in samples:
        if s.get("source") is not None:
            b = context_bucket(s["prompt_tokens"])
            shortest[s["source"]] = min(shortest.get(s["source"], b), b)

    def longer(s: dict) -> bool:
        return s.get("source") in shortest and context_bucket(s["prompt_tokens"]) > shortest[s["source"]]

    here = [s for s in mine if longer(s)]
    files = {s["source"] for s in here}
    there = [s for s in samples if s.get("source") in files and not longer(s)]
    base = tau_per_prompt([s[lengths] for s in there])
    if not here or not base:
        return {}
    return {"kept": tau_per_prompt([s[lengths] for s in here]) / base, "kept_prompts": len(here)}


def timed(spec: tuple[float, float] | None, target: tuple[float, float] | None,
          target_tokens: int | None) -> dict:  # fmt: skip
    """A sample's timing fields from its decode's (seconds, prefill seconds) and the target alone's
    with its new tokens; None where a run was not timed (batched, or not run)."""
    return {"seconds": spec[0] if spec else None, "prefill_seconds": spec[1] if spec else None,
            "target_seconds": target[0] if target else None,
            "target_new_tokens": target_tokens if target else None}  # fmt: skip


def speed_figures(samples: list[dict]) -> dict:
    """The speed of timed samples (`timed`): tokens/s with prefills and ms a verification step
    without them, and the target alone's tokens/s and the speedup where it was timed too; nothing
    where a sample was not timed."""
    if not samples or any(s.get("seconds") is None for s in samples):
        return {}
    seconds = sum(s["seconds"] for s in samples)
    decoding = seconds - sum(s["prefill_seconds"] for s in samples)
    out = {"tok_s": sum(s["new_tokens"] for s in samples) / seconds,
           "ms_per_step": 1000 * decoding / max(1, sum(s["steps"] for s in samples))}  # fmt: skip
    if all(s.get("target_seconds") is not None for s in samples):
        target_tok_s = sum(s["target_new_tokens"] for s in samples) / sum(s["target_seconds"] for s in samples)
        out |= {"target_tok_s": target_tok_s, "speedup": out["tok_s"] / target_tok_s}
    return out
