"""The train stage: cache -> streaming loader -> DFlash drafter, with DDP, checkpoints and metrics.

The whole step is `train_step`: blocks from anchors, frozen embedding, drafter, chunked decayed loss.
Everything needed to continue exactly (weights, optimizer, schedule, RNG, loader position) is in
each checkpoint, and the anchors of a batch depend only on (seed, epoch, batch, rank), so a
resumed run sees exactly the batches and anchors an uninterrupted one would have.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_cache.cache.spec import CacheSpec, SpecError, read_spec
from dflash_cache.cache.store import read_frozen
from dflash_cache.devices import GpuThrottle, Worker, launch, torchrun_worker, worker_threads
from dflash_cache.progress import ProgressSink, Reporter
from dflash_cache.train.checkpoint import Checkpointer
from dflash_cache.train.config import TrainConfig, TrainError, drafter_config
from dflash_cache.train.drafter import DFlashDrafter, DrafterConfig, save_serving
from dflash_cache.train.follow import is_complete, wait_for_cache
from dflash_cache.train.loader import Batch, CacheLoader
from dflash_cache.train.metrics import MetricsLog, StepFlops, all_reduce_sums, peak_flops
from dflash_cache.train.objective import (
    Blocks,
    block_metrics,
    chunked_loss,
    drafter_cost,
    make_blocks,
    summarize_metrics,
)

RUN_JSON = "train.json"
EXPORT = "export"


def lr_at(done: float, total: float, warmup: float) -> float:
    """The lr multiplier `done` of `total` tokens into a run: linear warmup over the first `warmup`
    fraction, then cosine decay to zero at `total`."""
    warm = warmup * total
    if done < warm:
        return done / warm
    progress = min(1.0, (done - warm) / max(total - warm, 1e-9))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train_step(model, embed: torch.Tensor, head: torch.Tensor, batch: Batch, dcfg: DrafterConfig, cfg: TrainConfig,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, Blocks]:
    """One forward and backward: blocks from anchors, frozen embedding, drafter, chunked decayed
    loss. Returns the loss, which block tokens were predicted right, and the blocks."""
    ids, mask, offsets = batch.host
    blocks = make_blocks(ids, mask, offsets, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                         max_anchors=cfg.max_anchors, generator=generator, gamma=cfg.gamma)  # fmt: skip
    # Only weighted slots reach the LM head: never slot 0 (the given anchor), nor unsupervised ones.
    scored = blocks.weights.flatten().nonzero().squeeze(1).to(embed.device, non_blocking=True)
    blocks = blocks.to(embed.device, non_blocking=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if embed.is_cuda else nullcontext()
    with autocast:
        block_embeds = torch.nn.functional.embedding(blocks.input_ids.flatten(), embed)
        hidden = model(block_embeds, batch.context.to(embed.dtype), blocks.layout)
        loss, hits = chunked_loss(hidden[scored], head, blocks.labels.flatten()[scored],
                                  blocks.weights.flatten()[scored], cfg.loss_chunk)  # fmt: skip
    (loss / cfg.grad_accum).backward()
    correct = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=hits.device).index_copy_(0, scored, hits)
    return loss.detach(), correct.view_as(blocks.labels), blocks


def _anchor_generator(seed: int, epoch: int, batch: int, rank: int) -> torch.Generator:
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
        if cfg.grad_reduce not in ("fp32", "bf16"):
            raise TrainError(f"--grad-reduce {cfg.grad_reduce!r}: expected fp32 or bf16")
        if cfg.follow:
            wait_for_cache(cfg.cache, on_wait=lambda: reporter.channel.put(
                {"warning": f"waiting for `dflash extract` to write {cfg.cache}/cache.json"}))  # fmt: skip
        spec = read_spec(cfg.cache)
        try:
            dcfg = drafter_config(cfg, spec)
        except SpecError as e:
            raise TrainError(f"the drafter does not fit the cache: {e}") from None
        cfg.out.mkdir(parents=True, exist_ok=True)
        _check_run_dir(cfg, spec, dcfg)
        if (state := Checkpointer(cfg.out).load(mmap=True)) is not None:  # refused here: one error line
            _resume_parts(state, _world_size(cfg), is_complete(cfg.cache, spec.plan.num_units))
        launch(_worker, (cfg, reporter.channel), gpus=cfg.gpus, procs=cfg.procs)
    finally:
        totals = reporter.stop()
    return {"run": str(cfg.out), "export": str(cfg.out / EXPORT), **{k: v for k, v in totals.items() if k != "bar"}}


def _check_run_dir(cfg: TrainConfig, spec: CacheSpec, dcfg: DrafterConfig) -> None:
    """A run directory belongs to one cache and one set of hyper-parameters: a rerun resumes it."""
    ident = {"cache_created": spec.created, "cache_target": spec.target.weights_fingerprint, **cfg.identity()}
    path = cfg.out / RUN_JSON
    if path.exists():
        old = json.loads(path.read_text())
        diffs = [f"{k} ({old.get('identity', {}).get(k)!r} vs {v!r})"
                 for k, v in ident.items() if old.get("identity", {}).get(k) != v]  # fmt: skip
        if diffs:
            raise TrainError(f"{cfg.out} holds a run with other settings; use a new --out. Differences: "
                             + "; ".join(diffs))  # fmt: skip
        return
    record = {"identity": ident, "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
              # the drafter's geometry, so that `dflash export` needs the run directory only
              "drafter": dcfg.to_serving_config()}  # fmt: skip
    # every torchrun rank gets here at once: never let one read another's half-written file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def _world_size(cfg: TrainConfig) -> int:
    """The number of ranks `launch` will start for `cfg` (torchrun's, under torchrun)."""
    worker = torchrun_worker()
    return worker.world_size if worker is not None else len(cfg.gpus) if cfg.gpus else max(1, cfg.procs)


def _resume_parts(state: dict[str, Any], world_size: int, cache_complete: bool) -> list[list[int]]:
    """The earlier parts of the checkpoint's epoch that ran on other world sizes, as
    [world size, batches per rank done at its end] (see `loader.rest_of_epoch`).

    On the checkpoint's own world size they are the checkpoint's (none for a run that never
    changed size: the epoch's own plan, bitwise as before). On another world size mid-epoch,
    the part that ran so far is added, and the rest of the epoch is dealt to the new ranks. Only
    a followed epoch 0 of a cache still being extracted cannot be re-dealt: its rest depends on
    units not committed yet, and on the windows the old ranks would have taken.
    """
    parts = [list(p) for p in state.get("parts", [])]
    saved = state.get("world_size", len(state["samples"]))  # older checkpoints: one samples entry a rank
    if saved == world_size or state["batch"] == 0:
        return parts
    if state["epoch"] == 0 and state.get("follow") is not None and not parts and not cache_complete:
        raise TrainError(f"the checkpoint is {state['batch']} batches into epoch 0, which follows an extraction "
                         f"still in progress on {saved} processes: resume on {saved} (--gpus or --procs) until "
                         "the extraction ends, then on any number")  # fmt: skip
    return [*parts, [saved, state["batch"]]]


def _worker(w: Worker, cfg: TrainConfig, channel) -> None:
    distributed = w.world_size > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if w.device.type == "cuda" else "gloo", rank=w.rank, world_size=w.world_size)
    try:
        # Follow mode's rank agreement runs in a thread on its own (CPU) group, apart from DDP's.
        control = dist.new_group(backend="gloo") if distributed else None
        # 4 threads a GPU: two H200s trained 1.77x one with 32 threads a process, 1.875x with 4 (BENCHMARKS.md)
        with worker_threads(w, per_gpu=4):
            _train(w, cfg, channel, control)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(w: Worker, cfg: TrainConfig, channel, control_group) -> None:
    spec = read_spec(cfg.cache)
    dcfg = drafter_config(cfg, spec)
    device, cuda = w.device, w.device.type == "cuda"
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = DFlashDrafter(dcfg).to(device)
    embed, head = (t.to(device, torch.bfloat16 if cuda else torch.float32) for t in read_frozen(cfg.cache))
    ddp = _data_parallel(model, device, cfg.grad_reduce) if w.world_size > 1 else model
    loader = CacheLoader(
        cfg.cache,
        layer_ids=dcfg.target_layer_ids,
        # 8192 context tokens x 512 anchors fits an H200 with the default 8B-shaped drafter, even
        # for the batch of most blocks (short samples: 100.6 GB peak); 4096 ran at 51% MFU, 8192 at
        # 53% (BENCHMARKS.md, session 6).
        token_budget=cfg.token_budget or (8192 if cuda else 2048),
        seed=cfg.seed,
        rank=w.rank,
        world_size=w.world_size,
        device=device,
        prefetch=cfg.prefetch,
        readers=cfg.readers,
        skip_bad_units=cfg.skip_bad_units,
        follow=cfg.follow,
        control_group=control_group,
        on_status=(lambda s: channel.put({"follow": s})) if w.rank == 0 else None,
        batch_cost=partial(drafter_cost, block_size=dcfg.block_size, max_anchors=cfg.max_anchors),
    )
    ckpt = Checkpointer(cfg.out)
    state = ckpt.load()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=cuda)  # fmt: skip
    step, epoch, start_batch, samples_this_epoch, tokens_done, follow_state = 0, 0, 0, 0, 0, None
    parts: list[list[int]] = []  # the current epoch's earlier parts on other world sizes
    if state is not None:
        if "tokens" not in state:
            raise TrainError(f"{cfg.out} holds a checkpoint from an older dflash-cache (a step-based schedule); "
                             "use a new --out")  # fmt: skip
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        step, epoch, start_batch, tokens_done = state["step"], state["epoch"], state["batch"], state["tokens"]
        samples_this_epoch = state["samples"][w.rank] if w.rank < len(state["samples"]) else 0
        follow_state = state.get("follow")
        parts = _resume_parts(state, w.world_size, loader.complete)
        if len(state["samples"]) != w.world_size:  # re-dealt: rank 0 carries the old ranks' count
            samples_this_epoch = sum(state["samples"]) if w.rank == 0 else 0
    # The schedule runs over tokens, not steps: its length is known from cache.json before the
    # cache is complete, so a followed run and one on the finished cache get the same schedule.
    following = loader.follows(epoch, follow_state)
    total_tokens = cfg.epochs * (spec.plan.num_tokens if following else loader.table.num_tokens)
    if w.rank == 0:
        if loader.dropped:
            channel.put({"warning": f"skipping bad units: {'; '.join(loader.dropped)}"})
        if not loader.complete and not following:
            channel.put({"warning": f"training on the {len(loader.readers)} of {spec.plan.num_units} units committed "
                                    "so far (--no-follow)"})  # fmt: skip
        channel.put({"bar": {"total": total_tokens, "completed": tokens_done}})
    metrics = MetricsLog(cfg.out, state["step"] if state else None) if w.rank == 0 else None
    trace = _Trace(cfg.out, w.rank, w.world_size, step) if cfg.trace else None
    throttle = GpuThrottle(cuda)
    sums: dict[str, torch.Tensor] = {}
    flops, peak = StepFlops(model), peak_flops(device)
    window = _new_window(loader)
    warned = len(loader.dropped)
    position, step_start = (epoch, start_batch), tokens_done
    while epoch < cfg.epochs and not (cfg.max_steps and step >= cfg.max_steps):
        micro = 0
        for i, batch in enumerate(loader.epoch(epoch, start_batch, follow_state, parts), start=start_batch):
            micro += 1
            last_micro = micro % cfg.grad_accum == 0
            with nullcontext() if last_micro or ddp is model else ddp.no_sync():
                loss, correct, blocks = train_step(ddp, embed, head, batch, dcfg, cfg,
                                                   _anchor_generator(cfg.seed, epoch, i, w.rank))  # fmt: skip
            for k, v in block_metrics(correct, blocks.weights).items():
                sums[k] = sums.get(k, 0) + v.detach()
            window["loss"] += loss  # stays on the device: no host sync per step
            window["n"] += 1
            window["tokens"] += batch.num_tokens
            window["blocks"] += blocks.layout.num_blocks
            window["anchors"] += blocks.layout.block_anchor.sum()  # on the device: summed at log time
            samples_this_epoch += len(batch.sample_index)
            tokens_done += batch.step_tokens
            position = (epoch, i + 1)
            if trace is not None:
                trace.batch(epoch, i, batch.sample_index.tolist())
            if not last_micro:
                continue
            _optimizer_step(model, opt, cfg, lr_at((step_start + tokens_done) / 2, total_tokens, cfg.warmup))
            throttle.mark()
            step += 1
            micro, step_start = 0, tokens_done
            if trace is not None:
                trace.step(step, model)
            if step % cfg.log_every == 0:
                record = _log_record(step, epoch, opt, sums, window, loader, w.world_size, device, flops, peak)
                record |= _clock(tokens_done)
                if w.rank == 0:
                    metrics.write(record)
                    bar = {"completed": tokens_done, "loss": record["loss"], "accept": record["accept_len"],
                           "tok_s": record["tokens_per_s"], "wait": record["loader_wait_s"], "epoch": epoch,
                           "step": step, "tflops": record["tflops_per_gpu"], "mfu": record.get("mfu")}  # fmt: skip
                    channel.put({"bar": bar})
                    if len(loader.dropped) > warned:  # bad units found in a followed extraction
                        channel.put({"warning": f"skipping bad units: {'; '.join(loader.dropped[warned:])}"})
                        warned = len(loader.dropped)
                sums = {}
                window = _new_window(loader)
            if step % cfg.save_every == 0:
                _save(ckpt, w, model, opt, step, position, samples_this_epoch, tokens_done,
                      follow_state if parts else loader.follow_state(), parts)  # fmt: skip
            if cfg.max_steps and step >= cfg.max_steps:
                break
        else:  # the epoch ran out of batches
            if micro:  # batches accumulated since the last step: step on them too
                _sync_grads(model, ddp)
                _optimizer_step(model, opt, cfg, lr_at((step_start + tokens_done) / 2, total_tokens, cfg.warmup))
                step, micro, step_start = step + 1, 0, tokens_done
            consumed = int(_sum_ranks(samples_this_epoch, device))
            if metrics is not None:
                record = {"epoch_end": epoch, "step": step, "samples": consumed} | _clock(tokens_done)
                if (followed := loader.follow_state()) is not None:
                    record |= {"followed_windows": len(followed["windows"]), "loader_wait_s": loader.wait_seconds}
                metrics.write(record)
            samples_this_epoch, start_batch, follow_state, parts = 0, 0, None, []
            epoch += 1
            position = (epoch, 0)
    _save(ckpt, w, model, opt, step, position, samples_this_epoch, tokens_done,
          (follow_state if parts else loader.follow_state()) if position[1] else None, parts)  # fmt: skip
    loader.close()
    if w.rank == 0:
        save_serving(model, dcfg, cfg.out / EXPORT)
        channel.put({"steps": step})
    if w.world_size > 1:
        dist.barrier()


