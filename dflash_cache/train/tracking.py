"""Experiment tracking: every record of `metrics.jsonl` also goes to TensorBoard and/or wandb.

`--report-to tensorboard,wandb` (or `none`, the default). The trackers see exactly the records the
run writes to metrics.jsonl, so the two never disagree: training lines (loss, lr, accuracy per
slot, implied acceptance length, tokens/s, useful TFLOP/s per GPU, MFU, loader wait), epoch ends,
and validation lines (`val_*`). `scalars` names them for the dashboards: `train/*`, `perf/*`,
`val/*` and `epoch/*`; a list such as `slot_acc` becomes one scalar per block slot
(`train/slot_acc/01` is slot 1).

Only rank 0 tracks (`open_trackers` returns an empty `Trackers` elsewhere): the records are already
summed over the ranks. TensorBoard writes `RUN/tensorboard/`; a resumed run purges the events
past its checkpoint, as metrics.jsonl drops its lines, so a curve never shows a step twice. wandb
is used only when it is installed, and runs offline (`WANDB_MODE=offline`) unless the user set
WANDB_MODE: a training node often has no route out, and `wandb sync RUN/wandb/offline-run-*`
uploads later. Its run id is kept in the run directory, so a resumed run continues the same
wandb run.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from dflash_cache.core.errors import UserError

BACKENDS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_ID = "wandb_id"  # the run directory's wandb run id, so a resume continues the same run
PERF_KEYS = ("tokens_per_s", "tflops_per_gpu", "mfu", "loader_wait_s")
NOT_SCALARS = ("step", "time", "epoch_end")  # the x axis, the wall time, and the epoch-end marker


class TrackingError(UserError, ValueError):
    """A --report-to value that cannot be used; the message says what to install or change."""


class Tracker(Protocol):
    def log(self, record: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def parse_report_to(value: str | Iterable[str] | None) -> list[str]:
    """`tensorboard`, `wandb`, `tensorboard,wandb`, a list of them, or `none`/empty: the backends,
    in order and without repeats. Unknown names are refused, naming the ones there are."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    names = [n.strip().lower() for n in items if n.strip()]
    if "none" in names:
        if len(names) > 1:
            raise TrackingError(f"--report-to {','.join(names)}: 'none' cannot be combined with a backend")
        return []
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise TrackingError(f"--report-to: unknown {', '.join(bad)}; expected {', '.join(BACKENDS)} or none")
    return list(dict.fromkeys(names))


def check_available(backends: Iterable[str]) -> None:
    """Refuse, before the run starts, a backend whose package is not installed."""
    for name, module, extra in (("tensorboard", "tensorboard", "track"), ("wandb", "wandb", None)):
        if name in backends and not _importable(module):
            how = f"pip install 'dflash-cache[{extra}]'" if extra else f"pip install {module}"
            raise TrackingError(f"--report-to {name} needs the {module} package: {how}")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as dashboard scalars: `val_x` -> `val/x`, throughput and loader wait
    -> `perf/x`, an epoch-end line's counts -> `epoch/x`, the rest -> `train/x`; lists become one
    scalar per block slot (`x/01` is slot 1). Non-numbers and non-finite values are left out."""
    out: dict[str, float] = {}
    epoch_end = "epoch_end" in record
    for key, value in record.items():
        if key in NOT_SCALARS:
            continue
        if key.startswith("val_"):
            tag = f"val/{key[4:]}"
        elif epoch_end:
            tag = f"epoch/{key}"
        elif key in PERF_KEYS:
            tag = f"perf/{key}"
        else:
            tag = f"train/{key}"
        if isinstance(value, list | tuple):
            for k, v in enumerate(value, start=1):
                _put(out, f"{tag}/{k:02d}", v)
        else:
            _put(out, tag, value)
    return out


def _put(out: dict[str, float], tag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if math.isfinite(value):
        out[tag] = float(value)


class TensorBoardTracker:
    """Scalars into `RUN/tensorboard/` (torch.utils.tensorboard), at the record's step and wall time.

    `resume_step`: the checkpoint step a resumed run continues from; events past it (written by
    the run that was killed) are purged, as metrics.jsonl drops its lines past it. A fresh run
    purges everything an earlier attempt in the same directory left."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(str(self.log_dir), purge_step=0 if resume_step is None else resume_step + 1,
                                    flush_secs=30)  # fmt: skip

    def log(self, record: Mapping[str, Any]) -> None:
        step, walltime = int(record.get("step", 0)), record.get("time")
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Scalars to a wandb run (offline unless WANDB_MODE says otherwise), files under `RUN/wandb/`.

    The project is WANDB_PROJECT, else `dflash-cache`; the run's name is the run directory's name,
    and its config is the training settings."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash-cache"), name=run_dir.name,
                              id=run_id, resume="allow", dir=str(run_dir),
                              config={k: str(v) if isinstance(v, Path) else v for k, v in config.items()})  # fmt: skip

    def log(self, record: Mapping[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The run's trackers as one: `log` sends a record to each, `close` ends them. Empty on ranks
    other than 0, and for `--report-to none`."""

    def __init__(self, trackers: Iterable[Tracker] = ()):
        self.trackers = list(trackers)

    def log(self, record: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.log(record)

    def close(self) -> None:
        for t in self.trackers:
            t.close()

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(report_to: str | Iterable[str] | None, run_dir: Path, *, rank: int = 0,
                  resume_step: int | None = None, config: Mapping[str, Any] | None = None) -> Trackers:  # fmt: skip
    """The trackers `report_to` asks for (see `parse_report_to`), on rank 0; none elsewhere."""
    backends = parse_report_to(report_to)
    if rank != 0 or not backends:
        return Trackers()
    check_available(backends)
    made: list[Tracker] = []
    if "tensorboard" in backends:
        made.append(TensorBoardTracker(run_dir, resume_step))
    if "wandb" in backends:
        made.append(WandbTracker(run_dir, config or {}))
    return Trackers(made)
