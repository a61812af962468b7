"""`dflash report` and eval's histogram PNG: real PNG files, opened and checked."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from dflash_cache.pipelines.report import ReportError, plot_histogram, report

pytest.importorskip("matplotlib")


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and its IHDR chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:29]
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(kind + body)
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", body[:8])


def _metrics(run, *, val: bool, mfu: bool = True) -> list[dict]:
    lines = []
    for step in range(1, 21):
        rec = {"step": step, "epoch": step // 11, "loss": 6.0 - 0.1 * step, "lr": 1e-3,
               "slot_acc": [0.02 * step, 0.01 * step, 0.005 * step], "accept_len": 1.0 + 0.02 * step,
               "tokens_per_s": 5000.0, "tflops_per_gpu": 2.0, "loader_wait_s": 0.5, "tokens": 1000 * step,
               "time": 1000.0 + 10 * step}  # fmt: skip
        if mfu:
            rec["mfu"] = 0.25
        lines.append(rec)
        if val and step % 5 == 0:
            acc = 1.5 - abs(step - 10) * 0.01  # peaks at step 10
            lines.append({"step": step, "val_loss": 5.0, "val_accept_len": acc, "val_slot_acc": [0.4, 0.2, 0.1],
                          "val_blocks": 100, "time": 1000.0 + 10 * step})  # fmt: skip
        if step == 10:
            lines.append({"epoch_end": 0, "step": 10, "samples": 400, "tokens": 10000, "time": 1100.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 21, "lo')
    return lines


def test_report_writes_pngs_and_summary(tmp_path):
    from matplotlib.image import imread

    _metrics(tmp_path, val=True)
    r = report(tmp_path)
    assert set(r["plots"]) == {"loss", "accept", "slot_acc", "throughput", "loader_wait"}
    for name, path in r["plots"].items():
        w, h = png_size(tmp_path / "report" / f"{name}.png")
        assert w == 750 and h >= 320, (name, w, h)
        pixels = imread(path)
        assert pixels.shape[:2] == (h, w) and pixels.std() > 0.01  # something is drawn
    assert png_size(tmp_path / "report" / "throughput.png")[1] == 960  # three panels: tok/s, TFLOP/s, MFU
    assert r["steps"] == 20 and r["epochs_done"] == 1 and r["tokens"] == 20000
    assert r["best_val"] == {"step": 10, "accept_len": 1.5, "loss": 5.0}  # the torn last line is skipped
    assert r["loader_wait_s"] == pytest.approx(20 * 0.5) and r["wall_s"] == pytest.approx(190)
    assert r["loader_wait_share"] == pytest.approx(10 / 190)
    md = (tmp_path / "report.md").read_text()
    assert "| best validation acceptance | 1.500 (step 10; export/) |" in md
    assert "MFU 25.0%" in md and "![accept](report/accept.png)" in md


def test_report_without_validation_or_mfu(tmp_path):
    _metrics(tmp_path, val=False, mfu=False)
    r = report(tmp_path)
    assert "best_val" not in r and "mean_mfu" not in r
    assert png_size(tmp_path / "report" / "throughput.png")[1] == 640  # no MFU panel on a CPU run


def test_report_refuses_a_directory_without_metrics(tmp_path):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        report(tmp_path)


def test_report_skips_damaged_bytes_in_the_metrics(tmp_path):
    """Bytes that are not text (a disk error) are dropped as a torn line is, not a UnicodeDecodeError."""
    lines = [json.dumps(m) for m in _metrics(tmp_path, val=False)]
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00garbage\n" + "\n".join(lines).encode() + b"\n")
    report(tmp_path)
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00" * 100)
    with pytest.raises(ReportError, match="no step"):
        report(tmp_path)


def test_histogram_png(tmp_path):
    path = plot_histogram([5, 3, 0, 2], tmp_path / "sub" / "hist.png", title="tau 2.1")
    assert png_size(path) == (750, 320)


def test_cli_report_and_eval_histogram_png(tmp_path):
    from helpers import TINY_TARGET
    from test_evaluate import PROMPTS, export_random_drafter
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    (tmp_path / "run").mkdir()
    _metrics(tmp_path / "run", val=True)
    res = runner.invoke(app, ["report", str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["best_val"]["step"] == 10 and (tmp_path / "run" / "report.md").is_file()
    assert all(png_size(tmp_path / "run" / "report" / f"{name}.png")[0] == 750 for name in out["plots"])
    res = runner.invoke(app, ["report", str(tmp_path / "nothing")])
    assert res.exit_code == 1 and res.output.startswith("error: RUN") and "does not exist" in res.output

    drafter = export_random_drafter(tmp_path / "export", 8)
    png = tmp_path / "hist.png"
    res = runner.invoke(app, ["eval", "--target", str(TINY_TARGET), "--drafter", str(drafter), "--data", str(PROMPTS),
                              "--limit", "1", "--max-new-tokens", "8", "--histogram-png", str(png), "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    assert len(result["histogram"]) == 8 and sum(result["histogram"]) == result["steps"] > 0
    assert png_size(png) == (750, 320)
