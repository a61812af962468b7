"""Terminal output: the progress bar sink and small printing helpers. No library logic here."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(stderr=True, soft_wrap=True)  # an error stays one line when piped


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class ExtractBar:
    """tokens/s, padding, bytes written and ETA for `dflash extract`."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]extract"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("tok {task.fields[rate]} pad {task.fields[pad]} {task.fields[written]} eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = None

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("extract", total=total, completed=done, rate="-", pad="-", written="0 B")

    def update(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        task = self.progress.tasks[0]
        padded = totals.get("padded", 0)
        pad = f"{100 * (1 - totals.get('tokens', 0) / padded):.1f}%" if padded else "-"
        rate = f"{task.speed:,.0f}/s" if task.speed else "-"
        self.progress.update(
            self.task,
            advance=delta.get("tokens", 0),
            rate=rate,
            pad=pad,
            written=human_bytes(totals.get("bytes", 0)),
        )

    def close(self) -> None:
        self.progress.stop()


class TrainBar:
    """Steps, loss, implied acceptance length, tokens/s and loader wait for `dflash train`."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]} accept {task.fields[accept]} {task.fields[rate]} "
                       "wait {task.fields[wait]} eta"),  # fmt: skip
            TimeRemainingColumn(),
            console=console,
        )
        self.task = None

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("train", total=None, loss="-", accept="-", rate="-", wait="-")

    def update(self, totals: dict[str, Any], delta: dict[str, Any]) -> None:
        if "warning" in delta:
            self.progress.console.print(f"[yellow]warning:[/yellow] {delta['warning']}")
        bar = delta.get("bar")
        if not bar:
            return
        fields = {}
        if "loss" in bar:
            fields = {"loss": f"{bar['loss']:.3f}", "accept": f"{bar['accept']:.2f}",
                      "rate": f"{bar['tok_s']:,.0f} tok/s", "wait": f"{bar['wait']:.2f}s"}  # fmt: skip
        self.progress.update(self.task, total=bar.get("total", self.progress.tasks[0].total),
                             completed=bar.get("completed"), **fields)  # fmt: skip

    def close(self) -> None:
        self.progress.stop()
