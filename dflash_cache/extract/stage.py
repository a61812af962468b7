"""The extract stage: dataset + target -> cache of tapped hidden states.

The stage prepares the cache (tokenize, plan, describe it, check it against an existing one),
answers `--dry-run`'s estimates, and launches one worker per device or rank. A worker loads its
copy of the target, writes the frozen weights, fits or loads a projected cache's basis, and runs
the forward loop (forward.py) over its units.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from dflash_cache.cache.heartbeat import HEARTBEAT, beating
from dflash_cache.cache.projection import PROJECTION, Basis, check_projection
from dflash_cache.cache.spec import (
    CACHE_JSON,
    CacheSpec,
    DataInfo,
    LayerInfo,
    PlanInfo,
    ProjectionInfo,
    SpecError,
    StorageInfo,
    TokenizerInfo,
    check_layer_ids,
    default_bucket_edges,
    default_layer_ids,
    read_spec,
    write_spec,
)
from dflash_cache.cache.store import (
    FROZEN,
    LOCK,
    PARTIAL,
    REJECTED,
    UNITS,
    WORK,
    cache_lock,
    committed_units,
    sweep_partial,
    write_frozen,
    write_rejected,
)
from dflash_cache.cache.unit.layout import STORAGES, RowFormat, chunk_tokens_for
from dflash_cache.core.atomic import is_temporary
from dflash_cache.core.devices import Worker
from dflash_cache.core.errors import ExtractError
from dflash_cache.core.groups import Group, copies, lead_says, process_group
from dflash_cache.core.launch import copy_interrupts, launch, torchrun_worker
from dflash_cache.core.paths import output_dir
from dflash_cache.core.progress import ProgressSink, Reporter
from dflash_cache.core.threads import worker_threads
from dflash_cache.extract.basis import energy_note, fit_projection, projecting
from dflash_cache.extract.config import (
    ExtractConfig,
    resolve_forward_token_budget,
    resolve_rank,
    resolve_storage,
)
from dflash_cache.extract.forward import extract_units, follow_units
from dflash_cache.extract.mask import AUTO, choose_mask_token, data_token_ids
from dflash_cache.extract.plan import Plan, make_plan
from dflash_cache.extract.prefill import Chunking, Target
from dflash_cache.rows.chat import check_template_kwargs
from dflash_cache.rows.digest import chat_template_digest, source_fingerprint, tokenizer_digest
from dflash_cache.rows.encode import Tokenized, tokenize
from dflash_cache.target.config import text_config
from dflash_cache.target.load import compute_dtype_for, frozen_weights, load_config, load_tokenizer, target_info
from dflash_cache.target.parallel import layout, load_copy


@dataclass
class Prepared:
    spec: CacheSpec
    plan: Plan
    tokens: Tokenized
    done: set[int]


def _device_kind(cfg: ExtractConfig) -> torch.device:
    return torch.device("cuda") if cfg.gpus else torch.device("cpu")


def prepare(cfg: ExtractConfig, *, write: bool = True) -> Prepared:
    """Tokenize, plan and describe the cache; check it against an existing one. Writes nothing
    in the cache directory except the reusable tokenized dataset under `.work/`, and with
    `write=False` (`--dry-run`) not even that."""
    if cfg.storage not in ("auto", *STORAGES):
        raise ExtractError(f"--storage {cfg.storage!r}: expected auto, bf16 or fp8")
    template_kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    output_dir(cfg.out, "--out")
    if cfg.out.is_dir() and any(cfg.out.iterdir()) and not (cfg.out / "cache.json").exists():
        # only what an extract writes itself (files being written atomically too): before cache.json a
        # projected cache's first worker writes the frozen weights and the basis, and the ranks of a
        # torchrun job start at their own pace
        names = {n for n in os.listdir(cfg.out) if not is_temporary(n)}
        if not names <= {WORK, LOCK, HEARTBEAT, FROZEN, PROJECTION, REJECTED, UNITS, PARTIAL}:
            raise ExtractError(f"--out {cfg.out} is a non-empty directory that is not a dflash cache")
    config = load_config(cfg.target, cfg.revision)
    sharding = layout(cfg.target, cfg.revision, config, cfg.tp)
    tc = text_config(config)
    num_layers = int(tc["num_hidden_layers"])
    try:
        if cfg.layers:
            layer_ids = check_layer_ids(cfg.layers, num_layers)
        else:
            layer_ids = default_layer_ids(num_layers, cfg.num_layers)
    except SpecError as e:
        raise ExtractError(f"--{e}") from None
    tokenizer = load_tokenizer(cfg.target, cfg.revision)
    vocab_size = int(tc["vocab_size"])
    if cfg.mask_token_id not in (None, AUTO):
        choose_mask_token(tokenizer, vocab_size, cfg.mask_token_id)  # a bad id fails before the data is tokenized
    tokens = tokenize(
        cfg.data, tokenizer, cfg.max_length, cfg.truncate, num_proc=cfg.tokenize_procs, work_dir=cfg.out / WORK,
        save=write, template_kwargs=template_kwargs, split=cfg.data_split, max_samples=cfg.max_samples,
    )  # fmt: skip
    mask_choice = choose_mask_token(tokenizer, vocab_size, cfg.mask_token_id,
                                    data_ids=data_token_ids(tokens.dataset, vocab_size))  # fmt: skip
    device = _device_kind(cfg)
    projection = _projection(cfg, len(layer_ids), int(tc["hidden_size"]))
    cfg = dataclasses.replace(cfg, storage=resolve_storage(cfg.storage, projection is not None))
    row_bytes = RowFormat.planned(cfg.storage, len(layer_ids), int(tc["hidden_size"]), projection).hidden_bytes
    plan = make_plan(
        np.asarray(tokens.dataset["length"], dtype=np.int64),
        bucket_edges=default_bucket_edges(cfg.max_length),
        token_budget=resolve_forward_token_budget(cfg.token_budget, device.type == "cuda"),
        unit_tokens=max(1, (cfg.unit_mb << 20) // row_bytes),
    )
    spec = _describe(cfg, config, layer_ids, tokenizer, tokens, mask_choice, plan, template_kwargs, device, row_bytes,
                     projection)  # fmt: skip
    spec.parallel = sharding  # this run's layout, which the workers load by (not compared on resume)
    if (cfg.out / CACHE_JSON).exists():
        diffs = read_spec(cfg.out).differences(spec)
        if diffs:
            raise ExtractError(
                f"{cfg.out} was made with other settings; refusing to mix them. Differences: " + "; ".join(diffs)
                + f". To resume it, rerun with --config {cfg.out} (the settings it was made with); or use another --out"
            )  # fmt: skip
    return Prepared(spec, plan, tokens, set(committed_units(cfg.out)))


def _projection(cfg: ExtractConfig, num_layers: int, hidden_size: int) -> ProjectionInfo | None:
    """What `--project` asks for (its basis not fitted yet), or None for the tapped layers as they are."""
    rank = resolve_rank(cfg.project, cfg.project_basis, num_layers, hidden_size)
    if rank is None:
        return None
    problem = check_projection(cfg.project_basis, rank, cfg.project_scaling, num_layers, hidden_size)
    if problem is not None:
        raise ExtractError(f"--project: {problem}")
    return ProjectionInfo(basis=cfg.project_basis, rank=rank, scaling=cfg.project_scaling,
                          fit_tokens=cfg.project_fit_tokens)  # fmt: skip


def _describe(cfg: ExtractConfig, config: dict, layer_ids: list[int], tokenizer, tokens: Tokenized,
              mask_choice, plan: Plan, template_kwargs: dict, device: torch.device,
              row_bytes: int, projection: ProjectionInfo | None) -> CacheSpec:  # fmt: skip
    """What the cache will be (cache.json): the target, taps, storage, tokenizer, data, plan and
    projection (its basis fitted later, by the first worker)."""
    eos = tokenizer.eos_token_id
    return CacheSpec(
        target=target_info(cfg.target, cfg.revision, config, compute_dtype_for(device)),
        layers=LayerInfo(ids=layer_ids, final_hidden=cfg.final_hidden),
        storage=StorageInfo(
            dtype=cfg.storage,
            codec={"name": "zstd", "level": cfg.zstd_level, "checksum": True},
            chunk_tokens=chunk_tokens_for(row_bytes),
        ),
        tokenizer=TokenizerInfo(
            digest=tokenizer_digest(tokenizer),
            chat_template_digest=chat_template_digest(tokenizer),
            mask_token_id=mask_choice.id,
            mask_token=mask_choice.record(),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=[] if eos is None else [int(eos)],
            chat_template_kwargs=template_kwargs,
        ),
        data=DataInfo(
            source=str(cfg.data),
            fingerprint=source_fingerprint(cfg.data, split=cfg.data_split),
            max_length=cfg.max_length,
            truncate=cfg.truncate,
            num_rows=tokens.num_rows,
            num_rejected=len(tokens.rejected),
            split=cfg.data_split,
            max_samples=cfg.max_samples,
        ),
        plan=PlanInfo(
            bucket_edges=list(plan.bucket_edges),
            token_budget=plan.token_budget,
            unit_tokens=plan.unit_tokens,
            num_units=len(plan.units),
            num_samples=plan.num_samples,
            num_tokens=plan.num_tokens,
            padded_tokens=plan.padded_tokens,
        ),
        projection=projection,
        tool_version=_tool_version(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def _tool_version() -> str:
    try:
        from importlib.metadata import version

        return version("dflash-cache")
    except Exception:  # noqa: BLE001
        return "unknown"


def estimated_bytes(spec: CacheSpec, num_tokens: int) -> int:
    """Bytes on disk for `num_tokens` cached tokens; assumes no compression (the safe bound)."""
    return num_tokens * RowFormat.of(spec).row_bytes


def final_bytes(spec: CacheSpec) -> dict[str, int]:
    """What `--final-hidden` adds to each cached token, uncompressed (H*2 bf16, H+4 fp8), for
    `--dry-run`; empty without it."""
    row = RowFormat.of(spec)
    return {"final_hidden_bytes_per_token": row.final_bytes} if row.final else {}


def run(cfg: ExtractConfig, sink: ProgressSink | None = None) -> dict:
    """Extract everything that is not committed yet; returns a summary."""
    output_dir(cfg.out, "--out")
    created = not cfg.out.exists()
    cfg.out.mkdir(parents=True, exist_ok=True)
    try:
        return _run(cfg, sink)
    except BaseException:
        if created and not (cfg.out / "cache.json").exists():  # refused before anything was cached
            shutil.rmtree(cfg.out, ignore_errors=True)
        raise


def _run(cfg: ExtractConfig, sink: ProgressSink | None) -> dict:
    in_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    copies(int(os.environ["WORLD_SIZE"]) if in_torchrun else len(cfg.gpus or []) or cfg.procs, cfg.tp)
    with nullcontext() if in_torchrun else cache_lock(cfg.out), beating(cfg.out):  # heartbeat.py: for trainers
        prep = prepare(cfg)
        todo_tokens = sum(u.num_tokens for u in prep.plan.units if u.id not in prep.done)
        need = estimated_bytes(prep.spec, todo_tokens)
        free = shutil.disk_usage(cfg.out).free
        if need > free:
            raise ExtractError(
                f"the cache needs up to {_gib(need)} more and {cfg.out} has {_gib(free)} free; "
                "free space, use --storage fp8, or point --out elsewhere"
            )
        lead = not in_torchrun or os.environ["RANK"] == "0"  # one process writes the shared files
        if lead and not (cfg.out / CACHE_JSON).exists() and prep.spec.projection is None:
            write_spec(cfg.out, prep.spec)  # a projected cache's first worker writes it, once its basis is fitted
        if lead and not (cfg.out / REJECTED).exists():
            write_rejected(cfg.out, prep.tokens.rejected)
        swept = 0 if in_torchrun else sweep_partial(cfg.out)
        start = time.perf_counter()
        reporter = Reporter(sink)
        reporter.start(total=prep.plan.num_tokens, done=prep.plan.num_tokens - todo_tokens)
        reporter.channel.put({"units_done": len(prep.done), "units_planned": len(prep.plan.units)})
        try:
            args = (cfg, prep.spec, prep.plan, prep.tokens.dataset, reporter.channel)
            launch(_worker, args, gpus=cfg.gpus, procs=cfg.procs, store=cfg.tp > 1)
        finally:
            totals = reporter.stop()
        end = time.perf_counter()
        elapsed = end - start
    committed = committed_units(cfg.out)
    # under torchrun the ranks on other nodes may still be at work: a copy's lead answers for its copy's
    # units (its other ranks may end before it has committed the last one)
    group = Group.of(torchrun_worker(cfg.gpus), cfg.tp) if in_torchrun else None
    mine = prep.plan.units if group is None else []
    if group is not None and group.lead:
        mine = prep.plan.units_for_rank(group.index, group.count)
    missing = [u.id for u in mine if u.id not in committed]
    return {
        "cache": str(cfg.out),
        "units": f"{len(committed)}/{len(prep.plan.units)}",
        "missing_units": missing,
        "samples": prep.plan.num_samples,
        "tokens": prep.plan.num_tokens,
        "rejected": len(prep.tokens.rejected),
        "padding": prep.plan.padding_ratio,
        "extracted_tokens": totals.get("tokens", 0),
        "bytes_written": totals.get("bytes", 0),
        "seconds": elapsed,
        "tokens_per_s": totals.get("tokens", 0) / max(elapsed, 1e-9),
        "startup_s": (reporter.first_at or end) - start,  # starting processes, loading the target, first batch
        "forward_tokens_per_s": totals.get("forward_tokens_per_s", 0.0),  # steady rate, summed over ranks
        "buffer_wait_s": totals.get("buffer_wait_s", 0.0),  # forwards waiting for a free unit buffer, all ranks
        "swept_partial": swept,
        "mask_token": prep.spec.tokenizer.mask_token,  # the id of the drafter's masked slots, and why
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _worker(w: Worker, cfg: ExtractConfig, spec: CacheSpec, plan: Plan, dataset, channel) -> None:
    """One rank: with --tp, one of the ranks of a copy of the target (groups.Group). The copy takes
    the units whose id mod the copy count is its index; all its ranks run the same forwards, and
    its lead alone commits them, as copy 0's lead alone writes the frozen weights (and, for a
    projected cache, the basis its ranks fit together, then cache.json)."""
    group = Group.of(w, cfg.tp)
    with worker_threads(w), process_group(w, group), copy_interrupts(group) as together:
        # the ranks of a copy must run the same forwards: they go by what its lead found on disk
        done, has_frozen, has_spec = lead_says(group, (set(committed_units(cfg.out)), (cfg.out / FROZEN).exists(),
                                                       (cfg.out / CACHE_JSON).exists()))  # fmt: skip
        todo = [u for u in plan.units_for_rank(group.index, group.count) if u.id not in done]
        needs_frozen = group.index == 0 and not has_frozen
        fits_basis = group.index == 0 and spec.projection is not None and not has_spec
        if not todo and not needs_frozen and not fits_basis:
            return
        target, model = load_copy(spec, w.device)
        target = together(target)  # a Ctrl-C stops the copy's ranks at the same forward
        if needs_frozen:
            frozen = frozen_weights(model)  # gathered on every rank of a sharded copy
            if group.first_lead:
                write_frozen(cfg.out, *frozen)
        del model  # the upper layers and the LM head stay on the CPU only until here
        # a copy of one rank finds the prefill chunk it needs; the ranks of a sharded one run the same forwards
        chunk = Chunking(cfg.prefill_chunk, adapt=group.size == 1,
                         say=lambda text: channel.put({"info": text}))  # fmt: skip
        if spec.projection is not None:
            spec, basis = _basis(group, fits_basis, target, cfg.out, spec, plan, dataset, w.device, channel.put,
                                 chunk)  # fmt: skip
            if group.lead:
                target = projecting(target, basis, len(spec.layers.ids))
        if group.lead:
            extract_units(target, todo, dataset, spec, cfg.out, w.device, channel.put, writers=cfg.writers,
                          chunk=chunk)  # fmt: skip
        else:
            follow_units(target, todo, dataset, spec, w.device, chunk.tokens)


def _basis(group: Group, fit: bool, target: Target, out: Path, spec: CacheSpec, plan: Plan, dataset,
           device: torch.device, report: Callable[[dict], None],
           chunk: Chunking) -> tuple[CacheSpec, Basis]:  # fmt: skip
    """A projected cache's basis, and its spec as cache.json holds it: the first copy's ranks fit
    the basis on the plan's own batches (`fit`: its forwards are collective under --tp), its lead
    saves it and writes cache.json with its digest; every other worker (other copies, GPUs,
    nodes) waits for that cache.json. A rerun takes the stored basis."""
    if fit:
        say = report if group.first_lead else lambda delta: None
        say({"info": f"fitting the projection basis ({spec.projection.basis}, {spec.projection.rank} values a "
                     "token)"})  # fmt: skip
        started = time.perf_counter()
        basis, spec = fit_projection(target, spec, plan, dataset, device, chunk)
        if group.first_lead:
            spec = dataclasses.replace(spec, projection=dataclasses.replace(spec.projection, digest=basis.save(out)))
            write_spec(out, spec)
            say({"info": f"fitted the basis on {spec.projection.fitted_tokens:,} tokens in "
                         f"{time.perf_counter() - started:.1f}s; {energy_note(spec)}"})  # fmt: skip
    while not (out / CACHE_JSON).exists():
        time.sleep(0.5)
    spec = read_spec(out)
    return spec, Basis.load(out, spec)
