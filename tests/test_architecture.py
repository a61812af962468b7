"""The layout docs/architecture.md draws, held against the code: imports point down the tiers, no
package imports another of its own tier, and no module or function outgrows what a reader can hold.

The tiers are read from the architecture page's own diagram, so the page and this test cannot drift.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "dflash_cache"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
# Triton kernels are one function by nature: their bodies and the builders that close over them.
KERNEL_DIR = LIB / "kernels"


def tiers() -> list[set[str]]:
    """The tiers of the architecture page's import diagram, top first: `cli`, then `-> a | b  comment`."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    diagram = re.search(r"```\ncli\n( -> .*?)```", text, re.S)
    assert diagram, "docs/architecture.md has no import diagram (a fenced block: cli, then ' -> tier' lines)"
    rows = [{"cli"}]
    for line in diagram.group(1).splitlines():
        if line.startswith(" -> "):  # other lines continue the comment of the tier above
            names = re.match(r" -> ([a-z_]+(?: \| [a-z_]+)*)", line)
            assert names, f"unreadable tier line in docs/architecture.md: {line!r}"
            rows.append(set(names.group(1).split(" | ")))
    return rows


def package_of(module: str) -> str | None:
    """The tier package a dotted module belongs to (`dflash_cache.cache.spec` -> `cache`; `cli.main` -> `cli`)."""
    parts = module.split(".")
    if parts[0] == "cli":
        return "cli"
    if parts[0] == "dflash_cache" and len(parts) > 1:
        return parts[1]
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, those inside functions too; relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
    return found


def sources() -> list[Path]:
    files = sorted(LIB.rglob("*.py")) + sorted((ROOT / "cli").rglob("*.py"))
    # exports' remote code is copied into exports and never imported by the package
    return [p for p in files if not p.name.startswith("modeling_")]


def test_imports_point_down_the_tiers():
    rank = {name: i for i, row in enumerate(tiers()) for name in row}
    packages = {p.name for p in LIB.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"cli"}
    assert packages - {"demo_data"} <= set(rank), f"packages missing from the diagram: {packages - set(rank)}"
    wrong = []
    for path in sources():
        mine = package_of(module_name(path))
        if mine not in rank:
            continue
        for line, module in imported(path):
            theirs = package_of(module)
            if theirs is None or theirs == mine or theirs not in rank:
                continue
            if rank[theirs] <= rank[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {module} ({theirs})")
    assert not wrong, "imports that point up or across a tier:\n" + "\n".join(wrong)


def test_no_module_is_over_its_size():
    sizes = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sources() if p.is_relative_to(LIB)}
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p, n in sizes.items() if n > MAX_FILE_LINES]
    assert not long, f"modules over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_is_over_its_size():
    long = []
    for path in sources():
        if path.is_relative_to(KERNEL_DIR):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}, {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_kernel_module_global_is_assigned_from_outside():
    """A kernel's tiles are values its callers pass in: nothing outside kernels/ rebinds a kernel
    module's names (`loss_kernel.BLOCK = ...`); a test's monkeypatch, undone after it, aside."""
    files = sources() + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    wrong = []
    for path in files:
        if path.is_relative_to(KERNEL_DIR):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dflash_cache.kernels":
                aliases |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.asname and a.name.startswith("dflash_cache.kernels.")}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []  # fmt: skip
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in aliases:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {t.value.id}.{t.attr} assigned")
    assert not wrong, "kernel module globals assigned from outside kernels/:\n" + "\n".join(wrong)
