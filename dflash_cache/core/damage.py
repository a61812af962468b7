"""Reading the files a command depends on, with damage as one line that names the file.

A drafter export, a training checkpoint, a cache's frozen weights, a run's or a cache's JSON record,
a GGUF: each may be cut short (a copy or download that stopped, a full disk), overwritten by
something else, or not the kind of file it should be. The libraries that read them fail with their
own words and a traceback (safetensors' header errors, torch's "PytorchStreamReader failed reading
zip archive", numpy's buffer sizes). Every such read goes through here instead, so that damage ends
in a `DamagedFile` (a `UserError`: one `error:` line, exit 1) that says which file, what is wrong
with it and what to do, and the libraries' failures are told apart from bugs in one place.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cache.core.errors import UserError
from dflash_cache.core.jsonl import iter_lines

if TYPE_CHECKING:
    import torch


class DamagedFile(UserError, ValueError):
    """A file a command reads is truncated, corrupt or of the wrong kind; the message names it,
    `problem` is the reader's reason alone."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem or message


def reason(e: BaseException) -> str:
    """The library's own reason, on one line and short (their messages run to several lines)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    if len(text) > 160 and ". " in text:  # the first sentence: torch appends advice for its own developers
        text = text[: text.index(". ")]
    return text if len(text) <= 200 else text[:197] + "..."


def damaged(path: str | Path, kind: str, problem: str, fix: str) -> DamagedFile:
    """The error for `path`, which should be a `kind` and is not: `problem` says why, `fix` what to do."""
    return DamagedFile(f"{path} is not a readable {kind} (truncated or corrupt? {problem}); {fix}", problem)


@contextmanager
def reading(path: str | Path, kind: str, fix: str, errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Turn what a reader raises on a damaged `path` (OSError, ValueError, and `errors`) into
    `DamagedFile`. A file that does not exist at all is not damage: its FileNotFoundError stays."""
    try:
        yield
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, *errors) as e:
        if isinstance(e, UserError):
            raise
        raise damaged(path, kind, reason(e), fix) from None


def load_safetensors(path: str | Path, fix: str, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or `DamagedFile` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with reading(path, "safetensors file", fix, (SafetensorError,)):
        return load_file(str(path), device=device)


def torch_load(path: str | Path, fix: str, **kwargs: Any) -> Any:
    """`torch.load(path, **kwargs)`, or `DamagedFile` naming the file (a truncated zip archive, a
    pickle cut short, a file of another kind)."""
    import torch

    with reading(path, "torch checkpoint", fix, (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile)):
        return torch.load(path, **kwargs)


def read_json(path: str | Path, fix: str) -> dict[str, Any]:
    """A JSON file that holds one object (every record this program writes), or `DamagedFile`
    naming the file."""
    with reading(path, "JSON file", fix):
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise damaged(path, "JSON file", f"it holds a JSON {type(value).__name__}, not an object", fix)
    return value


def read_jsonl(path: str | Path, fix: str) -> list[dict[str, Any]]:
    """A JSON Lines file whose every line is an object (a file this program wrote whole, so a bad
    line is damage, not a row to reject), or `DamagedFile` naming the file and the line."""
    rows = []
    with reading(path, "JSON Lines file", fix):
        for n, line in iter_lines(Path(path).read_text(encoding="utf-8")):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise damaged(path, "JSON Lines file", f"line {n}: {e}", fix) from None
            if not isinstance(row, dict):
                raise damaged(path, "JSON Lines file", f"line {n} is not a JSON object", fix)
            rows.append(row)
    return rows
