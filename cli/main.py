"""The `dflash` command: parse arguments, call the library, print. Nothing else lives here."""

from __future__ import annotations

import json
import sys
from functools import wraps
from pathlib import Path

import typer

from cli.ui import ExtractBar, TrainBar, console, human_bytes
from dflash_cache.errors import UserError

app = typer.Typer(no_args_is_help=True, help="Decoupled hidden-state cache for DFlash drafters.",
                  context_settings={"help_option_names": ["-h", "--help"]})  # fmt: skip


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"dflash-cache {version('dflash-cache')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            print("dflash-cache (not installed)")
        raise typer.Exit()


@app.callback()
def _quiet_libraries(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),  # fmt: skip
) -> None:
    """One progress bar per job: silence the libraries' own bars and load logs."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def friendly(fn):
    """Print user errors as one line and exit 1; a worker process's error likewise; Ctrl-C as one
    line that says how to resume, exit 130."""

    @wraps(fn)
    def run(*args, **kwargs):
        from torch.multiprocessing import ProcessRaisedException

        try:
            return fn(*args, **kwargs)
        except (UserError, FileNotFoundError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted:[/yellow] what was committed is kept; rerun the same command to resume")
            raise typer.Exit(130) from None
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


def _template_kwargs(text: str | None) -> dict | None:
    from dflash_cache.extract.data import DataError, check_template_kwargs

    try:
        return None if text is None else check_template_kwargs(text)
    except DataError as e:
        raise DataError(f"--chat-template-kwargs {text!r}: {e}") from None


def _paths(*checks) -> None:
    """Refuse path arguments of the wrong kind before anything is written (dflash_cache.paths)."""
    from dflash_cache import paths

    for kind, path, arg in checks:
        getattr(paths, kind)(path, arg)


DATA_HELP = ("Rows: a JSONL / JSON / Parquet file, a saved `datasets` directory, or a hub dataset name; "
             "messages, ShareGPT conversations, Alpaca instruction/output, prompt/response or text.")  # fmt: skip
KWARGS_HELP = """Chat-template kwargs as a JSON object, e.g. '{"enable_thinking": false}'."""
SPLIT_HELP = "Split of a hub dataset or saved DatasetDict (default: train)."
MAX_SAMPLES_HELP = "Read only the first N rows."


@app.command()
@friendly
def extract(
    target: str = typer.Option(..., help="Target model: local directory or a hub id in the local cache."),
    data: str = typer.Option(..., help=DATA_HELP),
    out: Path = typer.Option(..., help="Cache directory (created, or resumed if it exists)."),
    layers: str | None = typer.Option(None, help="Tapped layer ids, e.g. 1,9,17,25,33 (default: DFlash's 5)."),
    num_layers: int = typer.Option(5, help="How many layers to tap when --layers is not given."),
    revision: str | None = typer.Option(None, help="Hub revision of the target."),
    max_length: int = typer.Option(3072, help="Longest sample in tokens; longer rows are rejected."),
    truncate: bool = typer.Option(False, help="Cut rows over --max-length instead of rejecting them."),
    storage: str = typer.Option("bf16", help="bf16, or fp8 (float8_e4m3fn with a per-token, per-layer scale)."),
    zstd_level: int = typer.Option(3, help="zstd level for the shards."),
    token_budget: int | None = typer.Option(None, help="Padded tokens per forward (default 16384 GPU, 4096 CPU)."),
    unit_mb: int = typer.Option(512, help="Hidden-state MiB per work unit."),
    writers: int | None = typer.Option(
        None,
        help="Writer processes: units compressed and written at once, one host "
        "buffer each (default 6 with --gpus, else 2).",
    ),
    gpus: str | None = typer.Option(None, help="GPUs, one process each: 0-4 or 0,2,5."),
    procs: int = typer.Option(1, help="CPU processes when no --gpus."),
    mask_token_id: int | None = typer.Option(
        None,
        help="Id for the drafter's masked block slots (default: the "
        "tokenizer's mask token, else len(tokenizer), a row no text produces).",
    ),
    chat_template_kwargs: str | None = typer.Option(None, help=KWARGS_HELP),
    data_split: str | None = typer.Option(None, help=SPLIT_HELP),
    max_samples: int | None = typer.Option(None, help=MAX_SAMPLES_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the size estimate, write nothing."),
) -> None:
    """Run the target over a dataset and cache its tapped hidden states."""
    from dflash_cache.extract import stage as ex

    cfg = ex.ExtractConfig(
        target=target, data=data, out=out, layers=_layers(layers), num_layers=num_layers, revision=revision,
        max_length=max_length, truncate=truncate, storage=storage, zstd_level=zstd_level,
        token_budget=token_budget, unit_mb=unit_mb, writers=writers, gpus=_gpus(gpus), procs=procs,
        mask_token_id=mask_token_id, chat_template_kwargs=_template_kwargs(chat_template_kwargs),
        data_split=data_split, max_samples=max_samples,
    )  # fmt: skip
    if dry_run:
        prep = ex.prepare(cfg, write=False)
        plan, spec = prep.plan, prep.spec
        print(json.dumps({
            "samples": plan.num_samples, "rejected": len(prep.tokens.rejected), "tokens": plan.num_tokens,
            "padded_tokens": plan.padded_tokens, "padding": round(plan.padding_ratio, 4),
            "units": len(plan.units), "units_committed": len(prep.done),
            "batches": sum(len(u.batches) for u in plan.units),
            "layers": spec.layers.ids, "storage": spec.storage.dtype, "mask_token_id": spec.tokenizer.mask_token_id,
            "estimated_bytes_max": ex.estimated_bytes(spec, plan.num_tokens),
        }, indent=2))  # fmt: skip
        return
    summary = ex.run(cfg, ExtractBar())
    console.print(
        f"cached {summary['samples']} samples, {summary['tokens']:,} tokens in {summary['units']} units; "
        f"{summary['rejected']} rows rejected (see {out}/rejected.jsonl); padding {100 * summary['padding']:.1f}%; "
        f"wrote {human_bytes(summary['bytes_written'])} in {summary['seconds']:.1f}s "
        f"({summary['startup_s']:.1f}s to start; forward loop {summary['forward_tokens_per_s']:,.0f} tokens/s)"
    )
    ranks = max(1, len(cfg.gpus or []) or cfg.procs)
    if summary["buffer_wait_s"] > 0.05 * summary["seconds"] * ranks:
        console.print(f"note: the forward passes waited {summary['buffer_wait_s']:.1f}s in all for unit writers "
                      "(compression or the disk bound this run); more --writers may help if cores idle")  # fmt: skip
    if summary["missing_units"]:
        console.print(f"[red]error:[/red] units not committed: {summary['missing_units'][:10]}")
        raise typer.Exit(1)


@app.command()
@friendly
def train(
    cache: Path = typer.Option(..., help="Cache directory written by `dflash extract`."),
    out: Path = typer.Option(..., help="Run directory (created, or resumed if it exists)."),
    epochs: int = typer.Option(6, help="Passes over the cache."),
    max_steps: int | None = typer.Option(
        None, help="Stop after this many optimizer steps (the schedule still spans all epochs)."
    ),
    lr: float = typer.Option(6e-4, help="Peak learning rate (AdamW, cosine schedule)."),
    warmup: float = typer.Option(0.04, help="Warmup fraction of the run's tokens."),
    clip: float = typer.Option(1.0, help="Gradient clipping norm."),
    token_budget: int | None = typer.Option(None, help="Context tokens per batch per rank (8192 GPU, 2048 CPU)."),
    grad_accum: int = typer.Option(1, help="Batches per optimizer step."),
    grad_reduce: str = typer.Option(
        "fp32", help="Dtype of the DDP gradient all-reduce: fp32, or bf16 (half the bytes)."
    ),
    draft_layers: int = typer.Option(5, help="Drafter decoder layers."),
    block_size: int = typer.Option(16, help="Block size B."),
    layers: str | None = typer.Option(None, help="Subset of the cached layer ids (default: all cached)."),
    max_anchors: int = typer.Option(512, help="Anchors sampled per sequence."),
    seed: int = typer.Option(0, help="Seed for weights, shuffling and anchors."),
    save_every: int = typer.Option(200, help="Checkpoint every N steps."),
    log_every: int = typer.Option(10, help="Metrics every N steps."),
    gpus: str | None = typer.Option(None, help="GPUs, one DDP process each: 5-7."),
    procs: int = typer.Option(1, help="CPU DDP processes (gloo) when no --gpus."),
    skip_bad_units: bool = typer.Option(False, help="Train without units that fail their checks."),
    follow: bool = typer.Option(
        True,
        help="On a cache still being extracted, epoch 1 follows the extraction "
        "(--no-follow: train on the units committed so far).",
    ),
    trace: bool = typer.Option(False, help="Log which samples every batch held to <out>/trace/rank<r>.jsonl."),
) -> None:
    """Train a DFlash drafter from a cache; rerun the same command to resume.

    Start it together with `dflash extract` on the same cache: the first epoch trains on units as
    they commit and waits for more until the extraction is complete."""
    from dflash_cache.train import stage as tr

    _paths(("output_dir", out, "--out"))
    cfg = tr.TrainConfig(
        cache=cache, out=out, epochs=epochs, max_steps=max_steps, lr=lr, warmup=warmup, clip=clip,
        token_budget=token_budget, grad_accum=grad_accum, grad_reduce=grad_reduce,
        draft_layers=draft_layers, block_size=block_size,
        layers=_layers(layers), max_anchors=max_anchors, seed=seed, save_every=save_every, log_every=log_every,
        gpus=_gpus(gpus), procs=procs, skip_bad_units=skip_bad_units, follow=follow,
        trace=trace,
    )  # fmt: skip
    summary = tr.run(cfg, TrainBar())
    console.print(f"trained {summary.get('steps', 0)} steps; serving export in {summary['export']}")


@app.command()
@friendly
def export(
    run: Path = typer.Argument(..., help="Run directory of `dflash train`."),
    out: Path = typer.Argument(..., help="Where to write config.json + model.safetensors."),
) -> None:
    """Write a run's latest checkpoint in the serving format (z-lab, vLLM, SGLang)."""
    from dflash_cache.train.stage import export as export_run

    _paths(("input_dir", run, "RUN"), ("output_dir", out, "OUT"))
    console.print(f"exported to {export_run(run, out)}")


