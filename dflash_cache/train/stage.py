"""The train stage: cache -> streaming loader -> drafter, with DDP, checkpoints and metrics.

The loop (`_train`) fits on one screen; its parts sit behind narrow interfaces:

- `setup` builds what a rank trains with (drafter, optimizer, loader, schedule); `dflash bench
  train` measures the very same objects. The drafter comes from its family (`--drafter`,
  `dflash_cache.drafters`): its config, model, objective, FLOPs count and export;
- the checkpointer restores them and decides when to save, gathering each one's `state_dict()`;
- `train_step` is one forward and backward of the family's objective, bound once to the run's
  drafter config and settings (DFlash: blocks from anchors, frozen embedding, drafter, chunked
  decayed loss);
- `StepWindow` sums what the steps did, `MetricsLog.log` takes every record of the run and hands
  it to the experiment trackers (`tracking.py`, `--report-to`);
- `Validator` (`validate.py`) validates every N steps on held-out units or a second cache, which the
  loader never reads; `BestExport` keeps export/ on the best validation acceptance, export-last/
  on the last weights.

Everything needed to continue exactly (weights, optimizer, schedule, RNG, loader position) is in
each checkpoint, and the anchors of a batch depend only on (seed, epoch, batch, rank), so a
resumed run sees exactly the batches and anchors an uninterrupted one would have.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_cache.cache.projection import Basis
from dflash_cache.cache.spec import CacheSpec, SpecError, read_spec
from dflash_cache.cache.store import FROZEN, committed_units, read_frozen
from dflash_cache.core.atomic import write_atomic
from dflash_cache.core.damage import DamagedFile, read_json
from dflash_cache.core.devices import GpuThrottle, Worker
from dflash_cache.core.groups import process_group
from dflash_cache.core.launch import launch, torchrun_worker
from dflash_cache.core.progress import ProgressSink, Reporter
from dflash_cache.core.threads import worker_threads
from dflash_cache.drafters import DrafterSettings, Family, Objective, Output
from dflash_cache.drafters.settings import describe_windows
from dflash_cache.train.checkpoint import Checkpointer, CpuRng
from dflash_cache.train.config import CACHE_APPEAR_S, TrainConfig, TrainError, drafter_config
from dflash_cache.train.cost import FEW_STEPS, drafter_cost, run_token_budget
from dflash_cache.train.fold import folded_config, save_export
from dflash_cache.train.follow import is_complete, progress_line, refuse_unwritten, wait_for_cache
from dflash_cache.train.loader import CacheLoader
from dflash_cache.train.metrics import MetricsLog, StepWindow, Trace, clock
from dflash_cache.train.optimizer import adamw, clipped_step
from dflash_cache.train.schedule import Schedule
from dflash_cache.train.stream import PackedBatch
from dflash_cache.train.tracking import check_available, open_trackers, parse_report_to
from dflash_cache.train.validate import EXPORT_LAST, BestExport, Validator, ValSet

RUN_JSON = "train.json"
EXPORT = "export"  # the best drafter by validation acceptance; without validation, the last (EXPORT_LAST)


def train_step(objective: Objective, model: torch.nn.Module, embed: torch.Tensor, head: torch.Tensor,
               batch: PackedBatch, generator: torch.Generator, grad_accum: int = 1) -> Output:  # fmt: skip
    """One forward of the drafter family's objective (`Family.bind`, with `reduce`: DFlash: blocks
    from anchors, frozen embedding, drafter, chunked decayed loss) and its backward, scaled for
    `grad_accum` batches a step. Returns the objective's output: the loss, its named terms, which
    block tokens were predicted right, and the blocks."""
    out = objective(model, embed, head, batch, generator)
    (out.loss / grad_accum).backward()
    return out


def anchor_generator(seed: int, epoch: int, batch: int, rank: int) -> torch.Generator:
    """The generator of a batch's anchors: a function of (seed, epoch, batch, rank) alone, so a
    resumed run draws the anchors an uninterrupted one would have."""
    g = torch.Generator()
    key = 0
    for part in (seed, epoch, batch, rank):
        key = (key * 1_000_003 + part) % (1 << 63)
    g.manual_seed(key)
    return g


def run(cfg: TrainConfig, sink: ProgressSink | None = None) -> dict[str, Any]:
    """Train (or resume) a drafter on a cache; returns a summary of the finished run.

    Started together with `dflash extract`, it first waits for the extract to write cache.json.
    """
    reporter = Reporter(sink)
    reporter.start(total=0)
    try:
        recorded = _recorded(cfg.out)
        cfg = cfg.for_run(recorded)  # an unset window: the run's own, or the default for a new one
        if cfg.grad_reduce not in ("fp32", "bf16"):
            raise TrainError(f"--grad-reduce {cfg.grad_reduce!r}: expected fp32 or bf16")
        if cfg.keep_checkpoints < 1:
            raise TrainError(f"--keep-checkpoints {cfg.keep_checkpoints}: keep at least 1")
        if cfg.follow is not False:
            wait_for_cache(cfg.cache, appear=CACHE_APPEAR_S if cfg.follow else 0.0,
                           on_wait=lambda text: reporter.channel.put({"info": text}))  # fmt: skip
        spec = read_spec(cfg.cache)
        if spec.projection is not None:
            Basis.load(cfg.cache, spec)  # the export folds through it: a damaged one is refused before any step
        if cfg.follow is not False:  # waiting for units that nothing writes would never end
            refuse_unwritten(cfg.cache, spec.plan.num_units)
        try:
            dcfg = drafter_config(cfg, spec)
        except SpecError as e:
            raise TrainError(f"the drafter does not fit the cache: {e}") from None
        check_available(parse_report_to(cfg.report_to))  # refused before anything is written
        vset = _val_set(cfg, spec, dcfg, cfg.family())
        if cfg.val_fraction and vset is None:
            reporter.channel.put({"warning": f"--val-fraction {cfg.val_fraction}: the cache plans a single unit, "
                                             "none to hold out; training without validation"})  # fmt: skip
        cfg.out.mkdir(parents=True, exist_ok=True)
        _check_run_dir(cfg, spec, dcfg, recorded)
        # refused here, in one error line; a damaged newest checkpoint is skipped for the one before it
        state = Checkpointer(cfg.out).load(mmap=True, on_damaged=lambda path, e: reporter.channel.put(
            {"warning": skipped_checkpoint(path, e)}))  # fmt: skip
        if state is not None:
            check_resume(state, _world_size(cfg), is_complete(cfg.cache, spec.plan.num_units))
        launch(_worker, (cfg, reporter.channel), gpus=cfg.gpus, procs=cfg.procs)
    finally:
        totals = reporter.stop()
    last = {"export_last": str(cfg.out / EXPORT_LAST)} if vset is not None else {}
    return {"run": str(cfg.out), "export": str(cfg.out / EXPORT), **last,
            **{k: v for k, v in totals.items() if k != "bar"}}  # fmt: skip


def skipped_checkpoint(path: Path, e: DamagedFile, doing: str = "resuming from") -> str:
    """The warning for a checkpoint that does not load and is passed over for an older one."""
    return f"{path} does not load ({e.problem}); {doing} the checkpoint before it (the file is left in place)"


def _val_set(cfg: TrainConfig, spec: CacheSpec, dcfg: Any, family: Family) -> ValSet | None:
    """The validation samples `--val-fraction`/`--val-cache` ask for (checked), or None."""
    return ValSet.choose(cfg.cache, spec, fraction=cfg.val_fraction, val_cache=cfg.val_cache,
                         layer_ids=dcfg.target_layer_ids, final_hidden=family.needs_final_hidden)  # fmt: skip


def _check_run_dir(cfg: TrainConfig, spec: CacheSpec, dcfg: Any, old: dict[str, Any] | None) -> None:
    """A run directory belongs to one cache and one set of hyper-parameters: a rerun resumes it.
    `old` is the train.json the run directory held (`_recorded`), None for a new run."""
    ident = {"cache_created": spec.created, "cache_target": spec.target.weights_fingerprint, **cfg.identity()}
    if old is not None:
        diffs = [f"{k} ({old.get('identity', {}).get(k)!r} vs {v!r})"
                 for k, v in ident.items() if old.get("identity", {}).get(k) != v]  # fmt: skip
        if diffs:
            raise TrainError(f"{cfg.out} holds a run with other settings; use a new --out. Differences: "
                             + "; ".join(diffs))  # fmt: skip
        return
    record = {"identity": ident, "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
              # the drafter's geometry, so that `dflash export` needs the run directory only
              "drafter": cfg.family().serving_config(folded_config(dcfg)),
              # fc's inputs when the cache is projected: the checkpoints' fc reads the projected values
              **({"context_width": dcfg.context_width} if dcfg.context_width else {})}  # fmt: skip
    # every torchrun rank gets here at once: never let one read another's half-written file
    write_atomic(cfg.out / RUN_JSON, json.dumps(record, indent=2) + "\n")


def _recorded(out: Path) -> dict[str, Any] | None:
    """The train.json of a run begun in `out` (the settings it was trained with), or None."""
    path = out / RUN_JSON
    if not path.exists():
        return None
    return read_json(path, f"restore it, or use a new --out (it records the settings {out} was trained with)")


def _world_size(cfg: TrainConfig) -> int:
    """The number of ranks `launch` will start for `cfg` (torchrun's, under torchrun)."""
    worker = torchrun_worker()
    return worker.world_size if worker is not None else len(cfg.gpus) if cfg.gpus else max(1, cfg.procs)


def check_resume(state: dict[str, Any], world_size: int, cache_complete: bool) -> None:
    """Refuse a resume on another number of ranks that cannot re-deal the rest of the checkpoint's
    epoch (see `batching.resume_parts`): a followed epoch 0 of a cache still being extracted, whose
    rest depends on units not committed yet and on the windows the old ranks would have taken."""
    saved = state.get("world_size", len(state["samples"]))  # older checkpoints: one samples entry a rank
    if (saved != world_size and state["batch"] and state["epoch"] == 0 and state.get("follow") is not None
            and not state.get("parts") and not cache_complete):  # fmt: skip
        raise TrainError(f"the checkpoint is {state['batch']} batches into epoch 0, which follows an extraction "
                         f"still in progress on {saved} processes: resume on {saved} (--gpus or --procs) until "
                         "the extraction ends, then on any number")  # fmt: skip


# torch's CPU threads a GPU rank: with one a core, two DDP processes' spinning OpenMP threads fight over
# the cores (BENCHMARKS.md, "CPU threads and the all-reduce"), and one rank's fight the loader's decoders
THREADS_PER_GPU = 4


def _worker(w: Worker, cfg: TrainConfig, channel) -> None:
    with process_group(w):  # the DDP model (in _train) is freed before the group is destroyed
        # Follow mode's rank agreement runs in a thread on its own (CPU) group, apart from DDP's.
        control = dist.new_group(backend="gloo") if w.world_size > 1 else None
        with worker_threads(w, per_gpu=THREADS_PER_GPU):
            _train(w, cfg, channel, control)


@dataclass
class Setup:
    """What one rank trains with; `setup` builds it for the stage and for `dflash bench train`."""

    cfg: TrainConfig
    worker: Worker
    family: Family
    dcfg: Any  # the family's config
    settings: DrafterSettings  # the family's settings: what it is given of `cfg`
    objective: Objective  # the family's, bound to dcfg and settings once, its losses reduced over the ranks
    model: torch.nn.Module
    ddp: torch.nn.Module  # the model under DDP, or the model itself on one rank
    embed: torch.Tensor  # the target's frozen token embedding and LM head, from the cache
    head: torch.Tensor
    opt: torch.optim.Optimizer
    loader: CacheLoader
    schedule: Schedule
    vset: ValSet | None = None  # the validation samples; the loader never reads held-out units

    def done(self) -> bool:
        """Every epoch trained, or `max_steps` reached."""
        cfg = self.cfg
        return self.loader.position.epoch >= cfg.epochs or bool(cfg.max_steps and self.schedule.step >= cfg.max_steps)

    def anchors(self, batch: PackedBatch) -> torch.Generator:
        return anchor_generator(self.cfg.seed, batch.epoch, batch.index, self.worker.rank)


def setup(w: Worker, cfg: TrainConfig, *, control_group: dist.ProcessGroup | None = None,
          on_status=None, on_warning=None, on_wait=None) -> Setup:  # fmt: skip
    """The drafter (the same initial weights on every rank), the frozen embedding and head, DDP,
    the optimizer, the loader of this rank's batches, and the schedule (its length is set once a
    checkpoint has told the loader where it stands). Nothing is written to the run directory."""
    spec = read_spec(cfg.cache)  # once: the loader and validation take it from here
    family, settings = cfg.family(), cfg.drafter_settings()
    dcfg = drafter_config(cfg, spec)
    vset = _val_set(cfg, spec, dcfg, family)
    device, cuda = w.device, w.device.type == "cuda"
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = family.model(dcfg).to(device)
    embed, head = (t.to(device, torch.bfloat16 if cuda else torch.float32) for t in read_frozen(cfg.cache))
    ddp = _data_parallel(model, device, cfg.grad_reduce) if w.world_size > 1 else model
    cost = partial(drafter_cost, block_size=dcfg.block_size, max_anchors=cfg.max_anchors)  # balances DDP steps
    loader = CacheLoader(cfg.cache, spec=spec, layer_ids=dcfg.target_layer_ids,
                         token_budget=run_token_budget(cfg, dcfg, spec, device), seed=cfg.seed, rank=w.rank,
                         world_size=w.world_size, device=device,
                         prefetch=cfg.prefetch, readers=cfg.readers, skip_bad_units=cfg.skip_bad_units,
                         follow=cfg.follow is not False, control_group=control_group, on_status=on_status,
                         on_warning=on_warning, on_wait=on_wait, report_every=cfg.wait_report,
                         batch_cost=cost, units=vset and vset.train_units,
                         final_hidden=family.needs_final_hidden)  # fmt: skip
    opt = adamw(model.parameters(), cfg, fused=cuda)
    return Setup(cfg, w, family, dcfg, settings, family.bind(dcfg, settings, reduce=True), model, ddp, embed, head,
                 opt, loader, Schedule(cfg.lr, cfg.warmup), vset)  # fmt: skip


def optimizer_step(s: Setup) -> None:
    """Clip the gradients, step at the schedule's lr, clear the gradients."""
    lr = s.schedule.next_lr()
    for group in s.opt.param_groups:
        group["lr"] = lr
    clipped_step(s.opt, s.cfg.clip)
    s.opt.zero_grad(set_to_none=True)


def _train(w: Worker, cfg: TrainConfig, channel, control_group) -> None:
    tell = channel.put if w.rank == 0 else None  # progress, warnings and notes: rank 0 speaks for all
    s = setup(w, cfg, control_group=control_group, on_status=tell and (lambda st: tell({"follow": st})),
              on_warning=tell and (lambda text: tell({"warning": text})),
              on_wait=tell and (lambda text: tell({"info": text})))  # fmt: skip
    save = partial(save_export, s.family, s.model, s.dcfg, cache_dir=cfg.cache, spec=s.loader.spec,
                   frozen=(s.embed, s.head))  # fmt: skip
    best = BestExport(cfg.out, save if tell else lambda where: None)
    ckpt = Checkpointer(cfg.out, cfg.keep_checkpoints, every=cfg.save_every, top=(s.schedule, s.loader),
                        states={"model": s.model, "optimizer": s.opt, "rng": CpuRng(),
                                "best_export": best})  # fmt: skip
    state = ckpt.restore()  # rank 0 of the launching process has warned of a damaged newest checkpoint
    s.schedule.total = cfg.epochs * _epoch_tokens(s)  # over tokens: see schedule.py
    resume_step = state and state["step"]
    trackers = open_trackers(cfg.report_to, cfg.out, rank=w.rank, resume_step=resume_step, config=asdict(cfg))
    metrics = MetricsLog(cfg.out, resume_step, rank=w.rank, on_progress=channel.put, sinks=trackers.trackers)
    validator = s.vset and Validator.of(s.vset, cfg, s.family.bind(s.dcfg, s.settings), s.loader)
    trace = Trace(cfg.out, w.rank, w.world_size, s.schedule.step, enabled=cfg.trace)
    if tell:
        _announce(s, tell, ckpt.loaded)
    throttle = GpuThrottle(w.device.type == "cuda")
    window = StepWindow(s.family.flops(s.model), w.device, w.world_size, wait=lambda: s.loader.wait_seconds)

    def validate(step: int) -> None:  # every rank; export/ follows the best validation acceptance
        record = validator.run(s.model, s.embed, s.head, step)
        metrics.log(record)
        best.update(record)
        window.start += record["val_seconds"]  # the next step line's rates leave the validation out

    while not s.done():
        micro = 0  # batches since the last optimizer step
        for batch in s.loader:  # the rest of the epoch, from the loader's position
            micro += 1
            last_micro = micro % cfg.grad_accum == 0
            with nullcontext() if last_micro or s.ddp is s.model else s.ddp.no_sync():
                out = train_step(s.objective, s.ddp, s.embed, s.head, batch, s.anchors(batch), cfg.grad_accum)
            window.add(out, batch.num_tokens)
            s.schedule.consumed(batch.step_tokens)
            trace.batch(batch.epoch, batch.index, batch.sample_index)
            if not last_micro:
                continue
            optimizer_step(s)
            throttle.mark()
            micro, step = 0, s.schedule.step
            trace.step(step, s.model)
            if step % cfg.log_every == 0:
                metrics.log(window.record(step, batch.epoch, s.opt.param_groups[0]["lr"]) | clock(s.schedule.tokens))
            if validator and validator.due(step):
                validate(step)
            ckpt.maybe_save(step)
            if s.done():
                break
        if not s.done():  # the epoch ran out of batches
            if micro:  # batches accumulated since the last step: step on them too
                _sync_grads(s.model, s.ddp)
                optimizer_step(s)
            epoch, ended = s.loader.position.epoch, s.loader.end_epoch()
            metrics.log({"epoch_end": epoch, "step": s.schedule.step, "samples": ended.pop("samples")}
                        | clock(s.schedule.tokens) | ended)  # fmt: skip
    if validator and best.validated != s.schedule.step:
        validate(s.schedule.step)  # the last weights are validated too
    ckpt.save(s.schedule.step)
    s.loader.close()
    metrics.close()
    if validator:
        validator.close()
    best.finish()  # export-last/ (export/ without validation)
    if tell:
        tell({"steps": s.schedule.step})
    if w.world_size > 1:
        dist.barrier()


def _epoch_tokens(s: Setup) -> int:
    """An epoch's tokens for the schedule's length. With held-out units, the plan's tokens times the
    share of units trained on, in a followed epoch and on the finished cache alike, so the schedule
    never depends on when a run (or its resume) started; the held-out units' own token counts are
    not known before they commit. The lr ends within a few thousandths of zero."""
    held = s.vset.units if s.vset is not None else None
    if not held:
        return s.loader.epoch_tokens
    plan = s.loader.spec.plan
    return plan.num_tokens * (plan.num_units - len(held)) // plan.num_units


def _announce(s: Setup, tell, resumed_from: Path | None) -> None:
    """Rank 0's start-up lines: where a resumed run resumed, what it trains on, the bar's length."""
    loader, step = s.loader, s.schedule.step
    if resumed_from is not None:
        where = (f"step {step} (the run is complete)" if s.done() else
                 f"epoch {loader.position.epoch + 1}, batch {loader.position.batch} (step {step})")  # fmt: skip
        tell({"info": f"resumed at {where} from {resumed_from}"})
    else:
        n = len(s.dcfg.windows)
        tell({"info": f"drafter: {s.family.name}, {n} layer{'s' if n > 1 else ''}, {describe_windows(s.dcfg.windows)}"})
    p = loader.position
    if not loader.complete and loader.follows(p.epoch, p.follow):
        tell({"info": "following the extraction: " + progress_line(s.cfg.cache, len(committed_units(s.cfg.cache)),
                                                                   loader.spec.plan.num_units)})  # fmt: skip
    if not loader.complete and not loader.follows(p.epoch, p.follow):
        tell({"warning": f"training on the {len(loader.units.readers)} of {loader.spec.plan.num_units} units "
                         "committed so far (--no-follow)"})  # fmt: skip
    if resumed_from is None and s.cfg.max_steps is None and loader.complete:
        per_epoch = -(-loader.num_batches(0) // s.cfg.grad_accum)
        if s.cfg.epochs * per_epoch < FEW_STEPS:
            epochs = f"{s.cfg.epochs} epoch{'s' if s.cfg.epochs > 1 else ''}"
            tell({"warning": f"this run takes {s.cfg.epochs * per_epoch} optimizer steps ({epochs} of {per_epoch}), "
                             "too few for the drafter to generalise well from a cache this small; more, "
                             "smaller steps do better (e.g. a smaller --token-budget and --max-anchors, more "
                             "--epochs: QUALITY.md)"})  # fmt: skip
    tell({"bar": {"total": s.schedule.total, "completed": s.schedule.tokens}})


def _data_parallel(model: torch.nn.Module, device: torch.device, grad_reduce: str) -> DDP:
    """DDP with the gradients kept as views into its all-reduce buckets, which saves a copy of
    every gradient each step (4 GB for the 8B-shaped drafter) and that much memory."""
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if grad_reduce == "bf16":
        ddp.register_comm_hook(dist.group.WORLD, _mean_in_bf16)
    return ddp


def _mean_in_bf16(group, bucket):  # unannotated: DDP checks hook annotations, and this module's are strings
    """DDP comm hook: average a gradient bucket across ranks, sent as bf16 (half the bytes of fp32).
    torch's own bf16 hook refuses gloo, which the CPU tests run on."""
    grads = bucket.buffer()
    sent = grads.to(torch.bfloat16).div_(dist.get_world_size(group))
    reduced = dist.all_reduce(sent, group=group, async_op=True).get_future()
    return reduced.then(lambda fut: grads.copy_(fut.value()[0]))


def _sync_grads(model: torch.nn.Module, ddp: torch.nn.Module) -> None:
    """Average gradients accumulated under DDP's no_sync (an epoch that ended mid-accumulation)."""
    if ddp is model:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def export(run_dir: Path, out: Path, on_warning: Callable[[str], None] | None = None) -> Path:
    """Write the serving format of a run's latest checkpoint (what vLLM, SGLang and z-lab load for
    DFlash; DeepSpec's layout for DSpark). It needs the run directory only: the cache may have moved
    or been deleted (a family whose layout carries the target's embedding and LM head takes them
    from the cache when it is still there, and leaves them to the serving engine otherwise), unless
    the cache is projected: then its basis folds `fc` back (`fold.py`). A damaged newest checkpoint
    is skipped for the one before it, with `on_warning`."""
    record = read_json(Path(run_dir) / RUN_JSON, "restore it from a copy of the run directory: it records "
                       "the drafter's settings and geometry, which the export needs")  # fmt: skip
    conf = record["config"]
    cfg = TrainConfig(cache=Path(conf["cache"]), out=Path(run_dir), layers=conf["layers"],
                      draft_layers=conf["draft_layers"], block_size=conf["block_size"],
                      drafter=conf.get("drafter", "dflash"))  # fmt: skip
    family = cfg.family()
    if "drafter" in record:
        dcfg = family.from_serving_config(record["drafter"])
        dcfg.context_width = record.get("context_width")
    else:  # a run directory from before train.json recorded the drafter: its geometry is in the cache
        dcfg = drafter_config(cfg, read_spec(cfg.cache))
    ckpt = Checkpointer(run_dir)
    state = ckpt.load(on_damaged=on_warning and (lambda path, e: on_warning(skipped_checkpoint(path, e, "exporting"))))
    if state is None:
        raise TrainError(f"{run_dir} has no checkpoint yet")
    model = family.model(dcfg)
    model.load_state_dict(state["model"])
    frozen = read_frozen(cfg.cache) if (cfg.cache / FROZEN).is_file() else None
    save_export(family, model, dcfg, Path(out), cache_dir=cfg.cache, frozen=frozen)
    return Path(out)

