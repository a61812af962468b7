"""A command's result on stdout: one JSON object with --json, else the lines or the table a person
reads (progress and messages go to stderr, through `ui.console`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from .ui import console, human_bytes

JSON_HELP = "Print the result as one JSON object on stdout."


def emit(result: dict, as_json: bool, human: Callable[[dict], None]) -> None:
    """The command's result: one JSON object on stdout with --json, else `human`'s lines."""
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        human(result)


def print_json(d: dict) -> None:
    """Bench results: always one JSON object on stdout (--json is accepted for uniformity)."""
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}, indent=2))


def print_extract(s: dict, cfg: Any) -> None:
    """`dflash extract`'s summary, with the mask token where it was picked for the user, and a note
    when the forward passes waited for the unit writers."""
    console.print(
        f"cached {s['samples']} samples, {s['tokens']:,} tokens in {s['units']} units; {s['rejected']} rows "
        f"rejected (see {cfg.out}/rejected.jsonl); padding {100 * s['padding']:.1f}%; wrote "
        f"{human_bytes(s['bytes_written'])} in {s['seconds']:.1f}s ({s['startup_s']:.1f}s to start; forward "
        f"loop {s['forward_tokens_per_s']:,.0f} tokens/s)"
    )
    if s["mask_token"].get("rule") == "unused_special":
        m = s["mask_token"]
        console.print(f"mask token: {m['id']} ({m['token']}): {m['reason']}", markup=False)
    ranks = max(1, len(cfg.gpus or []) or cfg.procs)
    if s["buffer_wait_s"] > 0.05 * s["seconds"] * ranks:
        console.print(f"note: the forward passes waited {s['buffer_wait_s']:.1f}s in all for unit writers "
                      "(compression or the disk bound this run); more --writers may help if cores idle")


def print_eval(r: dict) -> None:
    """`dflash eval`'s figures, a line each, by turn where prompts have several."""
    s = r["settings"]
    kwargs = f", template {json.dumps(s['chat_template_kwargs'])}" if s["chat_template_kwargs"] else ""
    turns = f" ({s['turn_prompts']} with their later turns)" if s["turn_prompts"] != s["prompts"] else ""
    print(f"{s['prompts']} prompts{turns}, B={s['block_size']}, temperature {s['temperature']}{kwargs}, "
          f"{s['device']} {s['dtype']}")  # fmt: skip
    for name, value in (("tau/prompt", f"{r['tau_per_prompt']:.3f}"), ("tau (pooled)", f"{r['tau']:.3f}"),
                        ("steps", r["steps"]), ("new tokens", r["new_tokens"]),
                        ("spec tok/s", f"{r['spec_tok_s']:.1f}"), ("target tok/s", f"{r['target_tok_s']:.1f}"),
                        ("speedup", f"{r['speedup']:.2f}x")):  # fmt: skip
        print(f"  {name:<13}{value}")
    if len(r["turns"]) > 1:
        for t in r["turns"]:
            print(f"  turn {t['turn']:<8}tau/prompt {t['tau_per_prompt']:.3f}, pooled {t['tau']:.3f} "
                  f"({t['prompts']} prompts)")  # fmt: skip
    if len(r["by_context"]) > 1:  # prompts of several lengths: each bucket of prompt tokens apart
        for name, b in r["by_context"].items():
            speed = f", {b['tok_s']:.1f} tok/s, {b['speedup']:.2f}x" if "speedup" in b else ""
            kept = f", keeps {b['kept']:.0%} of its files' tau at their shortest" if "kept" in b else ""
            print(f"  {name + ' tokens':<13}tau/prompt {b['tau_per_prompt']:.3f}, pooled {b['tau']:.3f} "
                  f"({b['prompts']} prompts){kept}{speed}")  # fmt: skip
    print("  accept len   " + "  ".join(f"{n}:{c}" for n, c in enumerate(r["histogram"], 1)))
    if r["rejected"]:
        first = r["rejected"][0]
        print(f"  rejected     {len(r['rejected'])} prompts (turns) past the target's positions, left out; row "
              f"{first['index']} turn {first['turn']}: {first['reason']}")  # fmt: skip
    if r["lookup"]:
        print(f"  prompt lookup tau/prompt {r['lookup']['tau_per_prompt']:.3f}, pooled {r['lookup']['tau']:.3f} "
              "(the n-gram baseline on the same outputs)")  # fmt: skip


