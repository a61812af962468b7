"""The settings of `dflash eval` (eval/decode.py) and `dflash eval-sets` (eval/sets.py), declared as
the stages' are (see dflash_cache/core/settings.py): the CLI builds the commands' options from them
and the evaluations take their defaults from them. Light: importing it loads no torch (the CLI reads it at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cache.core.settings import same_as, setting
from dflash_cache.extract.config import DATA_HELP, KWARGS_HELP, SPLIT_HELP, TARGET_HELP

CODE_ROOTS = ("stdlib",)  # where long-code's modules come from unless told
CODE_ROOTS_HELP = ("Where long-code's modules come from: the held-out side of the module split of stdlib (the "
                   "interpreter's standard library), site-packages, or directories (a library's own, such as "
                   "transformers'). Few standard-library modules hold 16K tokens, and one at most 30K: for a 32K "
                   "target, name site-packages or a library.")  # fmt: skip


def lookup_list_problem(values: list[int] | tuple[int, ...]) -> str | None:
    """What is wrong with a list of `--lookup` values (recipe, eval-sets), or None: each run decodes
    once per value, so they are distinct, and each is 0 (the drafter alone) or an n-gram length."""
    if not values or min(values) < 0 or len(set(values)) < len(values):
        return f"--lookup: distinct values of 0 (the drafter alone) or more, got {list(values)}"
    return None


@dataclass
class EvalConfig:
    target: str = setting(help=TARGET_HELP)
    drafter: Path = setting(help="Exported drafter (config.json + model.safetensors), e.g. RUN/export.")
    data: str = setting(help="Prompts: " + DATA_HELP + " Trailing assistant turns are dropped; a turns row "
                        "(MT-Bench's question.jsonl) asks each turn after the target's own answer to the one before.")
    max_new_tokens: int = setting(128, "Tokens to generate per prompt.", min=1)
    temperature: float = setting(0.0, "0: greedy; above 0: speculative sampling.", min=0)
    seed: int = setting(0, "Seed of the sampling generators.")
    block_size: int | None = setting(None, "Block size B (default: the drafter's).", min=2)
    limit: int | None = setting(None, "Use only the first N prompts.", min=1)
    batch_size: int | None = setting(None, "Prompts decoded at once (default 128 on a GPU, as many as fit; 16 on a "
                                     "CPU). 1 gives the single-stream speedup.", min=1)  # fmt: skip
    chat_template_kwargs: dict[str, Any] | None = setting(
        None, KWARGS_HELP + " The DFlash reference benchmark runs Qwen3 with thinking off.")  # fmt: skip
    data_split: str | None = setting(None, SPLIT_HELP)
    first_turn: bool = setting(False, "Ask only the first turn of a turns row (DeepSpec's MT-Bench figure); by "
                               "default every turn is asked, as z-lab's benchmark does.")  # fmt: skip
    lookup: int = setting(0, "Mix prompt lookup into the drafter: a step drafts from the context's own n-grams "
                          "where its last N tokens occurred before, from the drafter elsewhere (0: the drafter "
                          "alone). Greedy only.", min=0)  # fmt: skip

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A result that `dflash eval --json` wrote: the settings it ran with."""
        if "settings" in data and "tau" in data:
            return {k: v for k, v in data["settings"].items() if k in EvalConfig.__dataclass_fields__}
        return data


@dataclass
class EvalSetsConfig:
    target: str = same_as(EvalConfig, "target")
    benchmarks: list[str] | None = setting(None, "Comma-separated sets: humaneval, mt-bench, sharegpt (the held-out "
                                           "slice), each from its PyPI package's file, long-code (held-out Python "
                                           "modules of --code-roots to continue, 1K to 30K tokens), or prompt "
                                           "files. Default: humaneval,mt-bench,sharegpt (without --data).")  # fmt: skip
    code_roots: list[str] = setting(help=CODE_ROOTS_HELP, factory=lambda: list(CODE_ROOTS))
    untrained: bool = setting(False, "Also a drafter of the first one's shape with random weights.")
    max_new_tokens: int = setting(512, "Tokens to generate per prompt and turn (where dflash eval's quick look stops "
                                  "at 128: a benchmark's answers, a HumanEval function or an MT-Bench turn, run "
                                  "longer).", min=1)  # fmt: skip
    limit: int | None = setting(None, "Use only the first N prompts of each set.", min=1)
    batch_size: int = setting(1, "Prompts decoded at once (where dflash eval decodes as many as fit): 1 gives the "
                              "single-stream speedup the DFlash paper reports.", min=1)  # fmt: skip
    first_turn: bool = same_as(EvalConfig, "first_turn")
    temperature: float = same_as(EvalConfig, "temperature")
    chat_template_kwargs: dict[str, Any] | None = same_as(EvalConfig, "chat_template_kwargs")
    replay: bool = setting(False, "Decode with the first drafter only: the others' tau comes from replaying its "
                           "greedy outputs (the decode's tau up to rounding, seconds instead of a decode each; no "
                           "speed figures).")  # fmt: skip
    lookup: list[int] = setting(help="Each drafter runs once for each value, in that order: 0 alone, N with prompt "
                                "lookup mixed in where the last N tokens occurred before (dflash eval --lookup).",
                                factory=lambda: [0], expects="comma-separated whole numbers")  # fmt: skip
    json_out: Path = setting(Path("eval-sets.json"), "Where the full result is written.")
