"""A fixed tiny CPU training, fingerprinted: proof that a refactor leaves DFlash training bitwise unchanged.

Extracts data/code_train.jsonl with the committed code target (once, into OUT/cache), trains a
2-layer DFlash drafter for 20 steps with a fixed seed on one process, and prints the sha256 of the
final weights (every tensor of the checkpoint's model state, float32 bytes, in name order), of
the metrics that depend only on the math (loss, per-slot accuracy, acceptance; not timings) and
of each file of the serving export.
Run it before and after a change and compare the two lines (QUALITY.md, "DFlash bitwise").

    python benchmarks/train_fingerprint.py --out /tmp/fp [--drafter dflash]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MATH_KEYS = ("step", "epoch", "loss", "slot_acc", "accept_len")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--drafter", default=None, help="drafter family (omitted: the train default)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # thread count changes float summation order

    import torch

    from dflash_cache.drafters import family
    from dflash_cache.extract import stage as extract_stage
    from dflash_cache.extract.config import ExtractConfig
    from dflash_cache.train import stage as train_stage
    from dflash_cache.train.config import TrainConfig

    torch.set_num_threads(1)
    final = family(args.drafter or TrainConfig.drafter).needs_final_hidden  # DSpark trains on the final state
    cache = args.out / ("cache-final" if final else "cache")
    extract_stage.run(ExtractConfig(target=str(ROOT / "data" / "code-target"), data=str(ROOT / "data" /
                                    "code_train.jsonl"), out=cache, max_length=2048, final_hidden=final))  # fmt: skip
    run = args.out / f"run-{args.drafter or 'default'}"
    extra = {"drafter": args.drafter} if args.drafter else {}
    cfg = TrainConfig(cache=cache, out=run, draft_layers=2, token_budget=512, max_anchors=16, lr=3e-3, seed=0,
                      max_steps=args.steps, log_every=1, save_every=1000, **extra)  # fmt: skip
    if run.exists():
        import shutil

        shutil.rmtree(run)
    train_stage.run(cfg)
    state = torch.load(run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip(),
                       map_location="cpu", weights_only=False)["model"]  # fmt: skip
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().float().contiguous().numpy().tobytes())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    math = [{k: r[k] for k in MATH_KEYS if k in r} for r in lines if "loss" in r]
    m = hashlib.sha256(json.dumps(math, sort_keys=True).encode()).hexdigest()
    export = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in sorted((run / "export").iterdir())}
    print(json.dumps({"weights_sha256": h.hexdigest(), "metrics_sha256": m, "steps": len(math), "export": export,
                      "last": math[-1]}))  # fmt: skip


if __name__ == "__main__":
    main()
