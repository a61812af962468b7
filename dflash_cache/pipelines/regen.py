"""`dflash regen`: rewrite a dataset's assistant turns with the target's own generations.

DFlash drafters train on what the target itself would say: a drafter fitted to human-written
responses learns a distribution the target never produces. Prompts (system and user turns) are
kept; each assistant turn is regenerated in order, given the conversation so far with the earlier
turns already regenerated. A row that ends in a user turn (a dataset of prompts alone) gets the
reply to it.

Chat-template kwargs (e.g. `enable_thinking`) reach every prompt the target continues, and a
generated reasoning block (`<think>...</think>`) stays in the written reply: it is what the
target says, and the template decides what of it a later turn sees. Templating is always ours, so
regenerated rows render exactly as `dflash extract` will render them.

Generation runs through `dflash_cache.generate`: the embedded engine (continuous batching across
the whole dataset, CUDA graphs) or, with `--server`, an OpenAI-compatible server that users
already run (vLLM, SGLang, llama.cpp), sent token-id prompts. A request's tokens depend only on
(seed, row, turn), never on the batch it ran in.

Rows are cut into fixed parts; a part is committed by an atomic rename as soon as its last row is
done, so a killed run resumes without redoing finished parts and writes what an uninterrupted one
would. The parts are joined into one JSON Lines file at the end, which `dflash extract` reads. A
reply cut at `--max-new-tokens` is counted as truncated (and dropped with `--drop-truncated`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_cache.core.damage import damaged, read_json, read_jsonl
from dflash_cache.core.devices import Worker, flush_denormals
from dflash_cache.core.jsonl import dumps_line
from dflash_cache.core.launch import launch
from dflash_cache.core.paths import output_dir, output_file
from dflash_cache.core.progress import ProgressSink, Reporter
from dflash_cache.core.settings import plain
from dflash_cache.core.threads import worker_threads
from dflash_cache.generate import (
    ERROR,
    LENGTH,
    Backend,
    Completion,
    Engine,
    Request,
    StopRule,
    fit_slots,
    load_model,
    make_target,
    slot_bytes,
)
from dflash_cache.generate.dialogue import chat_prompt, reply_decoder, turn_by_turn
from dflash_cache.pipelines.config import RegenConfig, regen_record
from dflash_cache.rows.chat import DataError, DataWarning, RowRejected, check_template_kwargs
from dflash_cache.rows.digest import source_fingerprint
from dflash_cache.rows.forms import NO_ASSISTANT, conversation
from dflash_cache.rows.sources import read_rows
from dflash_cache.target.load import load_config, load_tokenizer, stop_token_ids

REJECTED = "rejected.jsonl"


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def _settings(cfg: RegenConfig) -> dict[str, Any]:
    """Everything that decides the regenerated rows (not batch size, devices, or which server URL
    serves the model)."""
    return {"target": cfg.target, "revision": cfg.revision, "data": source_fingerprint(cfg.data, cfg.data_split),
            "data_split": cfg.data_split, "max_samples": cfg.max_samples, "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "seed": cfg.seed, "part_rows": cfg.part_rows,
            "chat_template_kwargs": check_template_kwargs(cfg.chat_template_kwargs),
            "generator": "server" if cfg.server else "embedded", "server_model": cfg.server_model,
            "drop_truncated": cfg.drop_truncated}  # fmt: skip


def _check_settings(path: Path, settings: dict[str, Any], what: Path) -> None:
    if not path.is_file():
        return
    old = read_json(path, f"delete {what} to regenerate it from the start, or use another --out")
    old.pop("config", None)  # how it was run, for `--config OUT.jsonl`; not what decides the rows
    old.setdefault("generator", "embedded")  # runs from before the generation seam
    old.setdefault("server_model", None)
    old.setdefault("drop_truncated", False)
    diffs = sorted(k for k in settings.keys() | old.keys() if old.get(k) != settings.get(k))
    if diffs:
        raise DataError(f"{what} was regenerated with other settings ({', '.join(diffs)} differ): "
                        "use another --out, or delete it to regenerate")  # fmt: skip


def _conversation(row: dict[str, Any]) -> list[dict[str, Any]] | str:
    """The source row as chat messages to regenerate (any row form extract reads), or the reason
    it cannot be. A conversation that ends in a user turn gets an empty assistant turn to fill."""
    try:
        messages = conversation(row, reply_required=False)  # a bare question is one for the target to answer
    except RowRejected as e:
        return e.reason
    if messages is None:
        return "plain text rows have no prompt to answer"
    if messages and messages[-1]["role"] == "user":
        messages = [*messages, {"role": "assistant", "content": ""}]
    return messages if any(m["role"] == "assistant" for m in messages) else NO_ASSISTANT


def _read(cfg: RegenConfig, *, quiet: bool = False):
    """The source rows; `quiet` for a worker, whose parent has already said what the rows are (a
    file cut short warns once a run, not once a process)."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", DataWarning)
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
    server = _server(cfg) if cfg.server else None  # an unreachable server too
    n_parts = -(-len(rows) // cfg.part_rows)
    parts.mkdir(parents=True, exist_ok=True)
    (parts / "settings.json").write_text(json.dumps({**settings, "config": plain(cfg)}))
    done = {int(p.stem.split("-")[1]) for p in parts.glob("part-*.jsonl")}
    for i in sorted(done):  # a damaged part is named now, not after hours of regenerating the rest
        _read_part(parts, i, len(_part_rows(i, cfg, len(rows))))
    reporter = Reporter(sink)
    reporter.start(total=len(rows), done=sum(len(_part_rows(i, cfg, len(rows))) for i in done))
    t0 = time.perf_counter()
    try:
        if server is not None:
            _regenerate(server, load_tokenizer(cfg.target, cfg.revision), rows, _todo(cfg, n_parts, 0, 1), cfg,
                        reporter.channel.put)  # fmt: skip
        else:
            launch(_worker, (cfg, n_parts, reporter.channel), gpus=cfg.gpus, procs=cfg.procs)
    finally:
        totals = reporter.stop()
    missing = [i for i in range(n_parts) if not (parts / f"part-{i:05d}.jsonl").exists()]
    if missing:
        why = f" ({totals['failed']})" if totals.get("failed") else ""
        raise DataError(f"regen: {len(missing)} of {n_parts} parts were not written{why}; rerun to resume")
    return _join(cfg, n_parts, len(rows), totals, time.perf_counter() - t0)


def _join(cfg: RegenConfig, n_parts: int, n_rows: int, totals: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The parts, in order, as OUT.jsonl (and OUT.rejected.jsonl); nothing at all if no row was kept."""
    parts = parts_dir(cfg.out)
    tmp = cfg.out.with_name(f".{cfg.out.name}.{os.getpid()}.tmp")
    rejected_path = cfg.out.with_name(cfg.out.stem + ".rejected.jsonl")
    kept = rejected = truncated = 0
    with open(tmp, "w", encoding="utf-8") as out, open(rejected_path, "w", encoding="utf-8") as rej:
        for i in range(n_parts):
            for rec in _read_part(parts, i, len(_part_rows(i, cfg, n_rows))):
                if "rejected" in rec:
                    rej.write(dumps_line(rec))
                    rejected += 1
                    truncated += rec.get("truncated", False)
                else:
                    truncated += rec.pop("truncated", False)
                    out.write(dumps_line(rec))
                    kept += 1
    if not kept:  # nothing a later run could take for a finished output
        tmp.unlink()
        shutil.rmtree(parts, ignore_errors=True)
        raise DataError(f"regen: no row could be regenerated ({rejected} rejected: see {rejected_path})")
    os.replace(parts / "settings.json", regen_record(cfg.out))
    os.replace(tmp, cfg.out)
    shutil.rmtree(parts, ignore_errors=True)
    return {"out": str(cfg.out), "rows": kept, "rejected": rejected, "truncated": truncated, "resumed": False,
            "generated_tokens": totals.get("tokens", 0), "seconds": round(seconds, 3)}  # fmt: skip


def _read_part(parts: Path, part: int, n_rows: int) -> list[dict[str, Any]]:
    """A committed part's records, one a row; `DamagedFile` naming a part that is not whole JSON
    Lines or lacks rows (damaged after it was committed, since a part appears by rename)."""
    path = parts / f"part-{part:05d}.jsonl"
    fix = "delete it and rerun the same command: its rows are regenerated"
    records = read_jsonl(path, fix)
    if len(records) != n_rows:
        raise damaged(path, "regen part", f"it holds {len(records)} rows of {n_rows}", fix)
    return records


def _part_rows(part: int, cfg: RegenConfig, n_rows: int) -> range:
    return range(part * cfg.part_rows, min(n_rows, (part + 1) * cfg.part_rows))


def _todo(cfg: RegenConfig, n_parts: int, rank: int, world_size: int) -> list[int]:
    parts = parts_dir(cfg.out)
    return [i for i in range(n_parts) if i % world_size == rank and not (parts / f"part-{i:05d}.jsonl").exists()]


def _server(cfg: RegenConfig) -> Backend:
    from dflash_cache.generate.server import ServerBackend

    return ServerBackend(cfg.server, tokenizer=load_tokenizer(cfg.target, cfg.revision), model=cfg.server_model,
                         temperature=cfg.temperature, concurrency=cfg.concurrency, retries=cfg.retries)  # fmt: skip


def _worker(w: Worker, cfg: RegenConfig, n_parts: int, channel) -> None:
    todo = _todo(cfg, n_parts, w.rank, w.world_size)
    if not todo:
        return
    rows = _read(cfg, quiet=True)
    tokenizer = load_tokenizer(cfg.target, cfg.revision)
    model = load_model(cfg.target, w.device, cfg.revision)
    length = cfg.max_length or _row_length(tokenizer, rows, todo, cfg)
    slots = fit_slots(cfg.batch_size or (256 if w.device.type == "cuda" else 32), slot_bytes(model, length), w.device)
    engine = Engine(make_target(model, slots, length), StopRule(stop_token_ids(tokenizer, model)),
                    temperature=cfg.temperature)  # fmt: skip
    # a CPU slows down tenfold on denormal activations, and thrashes with more threads than idle cores
    with flush_denormals(w.device), worker_threads(w):
        _regenerate(engine, tokenizer, rows, todo, cfg, channel.put)


def _row_length(tokenizer, rows: list[dict], todo: list[int], cfg: RegenConfig) -> int:
    """Positions a row of the engine needs: the longest source conversation as rendered, plus
    max_new_tokens for each of its assistant turns (a generous bound: replies may outgrow the
    source's)."""
    kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    longest = 0
    for part in todo:
        for i in _part_rows(part, cfg, len(rows)):
            messages = _conversation(rows[i])
            if isinstance(messages, list):
                text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
                turns = sum(m["role"] == "assistant" for m in messages)
                longest = max(longest, len(tokenizer(text, add_special_tokens=False)["input_ids"])
                              + turns * cfg.max_new_tokens)  # fmt: skip
    return longest + 16


def _seed(seed: int, row: int, turn: int) -> int:
    """A request's sampling seed: its row and turn, never its batch or part."""
    return (seed * 1_000_003 + row) * 1_009 + turn


def _regenerate(backend: Backend, tokenizer, rows: list[dict], todo: list[int], cfg: RegenConfig,
                report: Callable[[dict], None]) -> None:  # fmt: skip
    """Regenerate the rows of parts `todo` on-policy, turn by turn (`dialogue.turn_by_turn`): each
    assistant turn is asked when the one before it is answered, given the target's own earlier
    replies, and each part is committed when its last row is done."""
    kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    decode = reply_decoder(tokenizer)
    convs = {i: _conversation(rows[i]) for part in todo for i in _part_rows(part, cfg, len(rows))}
    part_of = {i: part for part in todo for i in _part_rows(part, cfg, len(rows))}
    remaining = {part: 0 for part in todo}
    truncated: dict[int, bool] = {}
    failed: dict[int, str] = {}
    going_on: set[int] = set()  # rows whose next turn is queued

    def request(i: int, after: int) -> Request | None:
        """Row i's first assistant turn after message `after`; None when it has none left, or when its
        prompt cannot be rendered (the row then holds the reason)."""
        k = next((k for k, m in enumerate(convs[i]) if k > after and m["role"] == "assistant"), None)
        if k is None:
            return None
        try:
            ids = chat_prompt(tokenizer, convs[i][:k], kwargs)
        except RowRejected as e:
            convs[i] = e.reason
            return None
        going_on.add(i)
        return Request(ids, cfg.max_new_tokens, seed=_seed(cfg.seed, i, k), key=(i, k))

    def follow(c: Completion) -> Request | None:
        i, k = c.request.key
        going_on.discard(i)
        if c.finish == ERROR:
            if not c.retry:
                convs[i] = c.error
            return None
        convs[i][k] = {"role": "assistant", "content": c.text if c.text is not None else decode(c.reply_ids)}
        truncated[i] = truncated.get(i, False) or c.finish == LENGTH
        return request(i, k)

    first = [r for i, m in convs.items() if isinstance(m, list) and (r := request(i, -1)) is not None]
    for r in first:
        remaining[part_of[r.key[0]]] += 1
    for part in todo:
        if not remaining[part]:
            _write_part(part, cfg, convs, truncated, len(rows), report)
    for c in turn_by_turn(backend, first, follow, drop=lambda key: part_of[key[0]] in failed):
        i, part = c.request.key[0], part_of[c.request.key[0]]
        if c.finish == ERROR and c.retry:
            failed.setdefault(part, c.error)
            report({"failed": c.error})
            continue
        if c.finish != ERROR:
            report({"tokens": len(c.reply_ids)})
        if i in going_on:
            continue
        remaining[part] -= 1
        if not remaining[part] and part not in failed:
            _write_part(part, cfg, convs, truncated, len(rows), report)


def _write_part(part: int, cfg: RegenConfig, convs: dict, truncated: dict[int, bool], n_rows: int,
                report: Callable[[dict], None]) -> None:  # fmt: skip
    parts = parts_dir(cfg.out)
    tmp = parts / f".part-{part:05d}.{os.getpid()}.tmp"
    rows = _part_rows(part, cfg, n_rows)
    with open(tmp, "w", encoding="utf-8") as f:
        for i in rows:
            c = convs[i]
            if isinstance(c, str):
                rec = {"rejected": c, "row": i}
            elif truncated.get(i) and cfg.drop_truncated:
                rec = {"rejected": f"a reply was cut at --max-new-tokens {cfg.max_new_tokens}", "row": i,
                       "truncated": True}  # fmt: skip
            else:
                rec = {"messages": c, **({"truncated": True} if truncated.get(i) else {})}
            f.write(dumps_line(rec))
    os.replace(tmp, parts / f"part-{part:05d}.jsonl")
    report({"parts": 1, "rows": len(rows)})
