"""Experiment tracking: real TensorBoard event files, read back with TensorBoard's own reader."""

from __future__ import annotations

import os

import pytest

from dflash_cache.train.tracking import TrackingError, open_trackers, parse_report_to, scalars

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _record(step: int, loss: float) -> dict:
    """A training line as metrics.jsonl has it."""
    return {"step": step, "epoch": 0, "loss": loss, "lr": 1e-3 * step, "slot_acc": [0.5, 0.25, 0.125],
            "accept_len": 1.4, "tokens_per_s": 1000.0 + step, "tflops_per_gpu": 0.5, "loader_wait_s": 0.01,
            "mfu": 0.3, "tokens": 100 * step, "time": 1_700_000_000.0 + step}  # fmt: skip


def _read(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_name_every_metrics_field():
    s = scalars(_record(3, 2.5))
    assert s["train/loss"] == 2.5 and s["train/accept_len"] == 1.4 and s["train/lr"] == pytest.approx(3e-3)
    assert [s[f"train/slot_acc/{k:02d}"] for k in (1, 2, 3)] == [0.5, 0.25, 0.125]
    assert s["perf/tokens_per_s"] == 1003.0 and s["perf/mfu"] == 0.3 and s["perf/loader_wait_s"] == 0.01
    assert "train/step" not in s and "train/time" not in s
    val = scalars({"step": 4, "val_loss": 3.0, "val_accept_len": 1.2, "val_slot_acc": [0.4], "val_partial": False})
    assert val == {"val/loss": 3.0, "val/accept_len": 1.2, "val/slot_acc/01": 0.4}  # booleans are not scalars
    assert scalars({"epoch_end": 0, "step": 9, "samples": 400, "tokens": 900, "time": 1.0}) == {
        "epoch/samples": 400.0, "epoch/tokens": 900.0}
    assert scalars({"step": 1, "loss": float("nan")}) == {}


def test_report_to_parsing_and_refusals():
    assert parse_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert parse_report_to("none") == parse_report_to("") == parse_report_to(None) == []
    with pytest.raises(TrackingError, match="unknown mlflow"):
        parse_report_to("mlflow")
    with pytest.raises(TrackingError, match="cannot be combined"):
        parse_report_to("none,tensorboard")


def test_wandb_is_refused_when_not_installed(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(TrackingError, match="needs the wandb package"):
        open_trackers("wandb", tmp_path)


def test_tensorboard_event_file_reads_back_and_resume_purges(tmp_path):
    """A real event file holds every record's scalars at its step; a resume from step 3 hides the
    killed run's steps past 3, as metrics.jsonl drops its lines past the checkpoint."""
    with open_trackers("tensorboard", tmp_path) as t:
        for step in range(1, 6):
            t.log(_record(step, loss=10.0 - step))
        t.log({"step": 4, "val_loss": 7.5, "val_accept_len": 1.25, "val_slot_acc": [0.3, 0.1], "time": 1.0})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    got = _read(tmp_path / "tensorboard")
    assert got["train/loss"] == [(s, 10.0 - s) for s in range(1, 6)]
    assert got["train/slot_acc/02"] == [(s, 0.25) for s in range(1, 6)]
    assert got["perf/tokens_per_s"] == [(s, 1000.0 + s) for s in range(1, 6)]
    assert got["val/accept_len"] == [(4, 1.25)] and got["val/slot_acc/01"] == [(4, pytest.approx(0.3))]

    with open_trackers("tensorboard", tmp_path, resume_step=3) as t:  # killed after step 5, resumed from 3
        t.log(_record(4, loss=42.0))
    got = _read(tmp_path / "tensorboard")
    assert got["train/loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 42.0)]
    assert "val/accept_len" not in got or got["val/accept_len"] == []

    with open_trackers("tensorboard", tmp_path) as t:  # a fresh run in the same directory starts clean
        t.log(_record(1, loss=1.0))
    assert _read(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0)]


def test_other_ranks_and_none_track_nothing(tmp_path):
    for trackers in (open_trackers("tensorboard", tmp_path, rank=1), open_trackers("none", tmp_path)):
        trackers.log(_record(1, 1.0))
        trackers.close()
        assert trackers.trackers == []
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_runs_offline_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    """Only where wandb is installed (it is not a dependency, not even of the tests)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "unset")  # recorded, so the test leaves the environment as it found it
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for attempt in range(2):
        with open_trackers("wandb", tmp_path, config={"cache": tmp_path, "lr": 1e-3}) as t:
            t.log(_record(attempt + 1, loss=1.0))
        if attempt == 0:
            run_id = (tmp_path / "wandb_id").read_text().strip()
    assert (tmp_path / "wandb_id").read_text().strip() == run_id  # the resume continued the same run
    assert os.environ["WANDB_MODE"] == "offline"
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(runs) == 2 and all(r.stat().st_size > 0 for r in runs)  # offline: nothing left the machine
