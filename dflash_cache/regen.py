"""`dflash regen`: rewrite a dataset's assistant turns with the target's own generations.

DFlash drafters train on what the target itself would say: a drafter fitted to human-written
responses learns a distribution the target never produces. Prompts (system and user turns) are
kept; each assistant turn is regenerated in order, given the conversation so far with the earlier
turns already regenerated.

Chat-template kwargs (e.g. `enable_thinking`) reach every prompt the target continues, and a
generated reasoning block (`<think>...</think>`) stays in the written reply: it is what the
target says, and the template decides what of it a later turn sees.

Rows are cut into fixed parts; a part is generated whole and committed by an atomic rename, so a
killed run resumes without redoing finished parts, and each part's sampling is seeded by its id,
so a resumed run writes what an uninterrupted one would. The parts are joined into one JSON Lines
file at the end, which `dflash extract` reads directly.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_cache.app_config import RegenConfig, regen_record
from dflash_cache.devices import Worker, flush_denormals, launch, worker_threads
from dflash_cache.extract.data import (
    NO_ASSISTANT,
    DataError,
    RowRejected,
    check_template_kwargs,
    conversation,
    read_rows,
    source_fingerprint,
)
from dflash_cache.extract.target import compute_dtype_for, load_config, load_tokenizer, stop_token_ids
from dflash_cache.paths import output_dir, output_file
from dflash_cache.progress import ProgressSink, Reporter
from dflash_cache.settings import plain

REJECTED = "rejected.jsonl"
REASONING_MARKERS = ("<think>", "</think>")  # kept in a reply even where the tokenizer calls them special


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def _settings(cfg: RegenConfig) -> dict[str, Any]:
    """Everything that decides the regenerated rows (not batch size or devices)."""
    return {"target": cfg.target, "revision": cfg.revision, "data": source_fingerprint(cfg.data, cfg.data_split),
            "data_split": cfg.data_split, "max_samples": cfg.max_samples, "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "seed": cfg.seed, "part_rows": cfg.part_rows,
            "chat_template_kwargs": check_template_kwargs(cfg.chat_template_kwargs)}  # fmt: skip


def _check_settings(path: Path, settings: dict[str, Any], what: Path) -> None:
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    old.pop("config", None)  # how it was run, for `--config OUT.jsonl`; not what decides the rows
    diffs = sorted(k for k in settings.keys() | old.keys() if old.get(k) != settings.get(k))
    if diffs:
        raise DataError(f"{what} was regenerated with other settings ({', '.join(diffs)} differ): "
                        "use another --out, or delete it to regenerate")  # fmt: skip


def _conversation(row: dict[str, Any]) -> list[dict[str, Any]] | str:
    """The source row as chat messages to regenerate (any row form extract reads), or the reason
    it cannot be."""
    try:
        messages = conversation(row, reply_required=False)  # a bare question is one for the target to answer
    except RowRejected as e:
        return e.reason
    if messages is None:
        return "plain text rows have no prompt to answer"
    return messages if any(m["role"] == "assistant" for m in messages) else NO_ASSISTANT


def _read(cfg: RegenConfig):
    return read_rows(cfg.data, split=cfg.data_split, max_samples=cfg.max_samples)


def run(cfg: RegenConfig, sink: ProgressSink | None = None) -> dict[str, Any]:
    """Regenerate every part not yet committed, then join the parts into `cfg.out`."""
    output_file(cfg.out, "--out")
    output_dir(parts_dir(cfg.out), "--out's parts directory")
    settings = _settings(cfg)
    _check_settings(regen_record(cfg.out), settings, cfg.out)
    if cfg.out.exists():
        return {"out": str(cfg.out), "rows": sum(1 for _ in open(cfg.out)), "resumed": True}
    parts = parts_dir(cfg.out)
    _check_settings(parts / "settings.json", settings, parts)
    rows = _read(cfg)
    load_config(cfg.target, cfg.revision)  # a bad --target fails here, before the parts directory exists
    n_parts = -(-len(rows) // cfg.part_rows)
    parts.mkdir(parents=True, exist_ok=True)
    (parts / "settings.json").write_text(json.dumps({**settings, "config": plain(cfg)}))
    done = {int(p.stem.split("-")[1]) for p in parts.glob("part-*.jsonl")}
    reporter = Reporter(sink)
    reporter.start(total=len(rows), done=sum(len(_part_rows(i, cfg, len(rows))) for i in done))
    t0 = time.perf_counter()
    try:
        launch(_worker, (cfg, n_parts, reporter.channel), gpus=cfg.gpus, procs=cfg.procs)
    finally:
        totals = reporter.stop()
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
    os.replace(parts / "settings.json", regen_record(cfg.out))
    os.replace(tmp, cfg.out)
    shutil.rmtree(parts, ignore_errors=True)
    return {"out": str(cfg.out), "rows": kept, "rejected": rejected, "resumed": False,
            "generated_tokens": totals.get("tokens", 0), "seconds": round(time.perf_counter() - t0, 3)}  # fmt: skip


def _part_rows(part: int, cfg: RegenConfig, n_rows: int) -> range:
    return range(part * cfg.part_rows, min(n_rows, (part + 1) * cfg.part_rows))


def _worker(w: Worker, cfg: RegenConfig, n_parts: int, channel) -> None:
    from transformers import AutoModelForCausalLM

    parts = parts_dir(cfg.out)
    todo = [i for i in range(n_parts) if i % w.world_size == w.rank and not (parts / f"part-{i:05d}.jsonl").exists()]
    if not todo:
        return
    rows = _read(cfg)
    tokenizer = load_tokenizer(cfg.target, cfg.revision)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # e.g. Llama 3: batched prompts need a pad, which the mask hides
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(cfg.target, revision=cfg.revision,
                                                 dtype=compute_dtype_for(w.device)).to(w.device).eval()  # fmt: skip
    stop = sorted(stop_token_ids(tokenizer, model))
    # a CPU slows down tenfold on denormal activations, and thrashes with more threads than idle cores
    with flush_denormals(w.device), worker_threads(w):
        for part in todo:
            torch.manual_seed(cfg.seed * 1_000_003 + part)  # a part samples the same on any rerun
            convs = {i: _conversation(rows[i]) for i in _part_rows(part, cfg, len(rows))}
            _regenerate(model, tokenizer, {i: c for i, c in convs.items() if isinstance(c, list)}, cfg, stop, w.device,
                        report=channel.put)  # fmt: skip
            tmp = parts / f".part-{part:05d}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                for i, c in convs.items():
                    rec = {"messages": c} if isinstance(c, list) else {"rejected": c, "row": i}
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            os.replace(tmp, parts / f"part-{part:05d}.jsonl")
            channel.put({"parts": 1, "rows": len(convs)})


def reply_decoder(tokenizer) -> Callable[[list[int]], str]:
    """Generated ids -> reply text: special tokens dropped (as `skip_special_tokens` would), except
    the reasoning markers, which `skip_special_tokens` drops where they are added as special."""
    added = tokenizer.added_tokens_decoder
    drop = (set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}) - {
        i for i, t in added.items() if t.content in REASONING_MARKERS
    }
    return lambda ids: tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)


@torch.inference_mode()
def _regenerate(model, tokenizer, convs: dict[int, list[dict]], cfg: RegenConfig, stop: list[int],
                device: torch.device, report: Callable[[dict], None] = lambda _: None) -> None:  # fmt: skip
    """Replace every assistant turn, turn by turn across the part, in length-sorted batches;
    `report` gets the tokens generated after each batch (the progress bar's rate)."""
    decode = reply_decoder(tokenizer)
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
        kwargs = check_template_kwargs(cfg.chat_template_kwargs)
        prompts = {r: tokenizer.apply_chat_template(convs[r[0]][: r[1]], add_generation_prompt=True, tokenize=False,
                                                    **kwargs) for r in requests}  # fmt: skip
        requests.sort(key=lambda r: (len(prompts[r]), r))
        for b in range(0, len(requests), cfg.batch_size):
            batch = requests[b : b + cfg.batch_size]
            enc = tokenizer([prompts[r] for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **enc.to(device), max_new_tokens=cfg.max_new_tokens, do_sample=cfg.temperature > 0,
                temperature=cfg.temperature if cfg.temperature > 0 else None, top_p=None, top_k=None,
                eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            generated = 0
            for (i, k), ids in zip(batch, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                cut = next((j for j, t in enumerate(ids) if t in stop), len(ids))
                convs[i][k] = {"role": "assistant", "content": decode(ids[:cut])}
                generated += cut
            report({"tokens": generated})
        depth += 1