def print_demo(results: dict) -> None:
    """`dflash demo`'s table: tau and speed of each drafter."""
    print(f"{'drafter':<10} {'tau':>6} {'spec tok/s':>11} {'target tok/s':>13} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r.tau:>6.3f} {r.spec_tok_s:>11.1f} {r.target_tok_s:>13.1f} {r.speedup:>7.2f}x")


def print_sets_table(r: dict) -> None:
    """The benchmark-set evaluation's table (`dflash eval-sets`, `dflash recipe`): a row per set and run."""
    from rich.console import Console
    from rich.table import Table

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    table = Table(title=f"{r['target']}: batch {r['batch_size']}, temperature {r['temperature']}, up to "
                        f"{r['max_new_tokens']} new tokens" + (", first turns" if r["first_turn"] else ""))  # fmt: skip
    columns = ("set", "prompts", "run", "tau/prompt", "tau pooled", "tau/prompt by turn", "tok/s", "speedup",
               "decode speedup")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("set", "run") else "right")
    for row in r["table"]:
        s = r["sets"][row["set"]]
        prompts = f"{s['prompts']}" + (f" ({s['turn_prompts']} turns)" if s["turn_prompts"] != s["prompts"] else "")
        prompts += f", {len(s['rejected'])} rejected" if s.get("rejected") else ""
        by_turn = " / ".join(f"{t:.2f}" for t in row["tau_by_turn"]) if row["tau_by_turn"] else "-"
        speedups = ["-" if row.get(k) is None else f"{row[k]:.2f}x" for k in ("speedup", "decode_speedup")]
        run = row["run"] + (" (replayed)" if s["runs"][row["run"]].get("replayed") else "")
        table.add_row(row["set"], prompts, run, num(row["tau_per_prompt"], ".3f"), num(row["tau"], ".3f"),
                      by_turn, num(row["tok_s"], ".1f"), *speedups)  # fmt: skip
    stdout = Console(width=None if sys.stdout.isatty() else 160)
    stdout.print(table)
    if by_context := _context_table(r):
        stdout.print(by_context)


def _context_table(r: dict):
    """tau per prompt of each set and run by the prompts' length in tokens (a column for each bucket
    that holds a prompt of some set), with each bucket's prompts and, for a decoded run, its speedup
    over the target alone; None for a result without them."""
    from rich.table import Table

    rows = [row for row in r["table"] if row.get("tau_by_context")]
    buckets: dict[str, tuple[int, int]] = {}
    for row in rows:
        for name, b in r["sets"][row["set"]]["runs"][row["run"]]["by_context"].items():
            buckets[name] = tuple(b["tokens"])
    if not buckets:
        return None
    order = sorted(buckets, key=buckets.__getitem__)
    table = Table(title="tau/prompt by prompt length in tokens (prompts); what it keeps of the same files' tau at "
                        "the shortest length, where the prompts name their files; the speedup where decoded")
    for col in ("set", "run", *order):
        table.add_column(col, justify="left" if col in ("set", "run") else "right")
    for row in rows:
        figures = r["sets"][row["set"]]["runs"][row["run"]]["by_context"]
        table.add_row(row["set"], row["run"], *(_context_cell(figures[b]) if b in figures else "-" for b in order))
    return table


def _context_cell(b: dict) -> str:
    """A bucket's tau per prompt, its prompts, what it keeps of the shortest bucket's (`metrics.kept_figures`),
    and where it was decoded at batch 1, the speedup."""
    return (f"{b['tau_per_prompt']:.2f} ({b['prompts']})" + (f" {b['kept']:.0%}" if "kept" in b else "")
            + (f" {b['speedup']:.2f}x" if "speedup" in b else ""))  # fmt: skip