def _optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, scale: float) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    for group in opt.param_groups:
        group["lr"] = cfg.lr * scale
    opt.step()
    opt.zero_grad(set_to_none=True)


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


class _Trace:
    """`trace/rank{r}.jsonl`: which samples each batch held, and a checksum of the weights after
    each step (replicas must agree). Lines past a resumed checkpoint are dropped, also (by rank 0)
    from the files of ranks a run resumed on fewer ranks no longer has."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, resume_step: int):
        self.path = Path(run_dir) / "trace" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(exist_ok=True)
        _trim_trace(self.path, resume_step)
        if rank == 0:
            for path in self.path.parent.glob("rank*.jsonl"):
                if path.stem[4:].isdigit() and int(path.stem[4:]) >= world_size:
                    _trim_trace(path, resume_step)
        self.pending: list[str] = []

    def batch(self, epoch: int, index: int, samples: list[int]) -> None:
        self.pending.append(json.dumps({"epoch": epoch, "batch": index, "samples": samples}))

    def step(self, step: int, model: torch.nn.Module) -> None:
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        self.pending.append(json.dumps({"step": step, "checksum": checksum}))
        with open(self.path, "a") as f:
            f.write("".join(x + "\n" for x in self.pending))
        self.pending = []


def _trim_trace(path: Path, resume_step: int) -> None:
    """Keep a trace's lines up to `resume_step`'s step line (none for a fresh run)."""
    lines = path.read_text().splitlines() if path.exists() and resume_step > 0 else []
    kept = []
    for line in lines:  # a step's batch lines are written together with its step line
        kept.append(line)
        if json.loads(line).get("step") == resume_step:
            break
    path.write_text("".join(x + "\n" for x in kept))


def _sum_ranks(x: float, device: torch.device) -> float:
    """The sum of `x` over the ranks (float64: exact for counts)."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())


