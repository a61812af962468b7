"""`dflash bench`: measure this machine before a long job (dflash_cache.bench). Each command's
options come from its settings dataclass (dflash_cache/bench/config.py); each prints one JSON object."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from dflash_cache.bench.config import (
    CodecBenchConfig,
    CommitBenchConfig,
    DiskBenchConfig,
    ExtractBenchConfig,
    RanksBenchConfig,
    RegenBenchConfig,
    TrainBenchConfig,
)

from .checks import check_paths
from .errors import friendly
from .options import configured
from .results import print_json
from .ui import console

bench_app = typer.Typer(no_args_is_help=True, help="Measure this machine before a long job (ratios side by side).")


@bench_app.command("disk")
@friendly
@configured(DiskBenchConfig, "dflash bench disk")
def disk(
    cfg: DiskBenchConfig,
    *,
    as_json: bool,
    path: Path = typer.Argument(..., help="A directory on the cache's filesystem."),
) -> None:
    """Sequential write and cold-read bandwidth."""
    from dflash_cache.bench.io import disk as measure

    check_paths(("output_dir", path, "PATH"))
    print_json(measure(path, cfg.size_mb))


@bench_app.command("codec")
@friendly
@configured(CodecBenchConfig, "dflash bench codec")
def codec(cfg: CodecBenchConfig, *, as_json: bool) -> None:
    """zstd ratio and single-thread speed on bf16 hidden-state-shaped data."""
    from dflash_cache.bench.io import codec as measure

    print_json(measure(level=cfg.level))


@bench_app.command("commit")
@friendly
@configured(CommitBenchConfig, "dflash bench commit")
def commit(
    cfg: CommitBenchConfig,
    *,
    as_json: bool,
    out: Path = typer.Argument(..., help="A directory on the cache's filesystem (a scratch folder in it is removed)."),
) -> None:
    """Unit commits while the process runs Python: writer threads against writer processes."""
    from dflash_cache.bench.io import commit as measure

    check_paths(("output_dir", out, "OUT"))
    print_json(measure(out, units=cfg.units, writers=cfg.writers))


@bench_app.command("extract")
@friendly
@configured(ExtractBenchConfig, "dflash bench extract")
def extract(cfg: ExtractBenchConfig, *, as_json: bool) -> None:
    """Full extract path vs the bare truncated forward of a random target of a real shape (Qwen3-8B by default)."""
    from dflash_cache.bench import extract as bench
    from dflash_cache.bench.shapes import BenchError, shape_config, shape_of

    check_paths(("output_dir", cfg.out, "--out"))
    if cfg.length is not None and (cfg.long or cfg.peer):
        raise BenchError("--length sets every sample's length: it does not go with --long, and --peer measures "
                         "the chat mix")  # fmt: skip
    config = shape_of(cfg.like) if cfg.like else shape_config(cfg.shape)
    start = time.monotonic()

    def phase(name: str) -> None:  # on stderr, so --json's stdout stays one object
        console.print(f"bench extract: {name} ({time.monotonic() - start:.0f} s in)")

    result = bench.extract(cfg.out, config=config, num_tokens=cfg.tokens, storage=cfg.storage,
                           token_budget=cfg.token_budget, writers=cfg.writers, long=cfg.long, length=cfg.length,
                           prefill_chunk=cfg.prefill_chunk, final_hidden=cfg.final_hidden, project=cfg.project,
                           project_basis=cfg.project_basis, on_phase=phase)  # fmt: skip
    bench.write_random_frozen(cfg.out, config)
    if cfg.peer:
        result |= {f"loader_{k}": v for k, v in bench.loader_rate(cfg.out, token_budget=cfg.token_budget).items()}
        peer = bench.peer_baseline(cfg.out.with_name(cfg.out.name + "-peer"), config=config, num_tokens=cfg.tokens,
                                   token_budget=cfg.token_budget)  # fmt: skip
        result |= {f"peer_{k}": v for k, v in peer.items()}
    print_json(result)


@bench_app.command("train")
@friendly
@configured(TrainBenchConfig, "dflash bench train")
def train(cfg: TrainBenchConfig, *, as_json: bool) -> None:
    """Drafter steps with the real loader vs the same steps on batches already on the GPU, with the
    useful TFLOP/s and MFU of the step."""
    from dflash_cache.bench.shapes import shape_config, shape_of
    from dflash_cache.bench.train import train as measure

    print_json(measure(cfg.cache, steps=cfg.steps, token_budget=cfg.token_budget, max_anchors=cfg.max_anchors,
                       block_size=cfg.block_size, draft_layers=cfg.draft_layers, readers=cfg.readers, cold=cfg.cold,
                       drafter=cfg.drafter, length=cfg.length,
                       config=shape_of(cfg.like) if cfg.like else shape_config(cfg.shape),
                       storage=cfg.storage, project=cfg.project, sliding_window=cfg.sliding_window,
                       full_attention_layers=cfg.full_attention_layers, profile=cfg.profile))  # fmt: skip


@bench_app.command("ranks")
@friendly
@configured(RanksBenchConfig, "dflash bench ranks")
def ranks(cfg: RanksBenchConfig, *, as_json: bool) -> None:
    """Predicted DDP speed-up over one GPU, batches dealt as they come vs by cost (no timing)."""
    from dflash_cache.bench.ranks import cache_lengths, rank_balance
    from dflash_cache.bench.shapes import lognormal_lengths

    lengths, edges = cache_lengths(cfg.cache) if cfg.cache is not None else (lognormal_lengths(cfg.samples), None)
    print_json(rank_balance(lengths, token_budget=cfg.token_budget, block_size=cfg.block_size,
                            max_anchors=cfg.max_anchors, ranks=tuple(cfg.ranks), bucket_edges=edges))  # fmt: skip


@bench_app.command("regen")
@friendly
@configured(RegenBenchConfig, "dflash bench regen")
def regen(cfg: RegenBenchConfig, *, as_json: bool) -> None:
    """New tokens/s of the embedded generation engine, eager and CUDA-graphed side by side, beside the
    memory-bandwidth bound (needs a GPU)."""
    from dflash_cache.bench.generate import regen as measure

    print_json(measure(cfg.target, shape=cfg.shape, data=cfg.data, prompts=cfg.prompts,
                       prompt_tokens=cfg.prompt_tokens, max_new_tokens=cfg.max_new_tokens,
                       batch_size=cfg.batch_size))  # fmt: skip