@app.command()
@friendly
def info(cache: Path = typer.Argument(..., help="Cache directory.")) -> None:
    """Print a cache's spec, counts, bytes on disk and compression ratio."""
    from dflash_cache.cache.audit import info as cache_info

    print(json.dumps(cache_info(cache), indent=2))


@app.command()
@friendly
def verify(
    cache: Path = typer.Argument(..., help="Cache directory."),
    present_only: bool = typer.Option(False, "--present-only", help="Check only the committed units (a cache "
                                      "still being extracted); by default a planned unit not committed fails."),
) -> None:
    """Decode every unit of a cache and name any that is bad or missing."""
    from dflash_cache.cache.audit import verify as verify_cache

    bad = verify_cache(cache, present_only=present_only)
    if bad:
        for unit, problems in bad.items():
            console.print(f"[red]bad unit {unit}:[/red] " + "; ".join(problems))
        console.print(f"[red]error:[/red] {len(bad)} bad or missing unit(s) in {cache}: {', '.join(bad)}")
        raise typer.Exit(1)
    console.print("all units sound")


@app.command("eval")
@friendly
def eval_(
    target: str = typer.Option(..., help="Target model: local directory or a hub id in the local cache."),
    drafter: Path = typer.Option(..., help="Exported drafter (config.json + model.safetensors), e.g. RUN/export."),
    data: str = typer.Option(..., help="Prompts: " + DATA_HELP + " Trailing assistant turns are dropped."),
    max_new_tokens: int = typer.Option(128, min=1, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy; above 0: speculative sampling."),
    seed: int = typer.Option(0, help="Seed of the sampling generators."),
    block_size: int | None = typer.Option(None, min=2, help="Block size B (default: the drafter's)."),
    limit: int | None = typer.Option(None, min=1, help="Use only the first N prompts."),
    chat_template_kwargs: str | None = typer.Option(
        None, help=KWARGS_HELP + " The DFlash reference benchmark runs Qwen3 with thinking off."
    ),
    data_split: str | None = typer.Option(None, help=SPLIT_HELP),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the full result as JSON here."),
) -> None:
    """Speculative decoding with a drafter: tau, acceptance histogram, speedup over the target alone.

    tau/prompt is the mean over prompts of each prompt's tokens per verification step, as the
    DFlash reference benchmark reports it; tau (pooled) divides all tokens by all steps."""
    from dflash_cache.evaluate import evaluate

    r = evaluate(target, drafter, data, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                 block_size=block_size, limit=limit, chat_template_kwargs=_template_kwargs(chat_template_kwargs),
                 data_split=data_split).to_dict()  # fmt: skip
    s = r["settings"]
    kwargs = f", template {json.dumps(s['chat_template_kwargs'])}" if s["chat_template_kwargs"] else ""
    print(f"{s['prompts']} prompts, B={s['block_size']}, temperature {s['temperature']}{kwargs}, "
          f"{s['device']} {s['dtype']}")  # fmt: skip
    for name, value in (("tau/prompt", f"{r['tau_per_prompt']:.3f}"), ("tau (pooled)", f"{r['tau']:.3f}"),
                        ("steps", r["steps"]), ("new tokens", r["new_tokens"]),
                        ("spec tok/s", f"{r['spec_tok_s']:.1f}"), ("target tok/s", f"{r['target_tok_s']:.1f}"),
                        ("speedup", f"{r['speedup']:.2f}x")):  # fmt: skip
        print(f"  {name:<13}{value}")
    print("  accept len   " + "  ".join(f"{n}:{c}" for n, c in enumerate(r["histogram"], 1)))
    if json_out is not None:
        json_out.write_text(json.dumps(r, indent=2) + "\n")


@app.command()
@friendly
def regen(
    target: str = typer.Option(..., help="Target model: local directory or a hub id in the local cache."),
    data: str = typer.Option(..., help=DATA_HELP),
    out: Path = typer.Option(..., help="Output .jsonl (parts are kept in OUT.parts/ until done; rerun to resume)."),
    max_new_tokens: int = typer.Option(512, min=1, help="Longest regenerated turn."),
    temperature: float = typer.Option(0.0, min=0.0, help="0: greedy."),
    seed: int = typer.Option(0, help="Sampling seed (each part is seeded by its id)."),
    batch_size: int = typer.Option(32, min=1, help="Prompts per generate call."),
    gpus: str | None = typer.Option(None, help="GPUs, one process each: 0-7."),
    chat_template_kwargs: str | None = typer.Option(None, help=KWARGS_HELP),
    data_split: str | None = typer.Option(None, help=SPLIT_HELP),
    max_samples: int | None = typer.Option(None, help=MAX_SAMPLES_HELP),
) -> None:
    """Rewrite a dataset's assistant turns with the target's own generations."""
    from dflash_cache.regen import RegenConfig, run

    s = run(RegenConfig(target=target, data=data, out=out, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed, batch_size=batch_size, gpus=_gpus(gpus),
                        chat_template_kwargs=_template_kwargs(chat_template_kwargs),
                        data_split=data_split, max_samples=max_samples))  # fmt: skip
    console.print(f"{s['rows']} rows in {s['out']}" + (" (already complete)" if s["resumed"] else
                  f"; {s['rejected']} rows could not be regenerated"))  # fmt: skip


@app.command()
@friendly
def demo(
    out: Path = typer.Option(Path("demo"), help="Directory for every stage's output."),
    epochs: int = typer.Option(4, help="Training epochs."),
    eval_prompts: int = typer.Option(10, help="Held-out prompts to evaluate on."),
) -> None:
    """regen -> extract -> train -> eval on the bundled data and tiny target; tau trained vs untrained."""
    from dflash_cache.demo import DemoConfig, run

    _paths(("output_dir", out, "--out"))
    results = run(DemoConfig(out=out, epochs=epochs, eval_prompts=eval_prompts), say=console.print)
    print(f"{'drafter':<10} {'tau':>6} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r.tau:>6.3f} {r.spec_tok_s:>11.1f} {r.target_tok_s:>13.1f} {r.speedup:>7.2f}x")


bench_app = typer.Typer(no_args_is_help=True, help="Measure this machine before a long job (ratios side by side).")
app.add_typer(bench_app, name="bench")


def _print_json(d: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}, indent=2))


