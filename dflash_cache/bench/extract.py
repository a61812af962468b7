"""`dflash bench extract`: the full extract path against the bare truncated forward on the same
batches, for a random target of a chosen shape (`shapes.SHAPES`, or a target's own); with `peer`,
the common practice it replaces (one `torch.save` file a sample, loaded one by one) and the
streaming loader's rate on the cache it wrote."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash_cache.bench.config import ExtractBenchConfig
from dflash_cache.bench.measure import PeakRSS, sync, timer
from dflash_cache.bench.shapes import LONG_MAX, QWEN3_8B, BenchError, fixed_lengths, lognormal_lengths, long_lengths
from dflash_cache.extract.config import resolve_forward_token_budget

if TYPE_CHECKING:
    from dflash_cache.cache.projection import Basis
    from dflash_cache.cache.spec import ProjectionInfo


@dataclass
class RandomTarget:
    """A random-weight model of a real shape, cut and tapped like a loaded target."""

    config: dict[str, Any]
    layer_ids: list[int]
    device: torch.device
    final: bool = False  # every layer and the final norm run, for the final hidden state

    def build(self):
        from transformers import AutoConfig, AutoModelForCausalLM

        from dflash_cache.target.taps import TappedTarget

        cfg = AutoConfig.for_model(**self.config)
        if not self.final:  # the layers above the last tap never run
            n = max(self.layer_ids) + 1
            if getattr(cfg, "layer_types", None):  # a hybrid's per-layer kinds, as many as its layers
                cfg.layer_types = list(cfg.layer_types[:n])
            cfg.num_hidden_layers = n
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.eval().requires_grad_(False)
        return TappedTarget(model, self.layer_ids, cfg.num_hidden_layers, self.final)


def synthetic_dataset(lengths: np.ndarray, vocab: int, seed: int = 0):
    """A tokenized dataset (as `rows.encode.tokenize` returns) of random token ids with given lengths."""
    import datasets

    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict({
        "sample_index": np.arange(len(lengths)),
        "input_ids": [rng.integers(0, vocab, size=n, dtype=np.int32) for n in lengths],
        "loss_mask": [np.ones(n, dtype=np.uint8) for n in lengths],
        "length": lengths.astype(np.int32),
    })  # fmt: skip


def bench_spec(config: dict, layer_ids: list[int], plan, storage: str, chunk_tokens: int, final_hidden: bool = False,
               projection=None):  # fmt: skip
    """A cache spec for a synthetic benchmark cache."""
    from dflash_cache.cache.spec import CacheSpec, DataInfo, LayerInfo, PlanInfo, StorageInfo, TargetInfo, TokenizerInfo

    return CacheSpec(
        target=TargetInfo(path="random", revision=None, weights_fingerprint="random", config_digest="random",
                          model_type=config["model_type"], num_layers=config["num_hidden_layers"],
                          hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                          compute_dtype="bfloat16", tied_embeddings=False, config=config),
        layers=LayerInfo(ids=layer_ids, final_hidden=final_hidden),
        storage=StorageInfo(dtype=storage, codec={"name": "zstd", "level": 3, "checksum": True},
                            chunk_tokens=chunk_tokens),
        tokenizer=TokenizerInfo(digest="random", chat_template_digest=None, mask_token_id=config["vocab_size"] - 1,
                                pad_token_id=0, eos_token_ids=[]),
        data=DataInfo(source="synthetic", fingerprint="synthetic", max_length=max(3072, *plan.bucket_edges),
                      truncate=False,
                      num_rows=plan.num_samples, num_rejected=0),
        plan=PlanInfo(bucket_edges=list(plan.bucket_edges), token_budget=plan.token_budget,
                      unit_tokens=plan.unit_tokens, num_units=len(plan.units), num_samples=plan.num_samples,
                      num_tokens=plan.num_tokens, padded_tokens=plan.padded_tokens),
        projection=projection,
    )  # fmt: skip


def _plan_forwards(target, plan, dataset, device: torch.device, chunk: int):
    """(first row in its unit, outputs, real-token index) for every forward of a plan, as the stage
    runs them: a batch that fits `chunk` tokens as one forward, a longer one sample by sample in
    chunks (extract/prefill.py)."""
    from dflash_cache.extract.forward import unit_batches, unit_tokens
    from dflash_cache.extract.prefill import forwards

    for unit in plan.units:
        ids, *_ = unit_tokens(dataset, unit)
        for r0, _, lengths, _, inp, rows in unit_batches(unit, ids, 0, device):
            for a, _, outputs, index in forwards(target, inp, rows, lengths, chunk):
                yield r0 + a, outputs, index


def _steady_rate(plan, marks: dict) -> float:
    """Tokens/s between the first and the last forward's report (the first forward's tokens, a
    batch's or a chunk's, excluded)."""
    return (plan.num_tokens - marks["first_tokens"]) / max(marks["last"] - marks["first"], 1e-9)


def extract(out: Path, *, config: dict = QWEN3_8B, num_tokens: int = ExtractBenchConfig.tokens,
            token_budget: int | None = None, storage: str = "auto", unit_mb: int = 512,
            writers: int = ExtractBenchConfig.writers,
            device: torch.device | None = None, target=None, long: bool = False,
            lengths: np.ndarray | None = None, length: int | None = None, prefill_chunk: int | None = None,
            final_hidden: bool = False, project: int | None = None, project_basis: str = "joint",
            on_phase: Callable[[str], None] = lambda phase: None) -> dict[str, Any]:  # fmt: skip
    """Full extract path vs the bare truncated forward, same model, same batches and chunks, one
    process. `long`: samples of 16K to 32K tokens instead of the chat mix; `length`: every sample
    that many tokens, as many as `num_tokens` holds; `lengths`: these samples instead (e.g. a
    cache's, from `cache_lengths`). A sample longer than `prefill_chunk` (default: none, as the
    stage's) runs in chunks, as the stage runs it, in the bare forward too.
    `final_hidden`: the cache also holds the final hidden state (what DSpark trains on); the bare
    forward then runs every layer. `project`: the cache holds that many projected values a token
    (the stage's fit, timed apart as fit_s, on the random target's own features); the bare forward
    stays the target's alone, so the ratio carries the projection's product. `on_phase` hears each
    phase's name as it starts (a long sample's run takes minutes)."""
    from dflash_cache.cache.spec import default_layer_ids, write_spec
    from dflash_cache.cache.store import committed_units

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_budget = resolve_forward_token_budget(token_budget, device.type == "cuda")  # the stage's default
    chunk = prefill_chunk
    layer_ids = default_layer_ids(config["num_hidden_layers"])
    on_phase("the random target")
    target = target or RandomTarget(config, layer_ids, device, final_hidden).build()
    lengths = _bench_lengths(num_tokens, long, lengths, length)
    dataset = synthetic_dataset(lengths, config["vocab_size"])
    projection = bench_projection(project or "none", project_basis, len(layer_ids), config["hidden_size"])
    row, plan, spec = _bench_cache(config, layer_ids, lengths, storage, token_budget, unit_mb,
                                   LONG_MAX if long else 3072, final_hidden, projection)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    bare_target, fit_s = target, 0.0
    if spec.projection is not None:
        on_phase("the basis fit")
        target, spec, fit_s = _fit(target, spec, plan, dataset, device, chunk, out)
    write_spec(out, spec)
    on_phase("warm-up")
    # warm up kernels on the largest batch (its first two chunks when it runs in chunks: the first
    # without a cache, the second with one), outside the timings
    for _ in itertools.islice(_plan_forwards(target, plan, dataset, device, chunk), 2):
        pass
    # The full path runs first, so any first-use cost of a batch shape is charged to it, not
    # to the bare forward it is compared with.
    times: dict[str, float] = {}
    on_phase("the full extract path")
    written, peak_rss = _time_full(target, plan, dataset, spec, out, device, writers, chunk, times)
    # said as it ends, for a run stopped before its result: a long sample's phases take minutes each
    on_phase(f"the bare forward (the full path took {times['full']:.1f} s: {times['setup']:.1f} s to its first "
             f"forward, {times['drain']:.1f} s of commits after its last)")  # fmt: skip
    with timer(device, times, "bare"):
        for _ in _plan_forwards(bare_target, plan, dataset, device, chunk):
            pass
    on_phase("the forward and copies without writers")
    _time_staged(target, plan, dataset, row, device, chunk, times)
    assert len(committed_units(out)) == len(plan.units)
    return _extract_report(config, lengths, plan, spec, row, chunk=chunk, project=project, fit_s=fit_s, times=times,
                           written=written, peak_rss=peak_rss)  # fmt: skip


def _bench_lengths(num_tokens: int, long: bool, lengths: np.ndarray | None, length: int | None) -> np.ndarray:
    """The samples' lengths: `lengths` as given, else `length` tokens each, else the long or the chat mix."""
    if lengths is None and length is not None:
        lengths = fixed_lengths(length, num_tokens)
    if lengths is None:
        lengths = long_lengths(max(2, num_tokens // 24576)) if long else lognormal_lengths(max(8, num_tokens // 700))
    return np.asarray(lengths, dtype=np.int64)


def _bench_cache(config: dict, layer_ids: list[int], lengths: np.ndarray, storage: str, token_budget: int,
                 unit_mb: int, min_edge: int, final_hidden: bool, projection: ProjectionInfo | None):  # fmt: skip
    """A benchmark cache's row format, plan and spec (a projection's digest not set yet), as the
    stage makes them for these samples: length buckets up to `min_edge` or the longest sample,
    whichever is more; `storage` auto as the stage resolves it."""
    from dflash_cache.cache.spec import default_bucket_edges
    from dflash_cache.cache.unit.layout import RowFormat, chunk_tokens_for
    from dflash_cache.extract.config import resolve_storage
    from dflash_cache.extract.plan import make_plan

    storage = resolve_storage(storage, projection is not None)
    row = RowFormat.planned(storage, len(layer_ids), config["hidden_size"], projection, final=final_hidden)
    longest = int(lengths.max())
    plan = make_plan(lengths, bucket_edges=default_bucket_edges(max(min_edge, longest)),
                     token_budget=max(token_budget, longest),
                     unit_tokens=(unit_mb << 20) // row.hidden_bytes)  # fmt: skip
    spec = bench_spec(config, layer_ids, plan, storage, chunk_tokens_for(row.hidden_bytes), final_hidden, projection)
    return row, plan, spec


def _fit(target, spec, plan, dataset, device: torch.device, chunk: int | None, out: Path):
    """The stage's basis fit on the random target's own features, timed, and the basis saved beside
    the cache: the target projecting through it, the spec naming its digest, and the fit's seconds."""
    from dflash_cache.extract.basis import fit_projection, projecting

    t = time.perf_counter()
    basis, spec = fit_projection(target, spec, plan, dataset, device, chunk)
    sync(device)
    fit_s = time.perf_counter() - t
    spec = dataclasses.replace(spec, projection=dataclasses.replace(spec.projection, digest=basis.save(out)))
    return projecting(target, basis, len(spec.layers.ids)), spec, fit_s


def _time_full(target, plan, dataset, spec, out: Path, device: torch.device, writers: int, chunk: int | None,
               times: dict[str, float]) -> tuple[dict, int]:  # fmt: skip
    """The full extract path, timed into `times` ("full", "setup", "drain"); returns what its reports
    counted (bytes, buffer waits, the first and the last forward's clock) and the peak RSS.

    "steady" runs from the first batch to the last, leaving out two one-time costs a long job
    amortises: pinning the unit buffers (about a second per GiB, setup_s) and committing the units
    still queued after the last forward (drain_s). Back-pressure from slow writers still lands
    inside it: the forward loop waits for a free buffer."""
    from dflash_cache.extract.forward import extract_units

    written = {"bytes": 0, "first": 0.0, "last": 0.0, "wait": 0.0, "first_tokens": 0}

    def report(d: dict) -> None:
        written["bytes"] += d.get("bytes", 0)
        written["wait"] += d.get("buffer_wait_s", 0)
        if "tokens" in d:
            written["last"] = time.perf_counter()
            if not written["first"]:
                written["first"], written["first_tokens"] = written["last"], d["tokens"]

    with PeakRSS() as rss, timer(device, times, "full"):
        t0 = time.perf_counter()
        extract_units(target, list(plan.units), dataset, spec, out, device, report, writers=writers, chunk=chunk)
    times["setup"], times["drain"] = written["first"] - t0, t0 + times["full"] - written["last"]
    return written, rss.peak


def _time_staged(target, plan, dataset, row, device: torch.device, chunk: int | None,
                 times: dict[str, float]) -> None:  # fmt: skip
    """Forward, unpad and the device-to-host copy into one pinned buffer, without compression or
    disk, timed into `times` ("staged"): separates what the copy-out costs from what the writers cost."""
    from dflash_cache.cache.unit.codec import encode_rows
    from dflash_cache.cache.unit.layout import host_rows
    from dflash_cache.extract.forward import copy_out

    buf = host_rows(max(u.num_tokens for u in plan.units), row, pin=device.type == "cuda")
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with timer(device, times, "staged"):
        for r0, outputs, index in _plan_forwards(target, plan, dataset, device, chunk):
            copy_out(stream, buf, r0, r0 + len(index), encode_rows(outputs, index, row))


def _extract_report(config: dict, lengths: np.ndarray, plan, spec, row, *, chunk: int | None, project: int | None,
                    fit_s: float, times: dict[str, float], written: dict, peak_rss: int) -> dict[str, Any]:  # fmt: skip
    """What `extract` reports: the rates, their ratios, and the bytes a token against the raw taps'."""
    from dflash_cache.target.hybrid import linear_attention_kernels

    hybrid = "linear_attention" in config.get("layer_types", ())
    return {
        "model_type": config["model_type"],
        **({f"kernel_{k}": v for k, v in linear_attention_kernels().items()} if hybrid else {}),
        "tokens": plan.num_tokens, "samples": plan.num_samples, "units": len(plan.units),
        "longest": int(lengths.max()), "prefill_chunk": chunk,
        "chunked_samples": int((lengths > chunk).sum()) if chunk else 0,
        "padding": plan.padding_ratio, "storage": spec.storage.dtype, "project": project, "fit_s": fit_s,
        "raw_bf16_bytes_per_token": spec.raw_bf16_bytes_per_token,
        "bare_tok_s": plan.num_tokens / times["bare"], "full_tok_s": plan.num_tokens / times["full"],
        "ratio": times["bare"] / times["full"], "setup_s": times["setup"], "drain_s": times["drain"],
        "steady_ratio": _steady_rate(plan, written) * times["bare"] / plan.num_tokens,
        "staged_ratio": times["bare"] / times["staged"], "buffer_wait_s": written["wait"],
        "bytes_per_token": written["bytes"] / plan.num_tokens,
        "raw_bytes_per_token": row.hidden_bytes + row.final_bytes, "peak_rss_GB": peak_rss / 1e9,
    }  # fmt: skip


def peer_baseline(out: Path, *, config: dict = QWEN3_8B, num_tokens: int = ExtractBenchConfig.tokens,
                  token_budget: int | None = None, device: torch.device | None = None,
                  max_files: int = 2000) -> dict[str, Any]:  # fmt: skip
    """The common practice this project replaces, on the same length mix and batches: the full
    model with `output_hidden_states=True`, one `torch.save` file per sample holding the padded
    tapped layers, then a loader that `torch.load`s the files one by one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cache.cache.spec import default_bucket_edges, default_layer_ids
    from dflash_cache.extract.forward import batch_inputs
    from dflash_cache.extract.plan import make_plan

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_budget = resolve_forward_token_budget(token_budget, device.type == "cuda")  # the stage's default
    layer_ids = default_layer_ids(config["num_hidden_layers"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).eval()
    lengths = lognormal_lengths(max(8, int(num_tokens / 700)))
    plan = make_plan(lengths, bucket_edges=default_bucket_edges(3072), token_budget=token_budget, unit_tokens=1 << 62)
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    n_files = tokens = 0
    with torch.inference_mode(), timer(device, times, "extract"):
        for unit in plan.units:
            for b in unit.batches:
                lens = unit.lengths[b.start : b.stop]
                ids = rng.integers(0, config["vocab_size"], size=int(lens.sum()), dtype=np.int32)
                inp, _ = batch_inputs(ids, lens, b.max_len, 0, device)
                hs = model(input_ids=inp, output_hidden_states=True).hidden_states
                padded = torch.stack([hs[i + 1] for i in layer_ids], dim=1).cpu()  # [b, K, T, H], padding kept
                for j in range(len(lens)):
                    torch.save({"input_ids": inp[j].cpu(), "hidden_states": padded[j].clone()},
                               out / f"{n_files:08d}.pt")  # fmt: skip
                    n_files += 1
                tokens += int(lens.sum())
    nbytes = sum(f.stat().st_size for f in out.glob("*.pt"))
    files = sorted(out.glob("*.pt"))
    order = rng.permutation(len(files))[:max_files]
    loaded = 0
    with timer(device, times, "load"):
        for k in order:
            d = torch.load(files[k], map_location="cpu")
            loaded += d["hidden_states"].shape[1]  # padded tokens per file
            d["hidden_states"].to(device, non_blocking=False)
    return {
        "files": n_files, "tokens": tokens, "extract_tok_s": tokens / times["extract"],
        "bytes_per_token": nbytes / tokens, "loader_padded_tok_s": loaded / times["load"],
    }  # fmt: skip


def loader_rate(cache: Path, *, token_budget: int | None = None, device: torch.device | None = None,
                max_batches: int = 50) -> dict[str, Any]:  # fmt: skip
    """Tokens/s of the streaming loader alone (decode, pinned staging, copy to the device)."""
    from dflash_cache.train.loader import CacheLoader

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    token_budget = resolve_forward_token_budget(token_budget, device.type == "cuda")  # the stage's default
    loader = CacheLoader(cache, token_budget=token_budget, device=device)
    times: dict[str, float] = {}
    tokens = 0
    with timer(device, times, "load"):
        for i, batch in enumerate(loader.epoch(0)):
            tokens += batch.num_tokens
            if i + 1 >= max_batches:
                break
    return {"loader_tok_s": tokens / times["load"], "batches": min(max_batches, loader.num_batches(0))}


def write_random_frozen(cache: Path, config: dict) -> None:
    """A random embedding and LM head of the shape's size beside a benchmark cache, where a real cache
    has the target's: what `bench train` needs to train on it."""
    from dflash_cache.cache.store import write_frozen

    g = torch.Generator().manual_seed(0)
    shape = (config["vocab_size"], config["hidden_size"])
    write_frozen(cache, torch.randn(shape, generator=g).mul_(0.02).bfloat16(),
                 torch.randn(shape, generator=g).mul_(0.02).bfloat16())  # fmt: skip


class RandomStates:
    """A stand-in target whose outputs are random values of the given widths: a shape's tapped
    layers, or a projected cache's stored values a group, then the final hidden state where the
    cache holds it. What a cache for a drafter's step needs, without the cost of a target's forward."""

    def __init__(self, widths: list[int], device: torch.device, seed: int = 0):
        self.widths, self.device = widths, device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, carry=None) -> list[torch.Tensor]:
        return [torch.randn((*input_ids.shape, w), generator=self.generator, device=self.device, dtype=torch.bfloat16)
                for w in self.widths]  # fmt: skip


def bench_projection(project: int | str, basis: str, num_layers: int, hidden_size: int) -> ProjectionInfo | None:
    """The ProjectionInfo `project` asks for, read as `dflash extract --project` reads it (auto: H
    values a token; none, or a rank of every tapped value: None), with the stage's default scaling
    and fit size; BenchError for a rank extract refuses."""
    from dflash_cache.cache.projection import check_projection
    from dflash_cache.cache.spec import ProjectionInfo
    from dflash_cache.extract.config import ExtractConfig, resolve_rank

    rank = resolve_rank(project, basis, num_layers, hidden_size)
    if rank is None:
        return None
    if problem := check_projection(basis, rank, ExtractConfig.project_scaling, num_layers, hidden_size):
        raise BenchError(f"--project: {problem}")
    return ProjectionInfo(basis=basis, rank=rank, scaling=ExtractConfig.project_scaling,
                          fit_tokens=ExtractConfig.project_fit_tokens)  # fmt: skip


def random_basis(projection: ProjectionInfo, num_layers: int, hidden_size: int, device: torch.device) -> Basis:
    """A basis of `projection`'s geometry with random orthonormal rows in each group, in place of
    one fitted on a target's features: the train stage loads and checks it as it does a fitted one."""
    from dflash_cache.cache.projection import Basis

    g = torch.Generator(device).manual_seed(0)
    groups = projection.groups(num_layers)
    width = projection.rank // len(groups)
    weights = []
    for members in groups:
        a = torch.randn(len(members) * hidden_size, width, generator=g, device=device)
        weights.append(torch.linalg.qr(a).Q.T.float().cpu())  # [r_g, |g| H], orthonormal rows
    return Basis(weights, groups)


def random_cache(out: Path, config: dict, lengths: np.ndarray, *, storage: str = "auto", project: int | str = "auto",
                 final_hidden: bool = False, device: torch.device | None = None,
                 writers: int = 2) -> dict[str, Any]:  # fmt: skip
    """A cache of samples of `lengths` tokens at `config`'s shape (its default taps, and the final
    hidden state with `final_hidden`) holding random values, with a random embedding and LM head,
    written through the extract stage's own path (in chunks of the stage's token budget): what
    `bench train --length` measures on. `project` is `dflash extract --project`'s, auto by default
    as there: a projected cache holds random stored values beside a random basis (`random_basis`,
    saved and named in cache.json as the stage does), `--project none` the tapped layers as they
    are; `storage` auto is then fp8 and bf16, as in the stage. Returns its samples and tokens."""
    from dflash_cache.cache.spec import default_layer_ids, write_spec
    from dflash_cache.extract.forward import extract_units

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = np.asarray(lengths, dtype=np.int64)
    layer_ids = default_layer_ids(config["num_hidden_layers"])
    k, h = len(layer_ids), config["hidden_size"]
    projection = bench_projection(project, "joint", k, h)
    budget = resolve_forward_token_budget(None, device.type == "cuda")
    row, plan, spec = _bench_cache(config, layer_ids, lengths, storage, budget, 512, 3072, final_hidden, projection)
    out.mkdir(parents=True, exist_ok=True)
    if projection is not None:  # the basis is stored before cache.json names its digest, as in the stage
        digest = random_basis(projection, k, h, device).save(out)
        spec = dataclasses.replace(spec, projection=dataclasses.replace(projection, digest=digest))
    write_spec(out, spec)
    target = RandomStates([row.width // row.layers] * row.layers + [h] * final_hidden, device)
    extract_units(target, list(plan.units), synthetic_dataset(lengths, config["vocab_size"]), spec, out, device,
                  lambda _: None, writers=writers, chunk=budget)  # fmt: skip
    write_random_frozen(out, config)
    return {"samples": plan.num_samples, "tokens": plan.num_tokens}
