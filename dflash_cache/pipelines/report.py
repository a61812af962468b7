"""`dflash report RUN`: plots and a short summary of a training run, from its metrics.jsonl alone.

Writes `RUN/report/*.png` (loss, acceptance length with validation, accuracy per block slot,
throughput with TFLOP/s and MFU, loader wait) and `RUN/report.md`, which links them. `dflash eval
--histogram-png` draws its acceptance histogram with `plot_histogram`.

matplotlib draws through its Agg canvas on a `Figure` of its own (no pyplot), so a report never
needs a display, never changes the caller's backend, and is safe beside other threads. It is an
optional dependency (`pip install 'dflash-cache[report]'`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_cache.core.errors import UserError
from dflash_cache.core.jsonl import iter_lines

METRICS = "metrics.jsonl"
PLOTS = "report"
SUMMARY = "report.md"


class ReportError(UserError, ValueError):
    """A run directory without metrics to report, or no matplotlib; the message says which."""


def read_metrics(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """RUN/metrics.jsonl split into `steps` (training lines), `val` (validation lines) and `epochs`
    (epoch ends). A torn last line (a run killed mid-write) is skipped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise ReportError(f"{run_dir} has no {METRICS}: not a `dflash train` run directory, or no step logged yet")
    out: dict[str, list[dict[str, Any]]] = {"steps": [], "val": [], "epochs": []}
    for _, line in iter_lines(path.read_text(errors="replace")):  # damaged bytes: skipped as torn lines are
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if "epoch_end" in record:
            out["epochs"].append(record)
        elif "val_accept_len" in record:
            out["val"].append(record)
        elif "loss" in record:
            out["steps"].append(record)
    return out


def _figure(rows: int = 1, height: float = 3.2):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("plots need matplotlib: pip install 'dflash-cache[report]'") from None
    fig = Figure(figsize=(7.5, height * rows), layout="constrained")
    return fig, [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    return path


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: Path, out_dir: Path | None = None) -> dict[str, Path]:
    """Write the run's PNG plots (to RUN/report/ by default); returns them by name."""
    m = read_metrics(run_dir)
    steps, val = m["steps"], m["val"]
    if not steps and not val:
        raise ReportError(f"{Path(run_dir) / METRICS} holds no step yet")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / PLOTS
    made: dict[str, Path] = {}

    fig, (ax,) = _figure()
    ax.plot(*_series(steps, "loss"), label="train")
    if val:
        ax.plot(*_series(val, "val_loss"), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title="Loss (slot-decayed cross-entropy)")
    ax.legend()
    made["loss"] = _save(fig, out / "loss.png")

    fig, (ax,) = _figure()
    ax.plot(*_series(steps, "accept_len"), label="train")
    if val:
        best = max(val, key=lambda r: r["val_accept_len"])
        ax.plot(*_series(val, "val_accept_len"), "o-",
                label=f"validation (best {best['val_accept_len']:.3f}, step {best['step']})")  # fmt: skip
    ax.set(xlabel="step", ylabel="tokens per block", title="Implied acceptance length")
    ax.legend()
    made["accept"] = _save(fig, out / "accept.png")

    fig, (ax,) = _figure()
    curves = []
    if steps:
        curves += [(f"train, step {steps[0]['step']}", steps[0]["slot_acc"]),
                   (f"train, step {steps[-1]['step']}", steps[-1]["slot_acc"])]  # fmt: skip
    if val:
        curves.append((f"validation, step {val[-1]['step']}", val[-1]["val_slot_acc"]))
    for label, acc in curves:
        ax.plot(range(1, len(acc) + 1), acc, "o-", label=label)
    ax.set(xlabel="block slot", ylabel="accuracy", title="Accuracy per block slot", ylim=(0, 1))
    ax.legend()
    made["slot_acc"] = _save(fig, out / "slot_acc.png")

    if steps:
        mfu = _series(steps, "mfu")
        fig, axes = _figure(3 if mfu[0] else 2)
        axes[0].plot(*_series(steps, "tokens_per_s"))
        axes[0].set(ylabel="context tokens/s", title="Throughput (all ranks)")
        axes[1].plot(*_series(steps, "tflops_per_gpu"))
        axes[1].set(ylabel="useful TFLOP/s per GPU")
        if mfu[0]:
            axes[2].plot(mfu[0], [100 * x for x in mfu[1]])
            axes[2].set(ylabel="MFU %")
        axes[-1].set(xlabel="step")
        made["throughput"] = _save(fig, out / "throughput.png")

        fig, (ax,) = _figure()
        ax.plot(*_series(steps, "loader_wait_s"))
        ax.set(xlabel="step", ylabel="seconds per log window", title="Loader wait (the step waiting for data)")
        made["loader_wait"] = _save(fig, out / "loader_wait.png")
    return made


