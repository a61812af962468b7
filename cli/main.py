"""The `dflash` command: parse arguments, call the library, print. Nothing else lives here."""

from __future__ import annotations

import json
import sys
from functools import wraps
from pathlib import Path

import typer

from cli.ui import ExtractBar, console, human_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Decoupled hidden-state cache for DFlash drafters.")


def _user_errors():
    from dflash_cache.data import DataError

    from dflash_cache.devices import DeviceError
    from dflash_cache.extract import ExtractError
    from dflash_cache.spec import SpecError
    from dflash_cache.store import CorruptUnit
    from dflash_cache.target import TargetError

    return (DataError, DeviceError, ExtractError, SpecError, CorruptUnit, TargetError, FileNotFoundError)


def friendly(fn):
    """Print user errors as one line and exit 1; a worker process's error likewise."""

    @wraps(fn)
    def run(*args, **kwargs):
        from torch.multiprocessing import ProcessRaisedException

        try:
            return fn(*args, **kwargs)
        except _user_errors() as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        except ProcessRaisedException as e:
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
            console.print(f"[red]error in a worker process:[/red] {last}")
            raise typer.Exit(1) from None

    return run


def _gpus(gpus: str | None) -> list[int] | None:
    from dflash_cache.devices import parse_gpus

    return parse_gpus(gpus) if gpus else None


def _layers(layers: str | None) -> list[int] | None:
    if not layers:
        return None
    try:
        return [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        console.print(f"[red]error:[/red] --layers {layers!r}: expected comma-separated layer ids like 1,9,17")
        raise typer.Exit(1) from None


@app.command()
@friendly
def extract(
    target: str = typer.Option(..., help="Target model: local directory or a hub id in the local cache."),
    data: Path = typer.Option(..., help="JSONL / JSON / Parquet file, or a saved `datasets` directory."),
    out: Path = typer.Option(..., help="Cache directory (created, or resumed if it exists)."),
    layers: str | None = typer.Option(None, help="Tapped layer ids, e.g. 1,9,17,25,33 (default: DFlash's 5)."),
    num_layers: int = typer.Option(5, help="How many layers to tap when --layers is not given."),
    revision: str | None = typer.Option(None, help="Hub revision of the target."),
    max_length: int = typer.Option(3072, help="Longest sample in tokens; longer rows are rejected."),
    truncate: bool = typer.Option(False, help="Cut rows over --max-length instead of rejecting them."),
    storage: str = typer.Option("bf16", help="bf16, or fp8 (float8_e4m3fn with a per-token, per-layer scale)."),
    zstd_level: int = typer.Option(3, help="zstd level for the shards."),
    token_budget: int | None = typer.Option(None, help="Padded tokens per forward (default 16384 GPU, 4096 CPU)."),
    unit_mb: int = typer.Option(1024, help="Hidden-state MiB per work unit."),
    gpus: str | None = typer.Option(None, help="GPUs, one process each: 0-4 or 0,2,5."),
    procs: int = typer.Option(1, help="CPU processes when no --gpus."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the size estimate, write nothing."),
) -> None:
    """Run the target over a dataset and cache its tapped hidden states."""
    from dflash_cache import extract as ex

    cfg = ex.ExtractConfig(
        target=target, data=str(data), out=out, layers=_layers(layers), num_layers=num_layers, revision=revision,
        max_length=max_length, truncate=truncate, storage=storage, zstd_level=zstd_level,
        token_budget=token_budget, unit_mb=unit_mb, gpus=_gpus(gpus), procs=procs,
    )  # fmt: skip
    if dry_run:
        prep = ex.prepare(cfg)
        plan, spec = prep.plan, prep.spec
        print(json.dumps({
            "samples": plan.num_samples, "rejected": len(prep.tokens.rejected), "tokens": plan.num_tokens,
            "padded_tokens": plan.padded_tokens, "padding": round(plan.padding_ratio, 4),
            "units": len(plan.units), "units_committed": len(prep.done),
            "batches": sum(len(u.batches) for u in plan.units),
            "layers": spec.layers.ids, "storage": spec.storage.dtype,
            "estimated_bytes_max": ex.estimated_bytes(spec, plan.num_tokens),
        }, indent=2))  # fmt: skip
        return
    summary = ex.run(cfg, ExtractBar())
    console.print(
        f"cached {summary['samples']} samples, {summary['tokens']:,} tokens in {summary['units']} units; "
        f"{summary['rejected']} rows rejected (see {out}/rejected.jsonl); padding {100 * summary['padding']:.1f}%; "
        f"wrote {human_bytes(summary['bytes_written'])} at {summary['tokens_per_s']:,.0f} tok/s"
    )
    if summary["missing_units"]:
        console.print(f"[red]error:[/red] units not committed: {summary['missing_units'][:10]}")
        raise typer.Exit(1)


@app.command()
@friendly
def info(cache: Path = typer.Argument(..., help="Cache directory.")) -> None:
    """Print a cache's spec, counts, bytes on disk and compression ratio."""
    from dflash_cache.audit import info as cache_info

    print(json.dumps(cache_info(cache), indent=2))


@app.command()
@friendly
def verify(cache: Path = typer.Argument(..., help="Cache directory.")) -> None:
    """Decode every unit of a cache and name any that is bad."""
    from dflash_cache.audit import verify as verify_cache

    bad = verify_cache(cache)
    if bad:
        for unit, problems in bad.items():
            console.print(f"[red]bad unit {unit}:[/red] " + "; ".join(problems))
        raise typer.Exit(1)
    console.print("all units sound")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
