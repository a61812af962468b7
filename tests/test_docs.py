"""Every document the repository names exists: a reader who follows a pointer in the code, the tests,
the data and benchmark scripts or the docs finds the page it names.

Checked in the repository's text files (the top-level documents, and every text file under
dflash_cache/, cli/, tests/, data/, benchmarks/, docs/ and .ci/; data files such as JSON Lines are not read):

- a path to a Markdown file from the repository root (`docs/guides/train.md`), or a top-level one
  by name (`README.md`, `QUALITY.md`), resolved from the root or from the naming file's folder;
- the bare name of a design document in capitals, without `.md`, counts as naming that `.md` file;
- in Markdown files, every relative link, and its `#anchor` when it points into a Markdown file
  (GitHub's heading slugs).

This file is not scanned: its own examples name documents that do not exist on purpose.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("dflash_cache", "cli", "tests", "data", "benchmarks", "docs", ".ci")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".ini", ".yaml", ".yml", ".jinja", ""}

LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target
ROOTED = re.compile(r"(?<![\w/.-])((?:dflash_cache|cli|tests|data|benchmarks|docs)/[\w./-]*?\.md)(?![\w-])")
TOP_LEVEL = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_-]*\.md)(?![\w-])")
BARE_DESIGN = re.compile(r"\bDESIGN\b(?!\.md)")


def text_files(root: Path) -> Iterator[Path]:
    """The files whose document references are checked, in a stable order."""
    yield from sorted(p for p in root.iterdir() if p.is_file() and p.suffix in {".md", ".toml"})
    for top in SCANNED:
        if not (root / top).is_dir():
            continue
        for path in sorted((root / top).rglob("*")):
            parts = path.relative_to(root / top).parts
            if any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info") for p in parts):
                continue
            if path.is_file() and not path.is_symlink() and path.suffix in TEXT_SUFFIXES:
                yield path


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(md: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings (outside fenced code), repeats numbered as GitHub does."""
    out, seen, fenced = set(), {}, False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


def broken_references(root: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    """`file:line: target` for every document reference under `root` that does not resolve."""
    bad = []
    for path in text_files(root):
        if path.resolve() in skip:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file without a suffix
            continue
        rel = path.relative_to(root)
        for number, line in enumerate(text.splitlines(), 1):
            named = ROOTED.findall(line) + TOP_LEVEL.findall(line) + ["DESIGN.md"] * len(BARE_DESIGN.findall(line))
            bad += [f"{rel}:{number}: {name}" for name in named
                    if not (root / name).exists() and not (path.parent / name).exists()]  # fmt: skip
            if path.suffix != ".md":
                continue
            for link in LINK.findall(line):
                if "://" in link or link.startswith("mailto:"):
                    continue
                target, _, anchor = link.partition("#")
                linked = (path.parent / target) if target else path
                if not linked.exists():
                    bad.append(f"{rel}:{number}: {link}")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.resolve()):
                    bad.append(f"{rel}:{number}: {link} (no such heading)")
    return bad


def test_every_named_document_exists() -> None:
    bad = broken_references(ROOT, skip=(Path(__file__).resolve(),))
    assert not bad, "documents named but not in the repository:\n" + "\n".join(bad)


def test_the_check_finds_each_kind_of_broken_reference(tmp_path: Path) -> None:
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "dflash_cache").mkdir()
    (tmp_path / "README.md").write_text("# Title\n\n## A section\n\n[ok](docs/reference/page.md#the-page)\n")
    (tmp_path / "docs" / "reference" / "page.md").write_text(
        "# The page\n\n[up](../../README.md#a-section) [here](#the-page) README.md\n"
        "[gone](../guides/missing.md) [no heading](../../README.md#nowhere)\n")  # fmt: skip
    (tmp_path / "dflash_cache" / "mod.py").write_text(
        '"""See docs/reference/page.md and README.md.\n\nDESIGN.md section 3; DESIGN 2b; docs/old.md."""\n'
    )
    assert broken_references(tmp_path) == [
        "dflash_cache/mod.py:3: docs/old.md",
        "dflash_cache/mod.py:3: DESIGN.md",
        "dflash_cache/mod.py:3: DESIGN.md",
        "docs/reference/page.md:4: ../guides/missing.md",
        "docs/reference/page.md:4: ../../README.md#nowhere (no such heading)",
    ]
