"""Long prompts that nobody here wrote: "continue this Python file" prompts from Python modules, cut to a
token count. A drafter trained on short rows loses its acceptance on long prompts; these measure it
(the ``long-code`` set) and train against it (`dflash recipe --long-rows`).

- **The set** (`set_rows`): every module on the eval side of `code_prompts`' module split (about
  15% of module names, by a hash) under the code roots (the interpreter's standard library unless
  ``--code-roots`` names others: site-packages, or directories) that holds at least SET_MIN_CHARS
  characters, each cut at 1,000, 2,000, 4,000, 7,000, 16,000 and 30,000 tokens
  (`SET_LENGTHS`). Rows go module by module, the lengths in order, so ``--limit`` takes whole
  modules. The lengths sit below the buckets' edges (1,024, 2,048, 4,096, 8,192, 16,384, 32,768),
  so a template kwarg's few tokens never move a prompt across one: one length a bucket, and 7,000
  leaves a target of 8,192 positions (SmolLM2's) room for its answer.
- **Which lengths a module is asked at.** A module is cut at a length only where it holds more
  tokens than that, so the prompt leaves part of it to continue and lands in its length's bucket.
  Up to 7,000 tokens that is every module of the set (SET_MIN_CHARS is 7,000 tokens at up to 5
  characters a token), so the buckets up to 8K differ in length, not in content. Few standard-library
  modules hold 16,000 or 30,000 tokens (about 64,000 and 120,000 characters), so the two longest
  lengths ask fewer modules than the others: on CPython 3.11, 6 and 1 (``tkinter/__init__.py``) of
  the 12, counted with ``make_code_target.py --size long``'s tokenizer or at 4 characters a token,
  and a Python packaged without tkinter has none at 30,000. Site-packages or a library's own
  directory (``transformers``' modeling files) hold many more: the roots that a 32K target needs.
- **Training rows** (`training_rows`): module prefixes of a seeded length between two bounds, from
  the training side of the split only, in a seeded order of the files; a file is taken only where
  its prefix leaves part of it to continue.

A prompt is the longest whole-line prefix of the file whose user message (`continue_user`, in the
fenced form of HumanEval's) fits the length. Lengths are counted by a `Measure`: with a target, its
tokenizer over the message as its chat template renders it, the prompt tokens `dflash eval`
reports; without one (``dflash sets --out`` with no ``--target``), estimated at CHARS_PER_TOKEN
characters a token, about SmolLM2's median over standard-library files (3.95 over 86 of them;
from 1.8 for a file of data tables to 4.9). Lengths that leave fewer than ANSWER_ROOM of the target's
positions for the answer are left out of the set (a target of 4,096 positions gets the 1K and 2K
prompts, one of 8,192 the four up to 7K, one of 32,768 all six); without a target the set is cut
for ESTIMATE_POSITIONS, SmolLM2's 8,192.

Files that mention HumanEval or define a function named like one of its entry points never become
training rows (the rule of `benchsets.training_rows`); ``_sysconfigdata_*`` (the interpreter's
build settings, one dict named for its platform) never becomes a prompt.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from dflash_cache.eval import benchsets, code_prompts
from dflash_cache.rows.chat import DataError

__all__ = ["ANSWER_ROOM", "CHARS_PER_TOKEN", "ESTIMATE_POSITIONS", "SET_LENGTHS", "TRAIN_LENGTHS", "Measure",
           "continue_user", "modules_or_error", "prefix", "set_modules", "set_rows", "training_rows"]

CONTINUE_USER = "Continue this Python file:\n```python\n{code}```"
SET_LENGTHS = (1000, 2000, 4000, 7000, 16000, 30000)  # tokens of the set's prompts, one a by_context bucket
# the fewest tokens of a long training prompt (dflash recipe --long-rows), and the most for a target
# whose config names no positions (otherwise as many as its positions hold with the answer)
TRAIN_LENGTHS = (2000, 7000)
ANSWER_ROOM = 1024  # of the target's positions kept for the answer: a length that leaves fewer is left out
CHARS_PER_TOKEN = 4.0  # the estimate without a tokenizer
ESTIMATE_POSITIONS = 8192  # the positions the set is cut for without a target: SmolLM2's
SET_MIN_CHARS = 36_000  # a module of the set holds 7,000 tokens at up to 5 characters a token
MAX_CHARS_PER_TOKEN = 8  # no tokenizer packs more code into a token: how far a prefix's search looks
GENERATED = ("_sysconfigdata_",)


def continue_user(code: str) -> str:
    """A file's prefix as the user message that asks for its continuation."""
    return CONTINUE_USER.format(code=code if code.endswith("\n") else code + "\n")


