"""The wheel is the product a user installs: built from the checkout, it holds one top-level package
(dflash_cache, the command line inside it as dflash_cache.cli) and the demo's target and prefixes,
and `pip install` of it alone runs `dflash demo` from any directory.

The wheel is built from a copy of the checkout, so that a stale build/ left in the checkout cannot
add files to it. The virtual environment it goes into must not see the checkout: the commands run
from tmp_path with PYTHONPATH unset. It is made without the system site-packages and given a .pth
file naming those directories instead: their packages (torch, transformers, ...) import, but their
own .pth files do not run. `--system-site-packages` would run them, and the editable install of
another checkout there is such a .pth (a meta-path finder for `dflash_cache` and `cli`), which could
serve modules the wheel lacks. The test checks where `dflash_cache` imports from and that no
top-level `cli` is importable. pip installs with --ignore-installed: the dflash-cache that the
system site-packages records is neither consulted nor uninstalled."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow

DEMO_DATA = ["code_train.jsonl", "code_prompts.jsonl", *(f"code-target/{name}" for name in (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja"))]  # fmt: skip
# where the venv's demo comes from, where its target is, whether a top-level `cli` or the command line is loaded
WHERE = """import importlib.util, sys, dflash_cache.pipelines.demo as demo
from dflash_cache.pipelines.config import DemoConfig
print(demo.__file__, DemoConfig().target, importlib.util.find_spec("cli"), sep="\\n")
print(sorted(m for m in sys.modules if m.startswith("dflash_cache.cli")))"""
NOT_SOURCES = {".git", "build", "dist", ".whl", ".benchmarks", ".ruff_cache", ".pytest_cache", "demo", "runs"}


def _sources(dst: Path) -> Path:
    """The checkout without its history, build outputs and caches (links kept as links)."""

    def ignore(folder: str, names: list[str]) -> list[str]:
        top = Path(folder) == ROOT
        return [n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (top and n in NOT_SOURCES)]

    shutil.copytree(ROOT, dst, symlinks=True, ignore=ignore)
    return dst


def _build_wheel(tmp: Path) -> Path:
    """With this environment's setuptools, offline; where it has none (a Python 3.12 venv), pip fetches
    it as `pip install .` does."""
    src = _sources(tmp / "src")
    offline = ["--no-build-isolation", "--no-index"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", str(tmp / "dist"),
                    str(src)], check=True)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("dflash_cache-*.whl")
    return wheel


def _venv(where: Path) -> tuple[Path, dict[str, str]]:
    """A virtual environment that imports the packages of this interpreter's site-packages (pip
    included) but runs none of their .pth files; its python and the environment its commands run
    with (no PYTHONPATH)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    system = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (Path(purelib) / "system-site-packages.pth").write_text("".join(f"{p}\n" for p in system))
    return python, env


def test_the_installed_wheel_runs_the_demo_from_anywhere(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    shipped = {n for n in names if not n.startswith(f"{dist_info}/")}
    sources = {f"dflash_cache/{p.relative_to(ROOT / 'dflash_cache').as_posix()}"
               for p in (ROOT / "dflash_cache").rglob("*.py") if "__pycache__" not in p.parts}  # fmt: skip
    cli = {f"dflash_cache/cli/{p.name}" for p in (ROOT / "cli").glob("*.py")}
    demo = {f"dflash_cache/demo_data/{name}" for name in DEMO_DATA}
    # one top-level package: the library, the command line inside it, the demo's files, nothing else
    assert shipped == sources | cli | demo, sorted(shipped ^ (sources | cli | demo))
    assert (ROOT / "cli" / "main.py").is_file() and "dflash_cache/cli/main.py" in shipped
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "dflash = dflash_cache.cli.main:main" in entry_points
    # the files themselves, not links
    model = "dflash_cache/demo_data/code-target/model.safetensors"
    assert zipfile.ZipFile(wheel).read(model) == (ROOT / "data" / "code-target" / "model.safetensors").read_bytes()

    python, env = _venv(tmp_path / "venv")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                    str(wheel)], env=env, cwd=tmp_path, check=True)  # fmt: skip
    where = subprocess.run([str(python), "-c", WHERE], env=env, cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.splitlines()  # fmt: skip
    venv = (tmp_path / "venv").resolve()
    assert Path(where[0]).resolve().is_relative_to(venv), where
    assert Path(where[1]).is_relative_to(venv) and (Path(where[1]) / "model.safetensors").is_file(), where
    assert where[2:4] == ["None", "[]"], where  # no top-level cli; the library imports no command line

    dflash = tmp_path / "venv" / "bin" / "dflash"
    helped = subprocess.run([str(dflash), "demo", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert helped.returncode == 0 and "--eval-prompts" in helped.stdout, helped.stdout + helped.stderr
    # the smallest real run the command offers: 48 of its rows, one epoch, one held-out prompt
    ran = subprocess.run([str(dflash), "demo", "--out", "out", "--rows", "48", "--epochs", "1", "--eval-prompts", "1"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    table = ran.stdout.splitlines()
    assert any(line.split()[:2] == ["drafter", "tau"] for line in table), ran.stdout[-3000:]
    assert {line.split()[0] for line in table if line.split()[:1] in (["untrained"], ["trained"])} == {
        "untrained", "trained"}, ran.stdout[-3000:]  # fmt: skip
    assert (tmp_path / "out" / "run" / "export" / "model.safetensors").is_file()
    assert len((tmp_path / "out" / "regen.jsonl").read_text().splitlines()) == 48  # --rows: the first 48 answered
