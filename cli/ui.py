"""Terminal output: the progress bar sink and small printing helpers. No library logic here."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# An error stays one line when piped, and a bar written to a log file is not cut at 80 columns.
console = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 200)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}"


def say(delta: dict[str, Any], out: Console = console) -> None:
    """A stage's warning or note (e.g. where a run resumed), as one line above the bar."""
    if "warning" in delta:
        out.print(f"[yellow]warning:[/yellow] {delta['warning']}")
    if "info" in delta:
        out.print(delta["info"])


class Quiet:
    """The sink of a --json run: no bar, but warnings and notes still reach stderr."""

    def start(self, total: int, done: int) -> None:
        pass

    def update(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        say(delta)

    def close(self) -> None:
        pass


LOG_EVERY_S = float(os.environ.get("DFLASH_LOG_EVERY_S", 30))  # a bar's line in a log, every so many seconds


class _Bar:
    """A rich progress bar. On a terminal it redraws in place; rich writes nothing of it to a log
    (stderr a file or a pipe) until it stops, so there it writes its line every LOG_EVERY_S
    seconds, from its first update on: a run under nohup or CI shows how far it got."""

    progress: Progress
    _logged = float("-inf")

    def update(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        """The stage's notes and warnings above the bar (as --json's quiet sink says them), then the
        bar moved by `show`."""
        say(delta, self.progress.console)
        self.show(totals, delta)

    def show(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        raise NotImplementedError

    def _log(self) -> None:
        if self.progress.console.is_terminal:
            return
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            self.progress.console.print(self.progress.get_renderable())


class ExtractBar(_Bar):
    """tokens/s, padding, units committed/planned, bytes written and ETA for `dflash extract`."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]extract"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("tok {task.fields[rate]} pad {task.fields[pad]} units {task.fields[units]} "
                       "{task.fields[written]} eta"),  # fmt: skip
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = None

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("extract", total=total, completed=done, rate="-", pad="-", units="-",
                                           written="0 B")  # fmt: skip

    def show(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        task = self.progress.tasks[0]
        padded = totals.get("padded", 0)
        pad = f"{100 * (1 - totals.get('tokens', 0) / padded):.1f}%" if padded else "-"
        rate = f"{task.speed:,.0f}/s" if task.speed else "-"
        units = f"{totals.get('units_done', 0) + totals.get('units', 0)}/{totals.get('units_planned', '?')}"
        self.progress.update(
            self.task,
            advance=delta.get("tokens", 0),
            rate=rate,
            pad=pad,
            units=units,
            written=human_bytes(totals.get("bytes", 0)),
        )
        self._log()

    def close(self) -> None:
        self.progress.stop()


class TrainBar(_Bar):
    """Epoch and step, context tokens trained (what the schedule counts), loss, implied acceptance
    length, tokens/s, useful TFLOP/s and MFU (on GPUs of known peak) and loader wait for `dflash
    train`; while it follows an extraction, also units committed/planned, units read and the time
    spent waiting for data."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=12),
            TextColumn("{task.fields[where]}{task.fields[tokens]} loss {task.fields[loss]} "
                       "accept {task.fields[accept]} {task.fields[rate]}{task.fields[mfu]} "
                       "wait {task.fields[wait]}{task.fields[follow]} eta"),  # fmt: skip
            TimeRemainingColumn(),
            console=console,
        )
        self.task = None
        self.shown = False

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("train", total=None, where="", tokens="-", loss="-", accept="-", rate="-",
                                           mfu="", wait="-", follow="")  # fmt: skip

    def show(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        if "follow" in delta:
            f = delta["follow"]
            idle = "" if f["extract_running"] or f["committed"] >= f["planned"] else ", no extract running"
            self.progress.update(self.task, follow=f" | units {f['committed']}/{f['planned']} committed, "
                                                  f"{f['read']} read, waited {f['wait_s']:.1f}s{idle}")  # fmt: skip
        bar = delta.get("bar")
        if not bar:
            return
        task = self.progress.tasks[0]
        total = bar.get("total", task.total)
        fields = {"tokens": f"{_count(bar.get('completed', 0))}/{_count(total or 0)} tok"}
        if "loss" in bar:
            mfu = f" {bar['tflops']:.3g} TFLOP/s" + (f" MFU {100 * bar['mfu']:.0f}%" if bar.get("mfu") else "")
            fields |= {"where": f"epoch {bar['epoch'] + 1} step {bar['step']} ", "loss": f"{bar['loss']:.3f}",
                       "accept": f"{bar['accept']:.2f}", "rate": f"{bar['tok_s']:,.0f} tok/s", "mfu": mfu,
                       "wait": f"{bar['wait']:.2f}s"}  # fmt: skip
        self.progress.update(self.task, total=total, completed=bar.get("completed"), **fields)
        self.shown = True
        self._log()

    def close(self) -> None:
        if not self.shown:  # a run refused before its first batch leaves no empty bar above the error
            self.progress.live.transient = True
        self.progress.stop()


class RegenBar(_Bar):
    """Rows regenerated/total, generated tokens/s and ETA for `dflash regen` (rows count when their
    part is committed)."""

    def __init__(self) -> None:
        self.progress = Progress(TextColumn("[bold]regen"), BarColumn(bar_width=12), MofNCompleteColumn(),
                                 TextColumn("rows {task.fields[rate]} eta"), TimeRemainingColumn(),
                                 console=console)  # fmt: skip
        self.task = None
        self.started = 0.0

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.started = time.perf_counter()
        self.task = self.progress.add_task("regen", total=total, completed=done, rate="-")

    def show(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        rate = totals.get("tokens", 0) / max(time.perf_counter() - self.started, 1e-9)
        self.progress.update(self.task, advance=delta.get("rows", 0), rate=f"{rate:,.0f} tok/s")
        self._log()

    def close(self) -> None:
        self.progress.stop()


class EvalBar(_Bar):
    """Decodes done/total, the running tau per prompt and ETA for `dflash eval` (each prompt is
    decoded twice: speculatively, then by the target alone)."""

    def __init__(self, label: str = "eval") -> None:
        self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=12), MofNCompleteColumn(),
                                 TextColumn("decodes tau {task.fields[tau]} eta"), TimeRemainingColumn(),
                                 console=console)  # fmt: skip
        self.task = None

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("eval", total=total, completed=done, tau="-")

    def show(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        self.progress.update(self.task, advance=delta.get("prompts", 0), tau=f"{totals.get('tau', 0):.3f}")
        self._log()

    def close(self) -> None:
        self.progress.stop()