class Measure:
    """How a prompt's tokens are counted: with `target`, its tokenizer over the message as its chat
    template renders it (with `kwargs`), exactly what `dflash eval` reports as the prompt's tokens;
    without, ``ceil(characters / CHARS_PER_TOKEN)`` of the message. The tokenizer and config load
    on first use, so naming a target costs nothing until a set is cut."""

    def __init__(self, target: str | None = None, kwargs: Mapping[str, Any] | None = None) -> None:
        self.target, self.kwargs = target, dict(kwargs or {})

    @cached_property
    def _tokenizer(self):
        from dflash_cache.target.load import load_tokenizer

        return load_tokenizer(self.target)

    @cached_property
    def max_positions(self) -> int | None:
        """The target's positions (None without a target, or where its config names none)."""
        if self.target is None:
            return None
        from dflash_cache.target.config import max_positions
        from dflash_cache.target.load import load_config

        return max_positions(load_config(self.target))

    def tokens(self, message: str) -> int:
        """The prompt tokens of a user message."""
        if self.target is None:
            return math.ceil(len(message) / CHARS_PER_TOKEN)
        from dflash_cache.generate.dialogue import chat_prompt

        return len(chat_prompt(self._tokenizer, [{"role": "user", "content": message}], self.kwargs))

    def fits(self, length: int) -> bool:
        """Whether a prompt of `length` tokens leaves ANSWER_ROOM of the target's positions (without a
        target, of ESTIMATE_POSITIONS; a target whose config names no positions fits every length)."""
        positions = self.max_positions if self.target is not None else ESTIMATE_POSITIONS
        return positions is None or length + ANSWER_ROOM <= positions

    def describe(self) -> str:
        """How the tokens were counted, for the record."""
        if self.target is None:
            return (f"estimated at {CHARS_PER_TOKEN:g} characters a token, cut for {ESTIMATE_POSITIONS:,} positions "
                    "(no target given)")
        return f"counted with {self.target}'s tokenizer and chat template"


