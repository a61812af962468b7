"""`dflash regen`: rewrite a dataset's assistant turns with the target's own generations.

DFlash drafters train on what the target itself would say: a drafter fitted to human-written
responses learns a distribution the target never produces. Prompts (system and user turns) are
kept; each assistant turn is regenerated in order, given the conversation so far with the earlier
turns already regenerated.

Rows are cut into fixed parts; a part is generated whole and committed by an atomic rename, so a
killed run resumes without redoing finished parts, and each part's sampling is seeded by its id,
so a resumed run writes what an uninterrupted one would. The parts are joined into one JSON Lines
file at the end, which `dflash extract` reads directly.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .data import DataError, RowRejected, check_messages, read_rows, source_row
from .devices import Worker, launch
from .progress import ProgressSink, Reporter
from .target import compute_dtype_for, load_tokenizer

REJECTED = "rejected.jsonl"


@dataclass
class RegenConfig:
    target: str
    data: str
    out: Path  # the output .jsonl; parts live in OUT.parts/ until the end
    max_new_tokens: int = 512
    temperature: float = 0.0
    seed: int = 0
    batch_size: int = 32
    part_rows: int = 64
    revision: str | None = None
    gpus: list[int] | None = None
    procs: int = 1


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def _conversation(row: dict[str, Any]) -> list[dict[str, str]] | str:
    """The source row as chat messages to regenerate, or the reason it cannot be."""
    try:
        row = source_row(row)
        if row.get("messages") is not None:
            return [{"role": m["role"], "content": m["content"]} for m in check_messages(row["messages"])]
    except RowRejected as e:
        return e.reason
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": ""}]
    if row.get("text") is not None:
        return "plain text rows have no prompt to answer"
    return "row has neither messages nor prompt"


def run(cfg: RegenConfig, sink: ProgressSink | None = None) -> dict[str, Any]:
    """Regenerate every part not yet committed, then join the parts into `cfg.out`."""
    if cfg.out.exists():
        return {"out": str(cfg.out), "rows": sum(1 for _ in open(cfg.out)), "resumed": True}
    rows = read_rows(cfg.data)
    n_parts = -(-len(rows) // cfg.part_rows)
    parts = parts_dir(cfg.out)
    parts.mkdir(parents=True, exist_ok=True)
    done = {int(p.stem.split("-")[1]) for p in parts.glob("part-*.jsonl")}
    reporter = Reporter(sink)
    reporter.start(total=n_parts, done=len(done))
    try:
        launch(_worker, (cfg, n_parts, reporter.channel), gpus=cfg.gpus, procs=cfg.procs)
    finally:
        reporter.stop()
    missing = [i for i in range(n_parts) if not (parts / f"part-{i:05d}.jsonl").exists()]
    if missing:
        raise DataError(f"regen: parts {missing[:5]} were not written; rerun to resume")
    tmp = cfg.out.with_name(f".{cfg.out.name}.{os.getpid()}.tmp")
    kept = rejected = 0
    with open(tmp, "w") as out, open(cfg.out.with_name(cfg.out.stem + ".rejected.jsonl"), "w") as rej:
        for i in range(n_parts):
            for line in open(parts / f"part-{i:05d}.jsonl"):
                rec = json.loads(line)
                if "rejected" in rec:
                    rej.write(line)
                    rejected += 1
                else:
                    out.write(line)
                    kept += 1
    os.replace(tmp, cfg.out)
    shutil.rmtree(parts, ignore_errors=True)
    return {"out": str(cfg.out), "rows": kept, "rejected": rejected, "resumed": False}


def _worker(w: Worker, cfg: RegenConfig, n_parts: int, channel) -> None:
    from transformers import AutoModelForCausalLM

    parts = parts_dir(cfg.out)
    todo = [i for i in range(n_parts) if i % w.world_size == w.rank and not (parts / f"part-{i:05d}.jsonl").exists()]
    if not todo:
        return
    rows = read_rows(cfg.data)
    tokenizer = load_tokenizer(cfg.target, cfg.revision)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(cfg.target, revision=cfg.revision,
                                                 dtype=compute_dtype_for(w.device)).to(w.device).eval()  # fmt: skip
    stop = [t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} if isinstance(t, int)]
    for part in todo:
        torch.manual_seed(cfg.seed * 1_000_003 + part)  # a part samples the same on any rerun
        lo, hi = part * cfg.part_rows, min(len(rows), (part + 1) * cfg.part_rows)
        convs = {i: _conversation(rows[i]) for i in range(lo, hi)}
        _regenerate(model, tokenizer, {i: c for i, c in convs.items() if isinstance(c, list)}, cfg, stop, w.device)
        tmp = parts / f".part-{part:05d}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            for i, c in convs.items():
                rec = {"messages": c} if isinstance(c, list) else {"rejected": c, "row": i}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, parts / f"part-{part:05d}.jsonl")
        channel.put({"parts": 1})


@torch.inference_mode()
def _regenerate(model, tokenizer, convs: dict[int, list[dict]], cfg: RegenConfig, stop: list[int],
                device: torch.device) -> None:  # fmt: skip
    """Replace every assistant turn, turn by turn across the part, in length-sorted batches."""
    depth = 0
    while True:
        # requests: (row, message index) of the depth-th assistant turn of each conversation
        requests = []
        for i, msgs in convs.items():
            turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
            if depth < len(turns):
                requests.append((i, turns[depth]))
        if not requests:
            return
        prompts = {r: tokenizer.apply_chat_template(convs[r[0]][: r[1]], add_generation_prompt=True, tokenize=False)
                   for r in requests}  # fmt: skip
        requests.sort(key=lambda r: (len(prompts[r]), r))
        for b in range(0, len(requests), cfg.batch_size):
            batch = requests[b : b + cfg.batch_size]
            enc = tokenizer([prompts[r] for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc.to(device), max_new_tokens=cfg.max_new_tokens, do_sample=cfg.temperature > 0,
                temperature=cfg.temperature if cfg.temperature > 0 else None, top_p=None, top_k=None,
                eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            for (i, k), ids in zip(batch, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                cut = next((j for j, t in enumerate(ids) if t in stop), len(ids))
                convs[i][k] = {"role": "assistant", "content": tokenizer.decode(ids[:cut], skip_special_tokens=True)}
        depth += 1
