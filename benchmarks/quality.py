"""Drafter quality on real text: tau of untrained, bf16-cache and fp8-cache drafters on a code target.

One command runs the real pipeline on a target made by ``data/make_code_target.py``:

1. ``regen``: the target's greedy continuations of code prefixes from its training modules;
2. ``extract`` with ``--storage bf16``, and again with ``fp8`` (each with the default projection,
   ``--project auto``; ``benchmarks/projection_study.py`` sets projections against each other);
3. ``train`` on each cache (the default recipe: 5 draft layers, 6 epochs, lr 6e-4, 512 anchors);
4. ``eval`` (greedy, B = 16) on prefixes of the held-out modules, for an untrained drafter of the
   same shape, the bf16 drafter and the fp8 drafter, with acceptance histograms;
5. the prompt-lookup (n-gram) drafter on the same prompts and the same greedy outputs
   (``dflash_cache/generate/lookup.py``), a reference point that needs no training.

``--tasks bf16,dspark`` adds a DSpark drafter (``dflash train --drafter dspark``, its defaults:
block 7, Markov and confidence heads, CE + L1 + BCE) trained on the very bf16 cache the DFlash
drafter trains on (extracted with ``--final-hidden`` for it) for the same steps, and evaluated the
same way; the report sets its tau against DFlash's. ``--block-size`` sets both families' blocks.

Usage::

    python benchmarks/quality.py --size cpu                 # data/code-target, data/code_*.jsonl
    python data/make_code_target.py --size gpu --out code-target-gpu
    python benchmarks/quality.py --size gpu --target code-target-gpu --jobs 3

``--jobs 3`` runs the three parts at once as processes (bf16: extract, train, eval; fp8: the
same; untrained: eval), which a GPU leaves room for at these sizes. Everything goes to ``--out``
(default ``quality-SIZE``): ``quality.json`` holds every figure, the settings and the time each
stage took. Rerunning resumes each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TASKS = ("bf16", "fp8", "untrained", "dspark")
DEFAULT_TASKS = "bf16,fp8,untrained"


def demo_config(args: argparse.Namespace):
    """The pipeline's settings: the demo's steps, the default training recipe unless --recipe demo."""
    import torch

    from dflash_cache.pipelines.config import DemoConfig

    target = Path(args.target or (ROOT / "data" / "code-target" if args.size == "cpu" else "code-target-gpu"))
    data_dir = ROOT / "data" if args.size == "cpu" and args.target is None else target
    cuda = torch.cuda.is_available()
    cfg = DemoConfig(out=Path(args.out or f"quality-{args.size}"), target=target, data=data_dir / "code_train.jsonl",
                     prompts=data_dir / "code_prompts.jsonl", regen_tokens=args.regen_tokens,
                     rows=args.rows, regen_batch=args.regen_batch or (512 if args.size == "gpu" else 64),
                     max_new_tokens=args.max_new_tokens, eval_prompts=args.prompts, gpus=[0] if cuda else None,
                     baseline=False, seed=args.seed)  # fmt: skip
    if args.recipe == "default":
        cfg = default_recipe(cfg)
    return replace(cfg, epochs=args.epochs or cfg.epochs)


def default_recipe(cfg):
    """`cfg` (a DemoConfig) with dflash train's own recipe instead of the demo's."""
    from dflash_cache.train.config import TrainConfig

    d = TrainConfig(cache=Path(), out=Path())
    return replace(cfg, epochs=d.epochs, lr=d.lr, draft_layers=d.draft_layers, max_anchors=d.max_anchors,
                   token_budget=d.token_budget)  # fmt: skip


def run_tasks(out: Path, names: list[str], argv: list[str]) -> list[dict]:
    """Run each named part as a process of its own (`argv` + `--task NAME`; they share the GPU or
    the cores), each logging to OUT/task-NAME.log and leaving its result in OUT/task-NAME.json. A
    failed part ends the others (some wait on another's output); the results, in `names` order."""
    procs = []
    for name in names:
        log = open(out / f"task-{name}.log", "w")
        procs.append((name, subprocess.Popen([*argv, "--task", name], stdout=log, stderr=subprocess.STDOUT), log))
    while any(proc.poll() is None for _, proc, _ in procs):
        failed = [(name, log.name) for name, proc, log in procs if proc.poll() not in (None, 0)]
        if failed:
            for _, proc, _ in procs:
                proc.terminate()
            raise SystemExit("failed: " + ", ".join(f"{n} (see {f})" for n, f in failed))
        time.sleep(1)
    failed = [(name, log.name) for name, proc, log in procs if proc.returncode != 0]
    if failed:
        raise SystemExit("failed: " + ", ".join(f"{n} (see {f})" for n, f in failed))
    return [json.loads((out / f"task-{name}.json").read_text()) for name in names]


def train_config(cfg, cache: Path, run_dir: Path, drafter: str, block_size: int | None):
    """The demo's train settings for one drafter family (its defaults unless --block-size)."""
    from dflash_cache.pipelines import demo

    return replace(demo.train_config(cfg, cache, run_dir), drafter=drafter, block_size=block_size)


def task(cfg, name: str, regen_path: Path, block_size: int | None = None, final_hidden: bool = False) -> dict:
    """One of the run's independent parts: "bf16" or "fp8" (extract with that storage, train,
    evaluate), "untrained" (evaluate a drafter of the trained ones' shape at its seeded initial
    weights; it needs only the bf16 cache's cache.json, written when that extraction starts), or
    "dspark" (a DSpark drafter trained on the bf16 cache, following its extraction, and evaluated).
    `final_hidden`: the bf16 cache holds the final hidden state (a dspark task trains on it)."""
    from dflash_cache.pipelines import demo

    times: dict[str, float] = {}
    if name in ("untrained", "dspark"):
        cache = cfg.out / "cache-bf16"
        while not (cache / "cache.json").exists():  # the bf16 task, running at once, is starting it
            time.sleep(1)
        t = time.perf_counter()
        if name == "untrained":
            drafter = demo.untrained_drafter(train_config(cfg, cache, cfg.out / "run-bf16", "dflash", block_size),
                                             cfg.out / "untrained")  # fmt: skip
            result = demo.evaluate_drafter(cfg, drafter).to_dict()
            return {"results": {name: result}, "times": {"eval_untrained": time.perf_counter() - t}, "caches": {}}
        # trains as the bf16 extraction commits units (follow mode), then evaluates
        export = demo.train_drafter(train_config(cfg, cache, cfg.out / "run-dspark", "dspark", block_size))
        times["train_dspark"] = time.perf_counter() - t
        t = time.perf_counter()
        result = demo.evaluate_drafter(cfg, export).to_dict()
        times["eval_dspark"] = time.perf_counter() - t
        result["training"] = last_metrics(cfg.out / "run-dspark" / "metrics.jsonl")
        return {"results": {name: result}, "times": times, "caches": {}}
    t = time.perf_counter()
    cache, ex = demo.extract_cache(cfg, regen_path, name, final_hidden=final_hidden and name == "bf16")
    times[f"extract_{name}"] = time.perf_counter() - t
    t = time.perf_counter()
    export = demo.train_drafter(train_config(cfg, cache, cfg.out / f"run-{name}", "dflash", block_size))
    times[f"train_{name}"] = time.perf_counter() - t
    t = time.perf_counter()
    result = demo.evaluate_drafter(cfg, export).to_dict()
    times[f"eval_{name}"] = time.perf_counter() - t
    cache_bytes = sum(f.stat().st_size for f in (cache / "units").rglob("*") if f.is_file())
    result["training"] = last_metrics(cfg.out / f"run-{name}" / "metrics.jsonl")
    return {"results": {name: result}, "times": times,
            "caches": {name: {"samples": ex["samples"], "tokens": ex["tokens"], "bytes": cache_bytes}}}  # fmt: skip


def last_metrics(path: Path) -> dict:
    """The run's last logged step: loss, per-slot accuracy and the acceptance length they imply on
    the training batches, to set against the held-out tau (a gap is generalisation, not fit)."""
    last: dict = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            last = rec
    keys = ("step", "epoch", "loss", "accept_len", "slot_acc", "ce", "l1", "tau_prob")
    return {k: last[k] for k in keys if k in last}


def lookup_result(cfg, outputs: list[list[int]], block_size: int) -> dict:
    """The prompt-lookup drafter's acceptance on the same prompts and greedy outputs."""
    from dflash_cache.eval import metrics
    from dflash_cache.generate import lookup
    from dflash_cache.generate.dialogue import load_prompts
    from dflash_cache.target.load import load_tokenizer

    prompts = load_prompts(cfg.prompts, load_tokenizer(str(cfg.target)), cfg.eval_prompts)
    per_prompt = [lookup.acceptance_lengths(p, o, block_size=block_size) for p, o in zip(prompts, outputs, strict=True)]
    flat = [n for ls in per_prompt for n in ls]
    return {"tau": metrics.tau(flat), "tau_per_prompt": metrics.tau_per_prompt(per_prompt),
            "histogram": metrics.histogram(flat, block_size), "steps": len(flat)}  # fmt: skip


def report(summary: dict) -> str:
    rows = summary["results"]
    names = [n for n in ("untrained", "bf16", "fp8", "dspark", "lookup") if n in rows]
    lines = [f"{'drafter':<10} {'tau/prompt':>10} {'tau pooled':>10} {'steps':>6}  acceptance histogram (1..B)"]
    for n in names:
        r = rows[n]
        lines.append(f"{n:<10} {r['tau_per_prompt']:>10.3f} {r['tau']:>10.3f} {r['steps']:>6}  "
                     + " ".join(str(c) for c in r["histogram"]))  # fmt: skip
    for n in ("bf16", "fp8", "dspark"):
        if rows.get(n, {}).get("training"):
            m = rows[n]["training"]
            lines.append(f"{n} training, last step {m.get('step')}: loss {m.get('loss', 0):.3f}, acceptance "
                         f"length implied on the training batch {m.get('accept_len', 0):.2f}")  # fmt: skip
    if "bf16" in rows and "fp8" in rows:
        d = rows["fp8"]["tau_per_prompt"] / rows["bf16"]["tau_per_prompt"] - 1
        lines.append(f"fp8 vs bf16: {100 * d:+.2f}% tau/prompt")
    if "bf16" in rows and "dspark" in rows:
        d = rows["dspark"]["tau_per_prompt"] / rows["bf16"]["tau_per_prompt"] - 1
        blocks = f"B={rows['dspark']['settings']['block_size']} vs B={rows['bf16']['settings']['block_size']}"
        lines.append(f"dspark vs dflash (the bf16 cache, the same steps, {blocks}): {100 * d:+.2f}% tau/prompt")
    for storage, c in summary.get("caches", {}).items():
        lines.append(f"cache {storage}: {c['samples']} samples, {c['tokens']:,} tokens, "
                     f"{c['bytes'] / c['tokens'] / 1024:.2f} KiB/token on disk")  # fmt: skip
    lines.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["times"].items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--target", help="target directory with code_train.jsonl and code_prompts.jsonl beside its "
                    "weights (default: data/code-target and data/ for cpu, code-target-gpu for gpu)")  # fmt: skip
    ap.add_argument("--out", help="output directory (default quality-SIZE)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 32 cpu, 64 gpu)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (default 96 cpu, 128 gpu)")
    ap.add_argument("--rows", type=int, help="regenerate and train on only the first N rows of code_train.jsonl")
    ap.add_argument("--regen-tokens", type=int, default=128, help="longest regenerated continuation")
    ap.add_argument("--recipe", choices=("default", "demo"), default="default",
                    help="training recipe: dflash train's defaults, or the demo's (2 layers, 8 epochs of "
                    "512-token batches, 16 anchors, lr 3e-3)")
    ap.add_argument("--epochs", type=int, help="training epochs instead of the recipe's (6 default, 8 demo)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drafters' weights, shuffling and anchors")
    ap.add_argument("--jobs", type=int, default=1, choices=(1, 3),
                    help="3: the parts (bf16, fp8, untrained, dspark) at once, as processes")
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help=f"the parts to run, of {', '.join(TASKS)} (bf16 is "
                    "always run: the others use its cache; dspark makes it hold the final hidden state)")
    ap.add_argument("--block-size", type=int, help="block size of every drafter (default: each family's)")
    ap.add_argument("--regen-batch", type=int, default=None, help="regen prompts per generate call (64 cpu, 512 gpu)")
    ap.add_argument("--task", choices=TASKS, help=argparse.SUPPRESS)  # internal: one part, as a process
    args = ap.parse_args()
    args.prompts = args.prompts or (32 if args.size == "cpu" else 64)
    tasks = ["bf16", *[t for t in args.tasks.split(",") if t != "bf16"]]
    if not set(tasks) <= set(TASKS):
        ap.error(f"--tasks: unknown {sorted(set(tasks) - set(TASKS))}")
    final_hidden = "dspark" in tasks
    args.max_new_tokens = args.max_new_tokens or (96 if args.size == "cpu" else 128)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    import torch

    from dflash_cache.pipelines import demo

    if not torch.cuda.is_available():
        torch.set_flush_denormal(True)
    cfg = demo_config(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    regen_path = cfg.out / "regen.jsonl"
    if args.task:  # a child of --jobs 3
        (cfg.out / f"task-{args.task}.json").write_text(json.dumps(task(cfg, args.task, regen_path, args.block_size,
                                                                        final_hidden)))  # fmt: skip
        return

    print(f"quality run: target {cfg.target}, {cfg.eval_prompts} held-out prompts x {cfg.max_new_tokens} tokens, "
          f"recipe {args.recipe} ({cfg.draft_layers} layers, {cfg.epochs} epochs, lr {cfg.lr}), out {cfg.out}",
          flush=True)  # fmt: skip
    start = time.perf_counter()
    t = time.perf_counter()
    demo.regenerate(cfg)
    summary: dict = {"results": {}, "times": {"regen": time.perf_counter() - t}, "caches": {}}
    if args.jobs == 1:
        parts = [task(cfg, name, regen_path, args.block_size, final_hidden) for name in tasks]
    else:  # every task a process of its own; they share the GPU (or the cores)
        parts = run_tasks(cfg.out, list(tasks), [sys.executable, __file__, *sys.argv[1:]])
    for part in parts:
        for k in ("results", "times", "caches"):
            summary[k].update(part[k])
    outputs = [s["output_ids"] for s in summary["results"]["bf16"]["samples"]]
    block = summary["results"]["bf16"]["settings"]["block_size"]
    summary["results"]["lookup"] = lookup_result(cfg, outputs, block)
    summary["times"]["total"] = time.perf_counter() - start
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    summary["settings"] = {**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
                           "recipe": args.recipe, "size": args.size, "jobs": args.jobs, "torch": torch.__version__,
                           "tasks": tasks, "block_size": args.block_size,
                           "device": device}  # fmt: skip
    corpus = cfg.target / "corpus.json"
    if corpus.exists():
        summary["target"] = json.loads(corpus.read_text())
    (cfg.out / "quality.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(report(summary))


if __name__ == "__main__":
    main()
