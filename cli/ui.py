"""Terminal output: the progress bar sink and small printing helpers. No library logic here."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


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
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tok  {task.fields[rate]}  pad {task.fields[pad]}  {task.fields[written]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
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
