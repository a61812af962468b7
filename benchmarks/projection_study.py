"""Tau against bytes a token for projected caches (`dflash extract --project`) on a code target.

The target regenerates the training prefixes once (as the demo does); then each variant extracts
its own cache from those rows (the tapped layers as they are, or projected: a rank, a joint or
per-layer basis, the layer scaling on or off, bf16 or fp8), trains a drafter on it (DFlash or
DSpark) for each seed, and evaluates it with `dflash eval`'s code on held-out prefixes: the target
live, so the full tapped layers meet the exported, folded `fc`. Ranks are given as fractions of
the target's hidden size H (`0.5h`) or of every tapped value (`all`).

Usage::

    python benchmarks/projection_study.py --size cpu --seeds 0,1 --jobs 4          # data/code-target
    python benchmarks/projection_study.py --size gpu --target code-target-gpu --jobs 6 --recipe default

Every variant is a process of its own (`--jobs` at a time); its seeds run one after another on
its cache. Everything goes to `--out` (default `projection-SIZE`): `study.json` holds every figure
and setting; a rerun resumes each part.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

# name: (family, rank as a fraction of H or "all", basis, scaling, storage)
VARIANTS = {
    "full": ("dflash", "all", "joint", "layer-rms", "bf16"),
    "joint-0.25h": ("dflash", "0.25h", "joint", "layer-rms", "bf16"),
    "joint-0.5h": ("dflash", "0.5h", "joint", "layer-rms", "bf16"),
    "joint-1h": ("dflash", "1h", "joint", "layer-rms", "bf16"),
    "joint-2h": ("dflash", "2h", "joint", "layer-rms", "bf16"),
    "per-layer-0.5h": ("dflash", "0.5h", "per-layer", "layer-rms", "bf16"),
    "per-layer-1h": ("dflash", "1h", "per-layer", "layer-rms", "bf16"),
    "joint-0.5h-unscaled": ("dflash", "0.5h", "joint", "none", "bf16"),
    "joint-0.5h-fp8": ("dflash", "0.5h", "joint", "layer-rms", "fp8"),
    "joint-1h-fp8": ("dflash", "1h", "joint", "layer-rms", "fp8"),
    "dspark-full": ("dspark", "all", "joint", "layer-rms", "bf16"),
    "dspark-joint-0.5h": ("dspark", "0.5h", "joint", "layer-rms", "bf16"),
    "dspark-joint-1h-fp8": ("dspark", "1h", "joint", "layer-rms", "fp8"),
}


def rank_of(spec: str, hidden: int, layers: int, basis: str) -> int | str:
    """The `--project` value of a variant's rank: "none", or R rounded to a multiple of K per layer."""
    if spec == "all":
        return "none"
    rank = int(round(float(spec[:-1]) * hidden))
    return -(-rank // layers) * layers if basis == "per-layer" else rank


def run_variant(cfg, name: str, seeds: list[int], regen: Path) -> dict:
    """Extract the variant's cache, then train and evaluate a drafter on it for each seed."""
    from dflash_cache.cache.audit import info
    from dflash_cache.extract import stage as extract
    from dflash_cache.extract.config import ExtractConfig
    from dflash_cache.pipelines import demo

    family, rank, basis, scaling, storage = VARIANTS[name]
    target_cfg = json.loads((cfg.target / "config.json").read_text())
    hidden, layers = target_cfg["hidden_size"], 5
    cache = cfg.out / f"cache-{name}"
    t = time.perf_counter()
    extract.run(ExtractConfig(target=str(cfg.target), data=str(regen), out=cache, max_length=2048, storage=storage,
                              gpus=cfg.gpus, final_hidden=family == "dspark",
                              project=rank_of(rank, hidden, layers, basis), project_basis=basis,
                              project_scaling=scaling))  # fmt: skip
    facts = info(cache)
    out = {"variant": name, "family": family, "rank": rank, "basis": basis, "scaling": scaling, "storage": storage,
           "extract_s": time.perf_counter() - t, "bytes_per_token": facts["bytes_per_token"],
           "fraction_of_raw_bf16": facts["fraction_of_raw_bf16"],
           "retained_energy": facts.get("retained_energy"), "seeds": {}}  # fmt: skip
    for seed in seeds:
        seeded = replace(cfg, seed=seed)
        run_dir = cfg.out / f"run-{name}-{seed}"
        t = time.perf_counter()
        tcfg = replace(demo.train_config(seeded, cache, run_dir), drafter=family)
        export = demo.train_drafter(tcfg)
        trained = time.perf_counter() - t
        t = time.perf_counter()
        result = demo.evaluate_drafter(seeded, export).to_dict()
        out["seeds"][seed] = {"tau_per_prompt": result["tau_per_prompt"], "tau": result["tau"],
                              "steps": result["steps"], "train_s": trained,
                              "eval_s": time.perf_counter() - t}  # fmt: skip
    return out


def report(summary: dict) -> str:
    rows = summary["variants"]
    seeds = summary["settings"]["seeds"]
    full = {fam: rows.get(n) for fam, n in (("dflash", "full"), ("dspark", "dspark-full"))}
    head = " ".join(f"{'seed ' + str(s):>13}" for s in seeds)
    lines = [f"{'variant':<22} {'B/token':>8} {'of bf16':>8} {head} {'mean/prompt':>11} {'vs full':>8}"]
    for name, r in rows.items():
        taus = [r["seeds"][str(s)]["tau_per_prompt"] for s in seeds if str(s) in r["seeds"]]
        pooled = [r["seeds"][str(s)]["tau"] for s in seeds if str(s) in r["seeds"]]
        mean = sum(taus) / len(taus)
        ref = full.get(r["family"])
        ref_mean = (sum(ref["seeds"][str(s)]["tau_per_prompt"] for s in seeds) / len(seeds)) if ref else None
        cells = " ".join(f"{t:>6.3f} ({p:.3f})" for t, p in zip(taus, pooled, strict=True))
        vs = f"{100 * (mean / ref_mean - 1):+.1f}%" if ref_mean else ""
        lines.append(f"{name:<22} {r['bytes_per_token']:>8.1f} {r['fraction_of_raw_bf16']:>8.3f} {cells} "
                     f"{mean:>11.3f} {vs:>8}")  # fmt: skip
    lines.append("tau per prompt (pooled); B/token: bytes on disk a token (ids and mask included, the final hidden "
                 "state not); of bf16: against the tapped layers as raw bf16")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--target", help="target directory with code_train.jsonl and code_prompts.jsonl beside it "
                    "(default: data/code-target and data/ for cpu)")  # fmt: skip
    ap.add_argument("--out", help="output directory (default projection-SIZE)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--jobs", type=int, default=1, help="variants at once, as processes")
    ap.add_argument("--recipe", choices=("default", "demo"), default="demo",
                    help="training recipe: the demo's (2 layers, 8 epochs of 512-token batches) or dflash train's")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 32 cpu, 64 gpu)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="per prompt (default 96 cpu, 128 gpu)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one variant, as a process
    args = ap.parse_args()
    names = args.variants.split(",")
    if not set(names) <= set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(set(names) - set(VARIANTS))}")
    seeds = [int(s) for s in args.seeds.split(",")]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    import quality
    import torch

    args.epochs, args.rows, args.regen_tokens, args.regen_batch, args.seed = None, None, 128, None, 0
    args.prompts = args.prompts or (32 if args.size == "cpu" else 64)
    args.max_new_tokens = args.max_new_tokens or (96 if args.size == "cpu" else 128)
    args.out = args.out or f"projection-{args.size}"
    cfg = quality.demo_config(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    regen = cfg.out / "regen.jsonl"
    if args.variant:
        result = run_variant(cfg, args.variant, seeds, regen)
        (cfg.out / f"variant-{args.variant}.json").write_text(json.dumps(result, indent=1))
        return
    from dflash_cache.pipelines import demo

    start = time.perf_counter()
    demo.regenerate(cfg)
    todo = [n for n in names if not (cfg.out / f"variant-{n}.json").exists()]
    running: list[tuple[str, subprocess.Popen]] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            name = todo.pop(0)
            log = open(cfg.out / f"variant-{name}.log", "w")
            argv = [sys.executable, __file__, *sys.argv[1:], "--variant", name]
            running.append((name, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(1)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                if proc.returncode:
                    print(f"{name} failed: see {cfg.out / f'variant-{name}.log'}", flush=True)
                else:
                    print(f"{name} done", flush=True)
    variants = {n: json.loads((cfg.out / f"variant-{n}.json").read_text()) for n in names
                if (cfg.out / f"variant-{n}.json").exists()}  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {"variants": variants, "seconds": time.perf_counter() - start,
               "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
                            "seeds": seeds, "recipe": args.recipe, "device": device,
                            "torch": torch.__version__}}  # fmt: skip
    (cfg.out / "study.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(report(summary))


if __name__ == "__main__":
    main()