def _clock(tokens_done: int) -> dict[str, float]:
    """Where the run stands in tokens (all ranks, the schedule's count) and wall time, so rates over
    any span of a run, resumed or not, follow from two lines."""
    return {"tokens": tokens_done, "time": time.time()}


def _new_window(loader: CacheLoader) -> dict[str, Any]:
    """Counters of the steps since the last metrics line."""
    return {"loss": 0.0, "n": 0, "tokens": 0, "blocks": 0, "anchors": 0, "wait": loader.wait_seconds,
            "t": time.perf_counter()}  # fmt: skip


def _log_record(step, epoch, opt, sums, window, loader, world, device, flops: StepFlops,
                peak: float | None) -> dict[str, Any]:  # fmt: skip
    sums = all_reduce_sums({k: v.clone() for k, v in sums.items()})
    stats = summarize_metrics(sums)
    elapsed = max(time.perf_counter() - window["t"], 1e-9)
    loss = _sum_ranks(float(window["loss"]) / max(1, window["n"]), device) / world
    useful = _sum_ranks(flops(window["blocks"], window["tokens"], int(window["anchors"])), device)
    record = {
        "step": step,
        "epoch": epoch,
        "loss": loss,
        "lr": opt.param_groups[0]["lr"],
        "slot_acc": stats["slot_acc"],
        "accept_len": stats["accept_len"],
        "tokens_per_s": _sum_ranks(window["tokens"], device) / elapsed,  # all ranks' context tokens
        "tflops_per_gpu": useful / elapsed / world / 1e12,  # useful FLOPs only (StepFlops)
        "loader_wait_s": loader.wait_seconds - window["wait"],
    }
    if peak is not None:
        record["mfu"] = useful / elapsed / world / peak
    return record


