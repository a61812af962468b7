"""How the `dflash` command reports what went wrong: a user error or a worker process's as one
`error:` line and exit 1, Ctrl-C as one line that says how to resume and exit 130, a warning about
the user's input as one `warning:` line. Anything else is a bug, and Python's traceback shows it."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from functools import wraps
from typing import Any

import typer
from rich.markup import escape

from dflash_cache.core.errors import UserError
from dflash_cache.core.interrupts import ignore_from_now

from .ui import console

_own_process = False
EXIT_GRACE_S = 20.0  # after a Ctrl-C, what exit hooks may take before the process ends anyway


def in_own_process() -> None:
    """The app runs in a process of its own (`main.main`), not called in-process by tests, whose
    caller keeps its Ctrl-C: a Ctrl-C after a command's work is done is then ignored."""
    global _own_process
    _own_process = True


def _worker_error(e: BaseException) -> bool:
    """A worker process's exception re-raised by torch.multiprocessing, or its death by a signal
    (checked without importing torch: a command that never started workers has none)."""
    mp = sys.modules.get("torch.multiprocessing")
    return mp is not None and isinstance(e, (mp.ProcessRaisedException, mp.ProcessExitedException))


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print user errors as one line and exit 1; a worker process's error likewise; Ctrl-C as one
    line that says how to resume, exit 130. Once the command has returned, its work is done and
    reported: a Ctrl-C while the process exits is ignored."""

    @wraps(fn)
    def run(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            if _own_process:
                ignore_from_now()
            return result
        except (UserError, FileNotFoundError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted:[/yellow] what was committed is kept; rerun the same command to resume")
            if _own_process:
                ignore_from_now()
                _exit_within(EXIT_GRACE_S, 130)
            raise typer.Exit(130) from None
        except Exception as e:
            if not _worker_error(e):
                raise
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
            console.print("[red]error in a worker process:[/red]", escape(last))  # torch's lines hold [file:line]
            raise typer.Exit(1) from None

    return run


def _exit_within(seconds: float, code: int) -> None:
    """End the process with `code` if exiting takes longer than `seconds`. After a Ctrl-C nothing is
    left to finish (units and checkpoints are committed atomically, helper processes die with this
    one), but an exit hook can wait forever on what the interrupt left half-stopped: a queue's
    feeder thread, a lock. The user, who was told the run is over, must never see it hang."""

    def end() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


def show_data_warnings() -> None:
    """A warning about the user's input (a JSON file cut short) as one `warning:` line, like the
    stages' own, instead of Python's file-and-line form; every other warning as Python shows it."""
    import warnings

    from dflash_cache.rows.chat import DataWarning

    shown = warnings.showwarning
    if getattr(shown, "dflash", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DataWarning):
            console.print(f"[yellow]warning:[/yellow] {message}")
        else:
            shown(message, category, filename, lineno, file, line)

    show.dflash = True
    warnings.showwarning = show
