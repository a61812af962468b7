"""The speculative step against the prompt's length at batch 1: what a drafter's step adds to the
target's as the context grows, with full attention and with sliding-window draft layers.

Released drafters lose their speedup on long prompts (z-lab/dflash #66: 200 tok/s from a 500-token
prompt, 24 tok/s from a 64K one). For a random target (a named shape with its positions raised to
the longest context, or a model directory) and a random drafter of each family and window, at each
context, one prompt of that many random tokens:

- the target alone's decode step (its prefill timed apart and left out);
- each drafter's speculative step: its drafts are rejected, so every step commits one token and the
  runs differ only in what a step costs. Its time, what it adds to the plain step, and the speedup a
  tau of 2, 3 or 4 would give at that context (tau x plain step / speculative step);
- each drafter's proposal alone (`draft_ms`): what a window bounds, apart from the target's
  verification of the block, which grows with the context whatever the drafter;

side by side in one run, so a window's step is set against full attention's at every length.

    python benchmarks/bench_context.py --shape qwen3-8b --contexts 1024,8192,32768,65536,131072 --windows full,2048
    python benchmarks/bench_context.py --shape smollm2-135m --contexts 1024,7168 --families dspark --draft-layers 2
    python benchmarks/bench_context.py --target data/tiny-target --contexts 256,1024 --windows full,64  # on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache import drafters  # noqa: E402
from dflash_cache.bench.generate import random_model  # noqa: E402
from dflash_cache.drafters.dflash.config import SLIDING, DrafterConfig  # noqa: E402
from dflash_cache.drafters.dspark.config import DSparkConfig  # noqa: E402
from dflash_cache.generate import BlockProposer, Engine, Request, StopRule, load_model  # noqa: E402
from dflash_cache.generate.targets import SlotTarget  # noqa: E402

TAUS = (2.0, 3.0, 4.0)


def drafter_config(model: torch.nn.Module, family: drafters.Family, layers: int, window: int | None):
    """A drafter of `family` for the target, every layer sliding at `window` (None: full attention)."""
    taps = [1, 2, 3, 4, 5][:layers] if model.config.num_hidden_layers < 8 else None  # a tiny target's layers
    cfg = DrafterConfig.from_target(model.config.to_dict(), target_layer_ids=taps, mask_token_id=0,
                                    num_draft_layers=layers, sliding_window=window,
                                    layer_types=None if window is None else [SLIDING] * layers)  # fmt: skip
    if family.name == "dflash":
        return cfg
    return DSparkConfig(**dataclasses.asdict(cfg) | {"block_size": family.default_block_size})


def decode_ms(engine: Engine, prompt: list[int], max_new: int, device: torch.device) -> tuple[float, list[int]]:
    """Milliseconds a decode step of `prompt` (its prefill left out), and the output: the faster of
    two runs after a first that compiles and captures the step."""
    times = []
    for _ in range(3):
        sync(device)
        steps, prefill, t0 = engine.steps, engine.prefill_seconds, time.perf_counter()
        (done,) = list(engine.stream([Request(prompt, max_new, key=0)]))
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0 - (engine.prefill_seconds - prefill)) / (engine.steps - steps))
    return min(times[1:]), done.ids


def draft_ms(proposer: BlockProposer, context: int, device: torch.device, repeats: int = 20) -> float:
    """Milliseconds the drafter alone takes to propose one block at `context` tokens of context
    (its cache as the decode left it): the part of the speculative step a window bounds, apart from
    the target's verification, which grows with the context whatever the drafter."""
    last = torch.zeros(1, dtype=torch.long, device=device)
    positions = torch.full((1,), context, dtype=torch.long, device=device)

    def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        return logits.argmax(-1), None

    for _ in range(3):
        proposer.propose(last, positions, greedy)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        proposer.propose(last, positions, greedy)
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / repeats


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def at_context(model, context: int, args, device: torch.device) -> dict:
    """The plain step and every drafter's speculative step on one prompt of `context` tokens."""
    prompt = np.random.default_rng(context).integers(0, model.config.vocab_size, context).tolist()
    length = context + args.max_new_tokens + 64
    compile = device.type == "cuda"
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    plain_ms, plain = decode_ms(Engine(SlotTarget(model, 1, length, compile=compile), StopRule([])), prompt,
                                args.max_new_tokens, device)  # fmt: skip
    row = {"context": context, "plain_step_ms": plain_ms, "runs": {}}
    targets: dict[tuple, SlotTarget] = {}  # one a set of tapped layers, shared by the drafters that read them
    for family_name in args.families.split(","):
        family = drafters.family(family_name)
        for layers in map(int, args.draft_layers.split(",")):
            for w in args.windows.split(","):
                window = None if w == "full" else int(w)
                cfg = drafter_config(model, family, layers, window)
                torch.manual_seed(0)
                drafter = family.model(cfg).to(device, model.dtype).eval().requires_grad_(False)
                taps = tuple(cfg.target_layer_ids)
                if taps not in targets:
                    targets[taps] = SlotTarget(model, 1, length, list(taps), compile=compile)
                target = targets[taps]
                proposer = BlockProposer(drafter, embed=embed, head=head, slots=1, length=length, family=family,
                                         compile=compile)  # fmt: skip
                ms, out = decode_ms(Engine(target, StopRule([]), proposer=proposer), prompt, args.max_new_tokens,
                                    device)  # fmt: skip
                row["runs"][f"{family.name}, {layers} layers, {w}"] = {
                    "step_ms": ms, "adds_ms": ms - plain_ms, "over_plain": ms / plain_ms,
                    "draft_ms": draft_ms(proposer, context, device),
                    "speedup_at_tau": {str(t): t * plain_ms / ms for t in TAUS}, "same_as_target": out == plain}
                del drafter, target, proposer
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", help="a random target of this shape (dflash_cache.bench.shapes)")
    ap.add_argument("--target", help="a model directory instead of --shape")
    ap.add_argument("--contexts", default="1024,8192,32768,65536,131072", help="prompt lengths in tokens")
    ap.add_argument("--windows", default="full,2048", help="the drafters' attention: full or a window, each")
    ap.add_argument("--families", default="dflash", help="drafter families: dflash, dspark")
    ap.add_argument("--draft-layers", default="5", help="draft layers, each: 1,2,5")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="decode steps timed at each context")
    ap.add_argument("--out", type=Path, help="the result as JSON, rewritten after each context")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    contexts = [int(c) for c in args.contexts.split(",")]
    positions = max(contexts) + args.max_new_tokens + 64
    model = load_model(args.target, device) if args.target else random_model(args.shape, device, positions)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"shape": args.target or args.shape, "device": name, "torch": torch.__version__,
              "max_new_tokens": args.max_new_tokens, "contexts": []}  # fmt: skip
    with torch.inference_mode():
        for context in contexts:
            row = at_context(model, context, args, device)
            result["contexts"].append(row)
            steps = ", ".join(f"{name} {r['step_ms']:.2f} ms (+{r['adds_ms']:.2f}; drafting {r['draft_ms']:.2f})"
                              for name, r in row["runs"].items())  # fmt: skip
            print(f"context {context:>7,}: plain {row['plain_step_ms']:.2f} ms; {steps}", flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
