"""Batch-1 decoding on a GPU beside its bound: what one stream of a target decodes per second, and
what a speculative step costs against a plain one.

    python benchmarks/bench_decode.py --shape smollm2-135m --out decode.json
    python benchmarks/bench_decode.py --families dspark --draft-layers 1,2,5 --skip graphs,steps,profile,eager
    python benchmarks/bench_decode.py --variants "products.stages=3;attention.block_n=64" --set products.slice_k=512

For a random-weight target of a named shape (`dflash_cache.bench.shapes.SHAPES`, which never says its stop
token, so every prompt decodes to --max-new-tokens), one row at a time:

- the target alone through the engine, side by side: the eager layers captured as a CUDA graph,
  the compiled layers captured (the default on a GPU) with cuBLAS's products, with torch's argmax
  for the greedy token, and as they ship, and under other kernel settings (`--variants`, fields of
  `kernels.settings.KernelSettings`); tokens/s with
  the prompts' prefills timed and left out, against the weight-bandwidth bound (bandwidth / weight
  bytes: every decode step reads every weight once);
- the cost of a verify step of B+1 tokens against a one-token step, each a replayed graph, at the
  prompt's context and at longer ones, and for a batch of rows;
- whether a verify step gives each token's logits bit for bit as one-token steps do (the property
  that keeps greedy speculation the target's own decode);
- a speculative step with a random drafter of each family (`--families`) of the target's shape (its
  drafts are rejected, so every step commits one token): its cost over a plain step, which is what
  a drafter's tau must beat (speedup = tau x plain step / speculative step), and whether its output
  is the target alone's; DSpark's also with its greedy Markov step as tensor ops instead of the
  fused kernel (`kernels/markov.py`), and with its draft (the Markov head, slot by
  slot) left eager;
- a profile of the plain and speculative steps: the kernels each launches and their summed time;
  and the floor of that many kernels: a chain of empty ones replayed, launched plainly and with
  programmatic dependent launch, and the step's products alone.
- a prefill of one row at a few prompt lengths, through the layers compiled for any shape and the
  eager ones: the host time a new prompt costs before its first step.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache import drafters  # noqa: E402
from dflash_cache.bench.generate import copy_bandwidth, random_model, weight_bytes  # noqa: E402
from dflash_cache.drafters.dflash.config import DrafterConfig  # noqa: E402
from dflash_cache.drafters.dspark.config import DSparkConfig  # noqa: E402
from dflash_cache.generate import BlockProposer, Engine, Request, StopRule  # noqa: E402
from dflash_cache.generate.targets import SlotTarget  # noqa: E402
from dflash_cache.kernels.products import rows_product  # noqa: E402
from dflash_cache.kernels.settings import DEFAULT_KERNELS, KernelSettings  # noqa: E402

CUDA = torch.device("cuda")


def with_settings(value, settings: str):
    """`value`, a frozen dataclass such as `KernelSettings`, with other settings, such as
    `products.slice_k=512,attention.block_n=128,rope_in_product=0` (a dot into a nested one)."""
    for setting in filter(None, settings.split(",")):
        name, text = setting.split("=")
        value = _replaced(value, name.strip().split("."), text.strip())
    return value


def _replaced(value, path: list[str], text: str):
    head, *rest = path
    names = [f.name for f in dataclasses.fields(value)]
    if head not in names:
        raise SystemExit(f"no setting {head!r} in {type(value).__name__}: {names}")
    old = getattr(value, head)
    if rest:
        new = _replaced(old, rest, text)
    else:
        new = text.lower() in ("1", "true") if isinstance(old, bool) else int(text)
    return dataclasses.replace(value, **{head: new})


@dataclasses.dataclass
class Timed:
    """One timed stream: its seconds, the prefills' share of them, tokens, steps and outputs."""

    seconds: float
    prefill_seconds: float
    tokens: int
    steps: int
    outputs: list

    def rates(self, bound: float) -> dict:
        """tokens/s with the prefills and without them (as z-lab's benchmark times its baseline)."""
        decode = self.seconds - self.prefill_seconds
        return {"tok_s": self.tokens / self.seconds, "ms_per_token": 1e3 * self.seconds / self.tokens,
                "fraction_of_bound": self.tokens / self.seconds / bound, "decode_tok_s": self.tokens / decode,
                "decode_ms_per_token": 1e3 * decode / self.tokens,
                "decode_fraction_of_bound": self.tokens / decode / bound,
                "prefill_ms_per_prompt": 1e3 * self.prefill_seconds / len(self.outputs)}  # fmt: skip