def prefix(text: str, length: int, measure: Measure) -> tuple[str, int] | None:
    """(code, tokens): the longest whole-line prefix of `text` whose `continue_user` message is at
    most `length` tokens, and its tokens; None when not even the first line fits."""
    lines = text.splitlines(keepends=True)
    ends = [0]
    for line in lines:
        ends.append(ends[-1] + len(line))
    hi = bisect.bisect_right(ends, length * MAX_CHARS_PER_TOKEN) - 1  # more lines hold more than `length` tokens
    lo, best = 1, None
    while lo <= hi:  # tokens grow with the lines kept: the largest count that fits
        mid = (lo + hi) // 2
        n = measure.tokens(continue_user(text[: ends[mid]]))
        if n <= length:
            lo, best = mid + 1, (text[: ends[mid]], n)
        else:
            hi = mid - 1
    return best


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def set_modules(roots: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    """(source, text) of the set's modules under `roots` (`code_prompts.root_dirs`): the eval side of
    the split, at least SET_MIN_CHARS characters, generated files left out; sorted by path."""
    out = []
    for name, path in code_prompts.source_files(roots, held_out=True):
        if path.name.startswith(GENERATED):
            continue
        text = _read(path)
        if text is not None and len(text) >= SET_MIN_CHARS:
            out.append((name, text))
    return out


def modules_or_error(roots: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    """`set_modules`, or a one-line error where `roots` hold none."""
    if not roots:
        raise DataError("long-code: no --code-roots to take its modules from")
    if not (modules := set_modules(roots)):
        raise DataError(f"long-code: no module on the held-out side of {', '.join(str(d) for _, d in roots)} holds "
                        f"{SET_MIN_CHARS:,} characters; name other --code-roots")  # fmt: skip
    return modules


def set_rows(roots: list[tuple[str, Path]], measure: Measure) -> Iterator[dict[str, Any]]:
    """The ``long-code`` set's rows (module docstring) from the held-out modules of `roots`:
    ``{"prompt", "source", "length", "tokens"}``, module by module, each at every length of
    SET_LENGTHS that `measure` fits and the module holds more tokens than (its prompt leaves part of
    it to continue)."""
    lengths = [n for n in SET_LENGTHS if measure.fits(n)]
    if not lengths:
        raise DataError(f"long-code: {measure.target} has {measure.max_positions} positions, too few for a prompt of "
                        f"{SET_LENGTHS[0]:,} tokens and {ANSWER_ROOM:,} more for its answer")  # fmt: skip
    for source, text in modules_or_error(roots):
        whole = measure.tokens(continue_user(text))
        for length in lengths:
            if whole <= length:  # the whole module fits: nothing left to continue
                break
            cut = prefix(text, length, measure)
            if cut is not None and len(cut[0]) < len(text.rstrip()):
                yield {"prompt": continue_user(cut[0]), "source": source, "length": length, "tokens": cut[1]}


def training_rows(n: int, roots: list[str], measure: Measure, low: int, high: int,
                  seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """`n` long training prompts, ``{"prompt", "source", "length", "tokens"}``: prefixes of the
    training side of `roots` (`code_prompts.root_dirs`), each of a length drawn between `low` and
    `high` tokens, its file the next in a seeded order of them whose prefix of that length leaves
    part of the file and holds at least `low` tokens. Files that mention HumanEval or define one of
    its functions are left out."""
    if not 0 < low <= high:
        raise DataError(f"long rows: lengths {low:,} to {high:,} tokens are not a range")
    defines = benchsets.humaneval_definitions()
    files = code_prompts.source_files(code_prompts.root_dirs(roots))
    rng = random.Random(seed)
    rng.shuffle(files)
    texts: dict[int, str | None] = {}  # a file's text, None where it is not taken
    whole: dict[int, int] = {}  # a file's tokens as one prompt
    rows: list[dict[str, Any]] = []
    at = 0
    for _ in range(n):
        length = rng.randint(low, high)
        for tried in range(len(files) + 1):
            if tried == len(files):
                raise DataError(f"long rows: no training-side file of {', '.join(roots)} holds more than {length:,} "
                                "tokens to continue")  # fmt: skip
            i = (at + tried) % len(files)
            if i not in texts:
                text = _read(files[i][1])
                usable = text is not None and not code_prompts.mentions_humaneval(text) and not defines.search(text)
                texts[i] = text if usable else None
            text = texts[i]
            if text is None or len(text) < low:  # too short to hold `low` tokens
                continue
            if i not in whole:
                whole[i] = measure.tokens(continue_user(text))
            if whole[i] <= length:  # a prefix of that length would leave nothing to continue
                continue
            cut = prefix(text, length, measure)
            if cut is not None and len(cut[0]) < len(text.rstrip()) and cut[1] >= low:
                rows.append({"prompt": continue_user(cut[0]), "source": files[i][0], "length": length,
                             "tokens": cut[1]})  # fmt: skip
                at = i + 1
                break
    return rows
