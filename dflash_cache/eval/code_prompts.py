"""Code prompts that nobody here wrote: "complete this function" prompts from the Python functions
and methods of the running interpreter's standard library and site-packages, read with ``ast``
(nothing is imported), offline. `dflash recipe` trains on them beside ShareGPT, since HumanEval
asks for code and ShareGPT holds little.

- A function with a docstring becomes its header and docstring (HumanEval's form: the model writes
  the body); one without becomes its header and the first third of its body statements (at least
  one kept back), if it has three or more. A method keeps its class line.
- Test suites (``test/``, ``tests/``, ``test_*.py``), this project's packages and files over 1 MB are
  skipped; prompts of 80 to 2,000 characters are kept, each once.
- **Held-out modules.** About 15% of modules, by a hash of the module's dotted name
  (`held_out_module`), are the eval's: `long_code` asks to continue them, so no training text
  comes from them (`source_files` gives the training side unless asked for the held-out one). The
  rule reads the name alone, so a name is on the same side on every interpreter.
- **Decontamination.** HumanEval is an eval, so no prompt derives from it: a file that mentions
  HumanEval (``humaneval`` or ``human_eval``, any case) is skipped, and so is every function named
  like one of HumanEval's 164 entry points (``has_close_elements``, ``fib``, ...).

The user message is HumanEval's (`benchsets.humaneval_user`), so training and eval ask alike. A row
is ``{"prompt": message, "source": "root/path.py:Class.name"}``. Rows come in a seeded order of all
candidates, so the first N rows are the same whatever N, on one interpreter with the same packages;
the manifest (``OUT.json``) records the interpreter, the roots, the counts and the file's sha256.
"""

from __future__ import annotations

import ast
import hashlib
import json
import multiprocessing
import random
import sys
import sysconfig
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dflash_cache.eval import benchsets
from dflash_cache.rows.chat import DataError

__all__ = ["ROOTS", "build", "held_out_module", "manifest_path", "mentions_humaneval", "module_name", "root_dirs",
           "source_files"]

ROOTS = ("stdlib", "site-packages")
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages"}
OWN = {"dflash_cache"}  # this project's package (the CLI inside it), when installed into site-packages
MIN_CHARS, MAX_CHARS, MAX_FILE = 80, 2000, 1 << 20
HOLDOUT_PERCENT = 15  # of modules, by a hash of the module name: long_code's, never trained on


def root_dirs(names: list[str]) -> list[tuple[str, Path]]:
    """(label, directory) of each root: ``stdlib``, every ``site-packages`` directory, or a path."""
    paths = sysconfig.get_paths()
    out: list[tuple[str, Path]] = []
    for name in names:
        if name == "stdlib":
            out.append(("stdlib", Path(paths["stdlib"])))
        elif name == "site-packages":
            out += [("site-packages", Path(d)) for d in dict.fromkeys((paths["purelib"], paths["platlib"]))]
        elif Path(name).is_dir():
            out.append((Path(name).name, Path(name)))
        else:
            raise DataError(f"code prompt root {name!r}: neither stdlib, site-packages nor a directory")
    return out


def module_name(label: str, rel: Path) -> str:
    """The dotted module name of a file `rel` under a root labelled `label`: ``xml/dom/minidom.py``
    is ``xml.dom.minidom``, ``json/__init__.py`` is ``json``, a root's own ``__init__.py`` the root's."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or label


def held_out_module(name: str) -> bool:
    """Whether a module is on the eval side of the split (`long_code`'s, never trained on): the
    first 32 bits of the sha256 of its dotted name, modulo 100, below HOLDOUT_PERCENT."""
    digest = hashlib.sha256(f"python-module:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HOLDOUT_PERCENT


def source_files(roots: list[tuple[str, Path]], *, held_out: bool = False) -> list[tuple[str, Path]]:
    """(label/relative path, file) of every source file taken, sorted: the training side of the
    module split, or with `held_out` the eval side."""
    files = []
    for label, root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if any(p in SKIP_DIRS or p.endswith(".dist-info") for p in rel.parts[:-1]) or rel.name.startswith("test_"):
                continue
            if rel.parts[0] in OWN or path.stat().st_size > MAX_FILE:
                continue
            if held_out_module(module_name(label, rel)) == held_out:
                files.append((f"{label}/{rel.as_posix()}", path))
    return files


def mentions_humaneval(text: str) -> bool:
    """Whether a file names HumanEval (``humaneval`` or ``human_eval``, any case): it may hold its
    problems, so no training text comes from it."""
    low = text.lower()
    return "humaneval" in low or "human_eval" in low


def file_prompts(job: tuple[str, str, frozenset[str]]) -> list[tuple[str, str]]:
    """(source, code) of every function prompt of one file; none for a file that mentions HumanEval."""
    name, path, banned = job
    try:
        text = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []
    if mentions_humaneval(text):
        return []
    lines = text.split("\n")  # as ast counts lines: splitlines() also cuts at \x0c, U+2028 and the like
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST, cls: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and cls is None:
                visit(child, child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name not in banned:
                code = function_prompt(child, lines, cls)
                if code is not None and MIN_CHARS <= len(code) <= MAX_CHARS:
                    out.append((f"{name}:{cls.name + '.' if cls else ''}{child.name}", code))

    visit(tree, None)
    return out


def function_prompt(fn: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str],
                    cls: ast.ClassDef | None) -> str | None:  # fmt: skip
    """The prompt's code: decorators, signature and docstring; or, without a docstring, the
    signature and the first third of the body's statements (None when that leaves too little)."""
    start = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
    body = fn.body
    if ast.get_docstring(fn) is not None:
        end = body[0].end_lineno
    elif len(body) >= 3:
        end = body[max(1, len(body) // 3) - 1].end_lineno
    else:
        return None
    code = textwrap.dedent("\n".join(lines[start - 1 : end])) + "\n"
    if cls is not None:
        code = f"class {cls.name}:\n" + textwrap.indent(code, "    ")
    return code


def build(out: Path, *, roots: list[str] = list(ROOTS), seed: int = 0, procs: int = 1) -> dict[str, Any]:  # noqa: B006
    """Write every candidate prompt of `roots` (the training side of the module split) to `out`
    (atomically) in a seeded order, then the manifest beside it (`manifest_path`: a file with one is
    complete); returns the manifest."""
    banned = benchsets.humaneval_entry_points()
    where = root_dirs(roots)
    files = source_files(where)
    jobs = [(name, str(path), banned) for name, path in files]
    if procs > 1:
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:  # no fork under torch
            per_file = list(pool.map(file_prompts, jobs, chunksize=64))
    else:
        per_file = [file_prompts(j) for j in jobs]
    seen: set[str] = set()
    rows = []
    for prompts in per_file:
        for source, code in prompts:
            if code not in seen:
                seen.add(code)
                rows.append({"prompt": benchsets.humaneval_user(code), "source": source})
    random.Random(seed).shuffle(rows)
    digest = benchsets.write_rows(rows, out)
    manifest = {"rows": len(rows), "files": len(files), "roots": [str(p) for _, p in where], "seed": seed,
                "python": sys.version.split()[0], "banned_names": len(banned),
                "held_out_modules": f"{HOLDOUT_PERCENT}% by a hash of the module name", "sha256": digest}  # fmt: skip
    manifest_path(out).write_text(json.dumps(manifest, indent=1) + "\n")  # last: it marks the file complete
    return manifest


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")