def timed_stream(engine: Engine, prompts: list[list[int]], max_new: int) -> Timed:
    list(engine.stream([Request(prompts[0], 16, key=-1)]))  # warm-up: compilation, the graph's capture
    torch.cuda.synchronize()
    steps, prefill, t0 = engine.steps, engine.prefill_seconds, time.perf_counter()
    done = {c.request.key: c.ids for c in engine.stream(Request(p, max_new, key=i) for i, p in enumerate(prompts))}
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    outputs = [done[i] for i in range(len(prompts))]
    return Timed(seconds, engine.prefill_seconds - prefill, sum(map(len, outputs)), engine.steps - steps, outputs)


def replay_ms(fn, reps: int = 200) -> float:
    """Median time of `fn` captured as a CUDA graph and replayed (5 runs of `reps` replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def step_costs(target: SlotTarget, context: int, block: int, rows: int = 1) -> dict:
    """Replayed-graph time of a one-token step and of a verify step of `block` tokens, `rows` rows
    at position `context`; and whether the verify step's logits equal the one-token steps' bit for
    bit (the verify step's tokens, one a step, from the same cache)."""
    prompt = [tuple(range(3, 3 + context))] * rows
    target.prefill(list(range(rows)), prompt)
    out = {}
    ids = torch.randint(0, 1000, (rows, block), device=CUDA)
    positions = (context + torch.arange(block, device=CUDA)).expand(rows, -1)
    for width in (1, block):
        out[width] = replay_ms(lambda w=width: target.step(ids[:, :w], positions[:, :w]))
    verify = target.step(ids, positions)[0]
    target.prefill(list(range(rows)), prompt)
    singles = torch.cat([target.step(ids[:, k : k + 1], positions[:, k : k + 1])[0] for k in range(block)], 1)
    return {"decode_step_ms": out[1], f"verify_step_{block}_ms": out[block], "verify_over_decode": out[block] / out[1],
            "verify_equals_decode_steps": bool(torch.equal(verify, singles))}  # fmt: skip


def prefill_ms(target: SlotTarget, lengths: list[int], reps: int = 20) -> dict:
    """Median host time of a one-row prefill of each prompt length (it ends reading its logits back,
    as the engine's does), through the layers compiled for any shape and through the eager ones; and
    of prompts of lengths not seen before."""

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        target.prefill([0], [tuple(range(3, 3 + n))])[0].argmax(-1).tolist()
        return 1e3 * (time.perf_counter() - t0)

    out = {}
    layers = target.decoder.layers
    compiled = layers.compiled["dynamic"]
    for name, fns in (("compiled", compiled), ("eager", layers.eager)):
        layers.compiled["dynamic"] = fns
        for n in lengths:
            times = [timed(n) for _ in range(reps + 2)]  # the first two: compilation, allocations
            out[f"{name}, {n} tokens"] = statistics.median(times[2:])
    layers.compiled["dynamic"] = compiled
    unseen = range(lengths[-1] + 1, lengths[-1] + 11)  # prompt lengths not seen before: nothing cached
    out["compiled, a new length"] = statistics.median(timed(n) for n in unseen)
    return out


def kernel_profile(step, steps: int = 20) -> dict:
    """Kernels a call of `step` (compiled, not captured) launches, and their summed GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, [0.0, 0])
        by_name[e.name][0] += e.device_time_total / steps
        by_name[e.name][1] += 1 / steps
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"kernels_per_step": len(kernels) / steps, "kernel_us_per_step": sum(v[0] for v in by_name.values()),
            "kernels_us_count": [[name[:90], round(us, 1), round(n, 1)] for name, (us, n) in ranked]}  # fmt: skip


@torch.inference_mode()
def engine_profile(engine: Engine, context: int) -> dict:
    """`kernel_profile` of the engine's step as it runs them (draft, argmax, bookkeeping), from
    `context`."""
    last, pos, seed = engine.last.clone(), engine.pos.clone(), engine.seed.clone()
    pos.fill_(context)
    return kernel_profile(lambda: engine.device_step.fn(last, pos, seed))


def launch_floor(target: SlotTarget, kernels: int) -> dict:
    """What a step's count of kernels costs with no work in them: a replayed chain of `kernels` one-program
    Triton kernels, each reading what the one before wrote, launched plainly and with programmatic
    dependent launch; and the step's products alone (one row, the layers' own weights), by cuBLAS and by
    the product kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def bump(X, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(X, tl.load(X) + 1)

    x = torch.zeros(1, device=CUDA)
    out = {"kernels": kernels}
    for pdl in (False, True):
        extra = {"launch_pdl": True} if pdl else {}
        ms = replay_ms(lambda p=pdl, e=extra: [bump[(1,)](x, PDL=p, **e) for _ in range(kernels)], reps=50)
        out["pdl_chain_ms" if pdl else "chain_ms"] = ms
        out["pdl_us_per_kernel" if pdl else "us_per_kernel"] = 1e3 * ms / kernels
    layers = target.decoder.layers.layers
    row = torch.randn(1, 1, layers[0].o.shape[1], device=CUDA, dtype=layers[0].o.dtype)

    def products(linear) -> None:  # each layer's four, on one row; the kernel's with nothing fused
        for w in layers:
            h = linear(row, w.qkv)
            linear(h[..., : w.o.shape[1]], w.o)
            g = linear(row, w.gate_up)
            linear(g[..., : w.down.shape[1]], w.down)

    out["products_ms"] = replay_ms(lambda: products(torch.nn.functional.linear), reps=50)
    tiles = target.decoder.layers.kernels.products
    out["kernel_products_ms"] = replay_ms(
        lambda: products(lambda x, w: rows_product(x, w, None, None, None, 0.0, False, tiles)), reps=50)
    out["products"] = 4 * len(layers)
    return out


def plain_profile(target: SlotTarget, context: int) -> dict:
    target.prefill([0], [tuple(range(3, 3 + context))])
    ids, positions = torch.tensor([[5]], device=CUDA), torch.tensor([[context]], device=CUDA)
    return kernel_profile(lambda: target.step(ids, positions))


def speculative(model, family: drafters.Family, cfg: DrafterConfig, prompts: list[list[int]], max_new: int,
                length: int, embed: torch.Tensor, head: torch.Tensor, plain_ms: tuple[float, float], plain: list,
                compiled_draft: bool, kernels: KernelSettings) -> dict:  # fmt: skip
    """A random drafter of `family` speculating for the target: its step against a plain one
    (`plain_ms`: with the prefills and without), and the kernels the step launches. Without
    `kernels.fused_drafts`, DSpark's greedy Markov step runs as tensor ops (a product, then an argmax)."""
    torch.manual_seed(0)
    drafter = family.model(cfg).to(CUDA, torch.bfloat16).eval().requires_grad_(False)
    target = SlotTarget(model, 1, length, cfg.target_layer_ids, compile=True, kernels=kernels)
    proposer = BlockProposer(drafter, embed=embed, head=head, slots=1, length=length, family=family, kernels=kernels)
    if not compiled_draft:
        proposer.draft = family.draft  # the family's own, eager
    engine = Engine(target, StopRule([]), proposer=proposer, kernels=kernels)
    run = timed_stream(engine, prompts, max_new)
    spec_ms = 1e3 * run.seconds / run.steps
    decode_ms = 1e3 * (run.seconds - run.prefill_seconds) / run.steps
    profile = engine_profile(engine, len(prompts[0]))
    return {"draft_layers": cfg.num_hidden_layers, "block_size": cfg.block_size, "tau": run.tokens / run.steps,
            "step_ms": spec_ms, "over_plain_step": spec_ms / plain_ms[0],
            "speedup_at_tau": {t: t * plain_ms[0] / spec_ms for t in (1.6, 2.0, 3.0, 4.0)},
            "decode_step_ms": decode_ms, "decode_over_plain_step": decode_ms / plain_ms[1],
            "decode_speedup_at_tau": {t: t * plain_ms[1] / decode_ms for t in (1.6, 2.0, 3.0, 4.0)},
            "same_as_target": run.outputs == plain, "profile": profile}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--families", default="dflash,dspark", help="drafter families of the speculative steps")
    ap.add_argument("--draft-layers", default="5", help="draft layers of the speculative steps' drafters: 1,2,5")
    ap.add_argument("--skip", default="", help="sections to leave out: graphs, prefill, steps, profile, eager")
    ap.add_argument("--batch-rows", type=int, default=64)
    ap.add_argument("--variants", default="", help="other kernel settings of the target alone's way, ';' "
                    "between variants: attention.split=512;products.stages=3")  # fmt: skip
    ap.add_argument("--set", default="",
                    help="kernel settings of the whole run: products.stages=3,attention.split=512")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernels = with_settings(DEFAULT_KERNELS, args.set)
    model = random_model(args.shape, CUDA)
    bw, weights = copy_bandwidth(CUDA), weight_bytes(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, args.prompt_tokens).tolist() for _ in range(args.prompts)]
    families = [drafters.family(name) for name in args.families.split(",")]
    blocks = sorted({f.default_block_size for f in families})
    length = args.prompt_tokens + args.max_new_tokens + blocks[-1] + 32
    result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "bandwidth_GBps": bw / 1e9, "weight_GB": weights / 1e9, "bound_tok_s": bw / weights,
                    "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                    "max_new_tokens": args.max_new_tokens, "settings": args.set, "engine": {}}  # fmt: skip

    def save() -> None:  # after each section, so that a run stopped part-way keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    skip = set(filter(None, args.skip.split(",")))
    outputs = {}
    # the compiled path (its products through the product kernel) is the plain step always timed
    replace = dataclasses.replace
    ways = {"graphs": (False, kernels), "compiled graphs, cuBLAS products": (True, replace(kernels, kernel_rows=0)),
            "compiled graphs, torch's argmax": (True, replace(kernels, argmax=False)),
            "compiled graphs": (True, kernels)}  # fmt: skip
    if "graphs" in skip:  # the eager layers and cuBLAS's products
        ways = {name: way for name, way in ways.items() if name.startswith("compiled graphs") and "cuBLAS" not in name}
    ways |= {f"compiled graphs, {v}": (True, with_settings(kernels, v)) for v in args.variants.split(";") if v}
    for name, (compile, way_kernels) in ways.items():
        target = SlotTarget(model, 1, length, compile=compile, kernels=way_kernels)
        engine = Engine(target, StopRule([]), kernels=way_kernels)
        run = timed_stream(engine, prompts, args.max_new_tokens)
        if name == "compiled graphs" and "profile" not in skip:  # the engine's own step: argmax, bookkeeping
            result["engine_step_profile"] = engine_profile(engine, args.prompt_tokens)
        outputs[name] = run.outputs
        result["engine"][name] = run.rates(result["bound_tok_s"]) | {"same_as_default": None}
        print(name, json.dumps(result["engine"][name]), flush=True)
        save()
    for name in result["engine"]:
        result["engine"][name]["same_as_default"] = outputs[name] == outputs["compiled graphs"]
    if "graphs" in outputs and "compiled graphs, cuBLAS products" in outputs:
        result["compiled_equal_graphs"] = outputs["compiled graphs"] == outputs["graphs"]
        cublas = outputs["compiled graphs, cuBLAS products"]
        result["kernel_products_same_tokens_as_cublas"] = outputs["compiled graphs"] == cublas

    if "prefill" not in skip:
        result["prefill_ms"] = prefill_ms(SlotTarget(model, 1, length, compile=True, kernels=kernels),
                                          [16, 150, length // 2])  # fmt: skip
        print("prefill", json.dumps(result["prefill_ms"]), flush=True)
        save()

    long = SlotTarget(model, 1, 4096, compile=True, kernels=kernels)
    batch = SlotTarget(model, args.batch_rows, length, compile=True, kernels=kernels)
    result["steps"] = {}
    for block in () if "steps" in skip else (b + 1 for b in blocks):  # a verify step: the anchor and the drafts
        for context in (args.prompt_tokens, 1024, 4096 - block):
            result["steps"][f"{block} tokens, context {context}"] = step_costs(long, context, block)
        result["steps"][f"{block} tokens, {args.batch_rows} rows"] = step_costs(batch, args.prompt_tokens, block,
                                                                                args.batch_rows)  # fmt: skip
        print("steps", json.dumps(result["steps"]), flush=True)
        save()
    del batch, long
    if "profile" not in skip:
        target = SlotTarget(model, 1, length, compile=True, kernels=kernels)
        result["profile"] = plain_profile(target, args.prompt_tokens)
        print("profile", json.dumps(result["profile"]), flush=True)
        result["floor"] = launch_floor(target, round(result["profile"]["kernels_per_step"]))
        print("floor", json.dumps(result["floor"]), flush=True)
        save()

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    plain = result["engine"]["compiled graphs"]
    plain_ms = (plain["ms_per_token"], plain["decode_ms_per_token"])
    result["speculative"] = {}
    for family, n in itertools.product(families, [int(n) for n in args.draft_layers.split(",")]):
        layers = [1, 2, 3, 4, 5][:n] if model.config.num_hidden_layers < 8 else None
        dcfg = DrafterConfig.from_target(model.config.to_dict(), target_layer_ids=layers, mask_token_id=0,
                                         num_draft_layers=n)  # fmt: skip
        cfg = dcfg if family.name == "dflash" else DSparkConfig(**dataclasses.asdict(dcfg) | {
            "block_size": family.default_block_size})
        ways = {"": (True, True)}
        if family.name == "dspark":
            ways[", Markov step as tensor ops"] = (True, False)
            if "eager" not in skip:
                ways[", eager draft"] = (False, True)
        for suffix, (compiled_draft, fused) in ways.items():
            name = f"{family.name}, {n} layers{suffix}"
            way_kernels = kernels if fused else dataclasses.replace(kernels, fused_drafts=False)
            result["speculative"][name] = speculative(model, family, cfg, prompts, args.max_new_tokens, length,
                                                      embed, head, plain_ms, outputs["compiled graphs"],
                                                      compiled_draft, way_kernels)  # fmt: skip
            print("speculative", name, json.dumps(result["speculative"][name]), flush=True)
            save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