def plot_histogram(histogram: Sequence[int], path: Path, title: str = "Acceptance lengths") -> Path:
    """A bar chart of `dflash eval`'s histogram (histogram[i]: verification steps that committed
    i + 1 tokens), written to `path` as PNG."""
    fig, (ax,) = _figure()
    total = max(1, sum(histogram))
    ax.bar(range(1, len(histogram) + 1), [100 * c / total for c in histogram])
    ax.set(xlabel="tokens committed per verification step", ylabel="% of steps", title=title)
    ax.set_xticks(range(1, len(histogram) + 1))
    return _save(fig, Path(path))


def summary(run_dir: Path) -> dict[str, Any]:
    """The run's figures at a glance: its length, the last training line, the best validation,
    mean throughput and the share of wall time the loader made the step wait."""
    m = read_metrics(run_dir)
    steps, val, epochs = m["steps"], m["val"], m["epochs"]
    lines = steps + val + epochs
    out: dict[str, Any] = {"run": str(run_dir), "steps": max((r["step"] for r in lines), default=0),
                           "epochs_done": len(epochs), "tokens": max((r.get("tokens", 0) for r in lines), default=0)}
    times = [r["time"] for r in lines if "time" in r]
    if len(times) > 1:
        out["wall_s"] = max(times) - min(times)
    if steps:
        last = steps[-1]
        out["last"] = {k: last[k] for k in ("step", "loss", "accept_len") if k in last}
        for key in ("tokens_per_s", "tflops_per_gpu", "mfu"):
            values = [r[key] for r in steps if isinstance(r.get(key), int | float)]
            if values:
                out[f"mean_{key}"] = sum(values) / len(values)
        wait = sum(r.get("loader_wait_s", 0.0) for r in steps)
        out["loader_wait_s"] = wait
        if out.get("wall_s"):
            out["loader_wait_share"] = wait / out["wall_s"]
    if val:
        best = max(val, key=lambda r: r["val_accept_len"])
        out["best_val"] = {"step": best["step"], "accept_len": best["val_accept_len"], "loss": best.get("val_loss")}
        out["last_val"] = {"step": val[-1]["step"], "accept_len": val[-1]["val_accept_len"],
                           "loss": val[-1].get("val_loss")}  # fmt: skip
    return out


def _markdown(s: dict[str, Any], plots: dict[str, Path], base: Path) -> str:
    rows = [("steps", f"{s['steps']:,}"), ("epochs finished", s["epochs_done"]), ("tokens trained", f"{s['tokens']:,}")]
    if "wall_s" in s:
        rows.append(("wall time", f"{s['wall_s'] / 60:.1f} min"))
    if "last" in s:
        rows.append(("last loss / acceptance", f"{s['last']['loss']:.4f} / {s['last']['accept_len']:.3f} "
                     f"(step {s['last']['step']})"))  # fmt: skip
    if "best_val" in s:
        b, lv = s["best_val"], s["last_val"]
        rows.append(("best validation acceptance", f"{b['accept_len']:.3f} (step {b['step']}; export/)"))
        rows.append(("last validation acceptance", f"{lv['accept_len']:.3f} (step {lv['step']})"))
    if "mean_tokens_per_s" in s:
        rows.append(("mean throughput", f"{s['mean_tokens_per_s']:,.0f} tokens/s"))
    if "mean_tflops_per_gpu" in s:
        mfu = f", MFU {100 * s['mean_mfu']:.1f}%" if "mean_mfu" in s else ""
        rows.append(("useful TFLOP/s per GPU", f"{s['mean_tflops_per_gpu']:.3g}{mfu}"))
    if "loader_wait_s" in s:
        share = f" ({100 * s['loader_wait_share']:.1f}% of wall time)" if "loader_wait_share" in s else ""
        rows.append(("loader wait", f"{s['loader_wait_s']:.1f} s{share}"))
    text = [f"# Training report: {Path(s['run']).name}", "", "| | |", "| --- | --- |"]
    text += [f"| {k} | {v} |" for k, v in rows]
    text.append("")
    for name, path in plots.items():
        text += [f"![{name}]({path.relative_to(base).as_posix()})", ""]
    return "\n".join(text)


def report(run_dir: Path) -> dict[str, Any]:
    """Plots into RUN/report/ and the summary into RUN/report.md; returns the summary and paths."""
    run_dir = Path(run_dir)
    plots = plot_run(run_dir)
    s = summary(run_dir)
    md = run_dir / SUMMARY
    md.write_text(_markdown(s, plots, run_dir))
    return {**s, "report": str(md), "plots": {k: str(v) for k, v in plots.items()}}