@bench_app.command("disk")
@friendly
def bench_disk(
    path: Path = typer.Argument(..., help="A directory on the cache's filesystem."),
    size_mb: int = typer.Option(2048, help="Bytes to write and read back."),
) -> None:
    """Sequential write and cold-read bandwidth."""
    from dflash_cache import bench

    _paths(("output_dir", path, "PATH"))
    _print_json(bench.disk(path, size_mb))


@bench_app.command("codec")
@friendly
def bench_codec(level: int = typer.Option(3, help="zstd level.")) -> None:
    """zstd ratio and single-thread speed on bf16 hidden-state-shaped data."""
    from dflash_cache import bench

    _print_json(bench.codec(level=level))


@bench_app.command("commit")
@friendly
def bench_commit(
    out: Path = typer.Argument(..., help="A directory on the cache's filesystem (a scratch folder in it is removed)."),
    units: int = typer.Option(8, help="Units to commit per variant."),
    writers: int = typer.Option(2, help="Writer threads / processes."),
) -> None:
    """Unit commits while the process runs Python: writer threads against writer processes."""
    from dflash_cache import bench

    _paths(("output_dir", out, "OUT"))
    _print_json(bench.commit(out, units=units, writers=writers))


@bench_app.command("extract")
@friendly
def bench_extract(
    out: Path = typer.Option(..., help="Where to write the benchmark cache."),
    tokens: int = typer.Option(1_000_000, help="Tokens of the synthetic log-normal length mix."),
    storage: str = typer.Option("bf16", help="bf16 or fp8."),
    token_budget: int = typer.Option(16384, help="Padded tokens per forward."),
    writers: int = typer.Option(6, help="Unit writer processes."),
    peer: bool = typer.Option(False, help="Also run the one-torch.save-per-sample baseline and both loaders."),
) -> None:
    """Full extract path vs the bare truncated forward of a random Qwen3-8B-shaped target."""
    from dflash_cache import bench

    _paths(("output_dir", out, "--out"))
    result = bench.extract(out, num_tokens=tokens, storage=storage, token_budget=token_budget,
                           writers=writers)  # fmt: skip
    bench.write_random_frozen(out, bench.QWEN3_8B)
    _print_json(result)
    if peer:
        _print_json({f"loader_{k}": v for k, v in bench.loader_rate(out, token_budget=token_budget).items()})
        _print_json({f"peer_{k}": v for k, v in bench.peer_baseline(out.with_name(out.name + "-peer"),
                     num_tokens=tokens, token_budget=token_budget).items()})  # fmt: skip