def _save(ckpt: Checkpointer, w: Worker, model, opt, step: int, position: tuple[int, int], samples: int,
          tokens: int, follow: dict | None, parts: list[list[int]]) -> None:  # fmt: skip
    """Everything to continue exactly: weights, optimizer, RNG, loader position (epoch, batches
    done), samples per rank this epoch, tokens done (the schedule), a followed epoch's windows,
    and, to continue on another number of ranks, the world size and the epoch's earlier parts."""
    per_rank = [samples] * w.world_size
    if w.world_size > 1:
        dist.all_gather_object(per_rank, samples)
    if w.rank == 0:
        ckpt.save(step, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": {"cpu": torch.get_rng_state()},
            "step": step, "epoch": position[0], "batch": position[1], "samples": per_rank, "tokens": tokens,
            "follow": follow, "world_size": w.world_size, "parts": parts,
        })  # fmt: skip
    if w.world_size > 1:
        dist.barrier()


def export(run_dir: Path, out: Path) -> Path:
    """Write the serving format of a run's latest checkpoint (what vLLM, SGLang and z-lab load). It
    needs the run directory only: the cache may have moved or been deleted."""
    record = json.loads((Path(run_dir) / RUN_JSON).read_text())
    if "drafter" in record:
        dcfg = DrafterConfig.from_serving_config(record["drafter"])
    else:  # a run directory from before train.json recorded the drafter: its geometry is in the cache
        conf = record["config"]
        cfg = TrainConfig(cache=Path(conf["cache"]), out=Path(run_dir), layers=conf["layers"],
                          draft_layers=conf["draft_layers"], block_size=conf["block_size"])  # fmt: skip
        dcfg = drafter_config(cfg, read_spec(cfg.cache))
    state = Checkpointer(run_dir).load()
    if state is None:
        raise TrainError(f"{run_dir} has no checkpoint yet")
    model = DFlashDrafter(dcfg)
    model.load_state_dict(state["model"])
    save_serving(model, dcfg, Path(out))
    return Path(out)