@bench_app.command("train")
@friendly
def bench_train(
    cache: Path = typer.Option(..., help="A cache, e.g. the one `dflash bench extract` wrote."),
    steps: int = typer.Option(20, help="Measured steps per phase."),
    token_budget: int = typer.Option(8192, help="Context tokens per batch."),
    max_anchors: int = typer.Option(512, help="Anchors per sequence."),
) -> None:
    """Drafter steps with the real loader vs the same steps on batches already on the GPU, with the
    useful TFLOP/s and MFU of the step."""
    from dflash_cache import bench

    _print_json(bench.train(cache, steps=steps, token_budget=token_budget, max_anchors=max_anchors))


@bench_app.command("ranks")
@friendly
def bench_ranks(
    cache: Path | None = typer.Option(None, help="Use this cache's sample lengths (default: the synthetic mix)."),
    samples: int = typer.Option(4000, help="Samples of the synthetic log-normal mix, without --cache."),
    token_budget: int = typer.Option(4096, help="Context tokens per batch."),
    max_anchors: int = typer.Option(512, help="Anchors per sequence."),
    block_size: int = typer.Option(16, help="Draft block size."),
    ranks: str = typer.Option("2,4,8", help="Rank counts to predict."),
) -> None:
    """Predicted DDP speed-up over one GPU, batches dealt as they come vs by cost (no timing)."""
    from dflash_cache import bench

    lengths, edges = bench.cache_lengths(cache) if cache is not None else (bench.lognormal_lengths(samples), None)
    counts = tuple(int(r) for r in ranks.split(","))
    _print_json(bench.rank_balance(lengths, token_budget=token_budget, block_size=block_size,
                                   max_anchors=max_anchors, ranks=counts, bucket_edges=edges))  # fmt: skip


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
