"""`dflash bench regen` and `dflash bench eval`: generation speed beside its memory-bandwidth bound.

A decode step must read every weight once, so `batch x bandwidth / weight bytes` tokens/s is the
most any decoder reaches at that batch (the bound the figures are set against); reading the rows'
keys and values as well lowers it (`bound_with_kv_tok_s`, for the slot cache, which reads every
row's whole buffer). The bandwidth is measured here, by a device-to-device copy.

regen decodes the same prompts twice, eagerly and with the step captured as a CUDA graph, and
checks that both give the same tokens. The target is a model directory, or a random model of a
named shape built on the GPU (`dflash_cache.bench.SHAPES`), which decodes to its length limit
since it never says its stop token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_cache.bench import shape_config
from dflash_cache.extract.target import load_tokenizer, stop_token_ids
from dflash_cache.generate import Engine, Request, StopRule, fit_slots, load_model, slot_bytes
from dflash_cache.generate.targets import SlotTarget


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth in bytes/s: a large copy, bytes read plus bytes written, median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(times[1:]))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a decode step reads (a tied embedding and head counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def random_model(shape: str, device: torch.device) -> nn.Module:
    """A random-weight bf16 model of a named shape (`dflash_cache.bench.SHAPES`), built on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape_config(shape)), dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def _prompts(tokenizer, data: str | None, n: int, mean_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The first `n` prompts of `data` through the chat template, or random-token prompts of
    log-normal lengths around `mean_tokens`."""
    if data is not None:
        from dflash_cache.evaluate import load_prompts

        prompts = load_prompts(data, tokenizer, n)
        return [prompts[i % len(prompts)] for i in range(n)]
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean_tokens), 0.5, n), 8, 4 * mean_tokens).astype(int)
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in lengths]


def regen(target: str | None = None, *, shape: str | None = None, data: str | None = None, prompts: int = 1024,
          prompt_tokens: int = 128, max_new_tokens: int = 256, batch_size: int = 256) -> dict[str, Any]:  # fmt: skip
    """New tokens/s of the embedded engine, eager and CUDA-graphed side by side, beside the bound."""
    device = torch.device("cuda")
    if (target is None) == (shape is None):
        raise ValueError("give a target directory or a --shape")
    model = load_model(target, device) if target else random_model(shape, device)
    tokenizer = load_tokenizer(target) if target else None
    stop = StopRule(stop_token_ids(tokenizer, model) if tokenizer is not None else [])
    ids = _prompts(tokenizer, data, prompts, prompt_tokens, model.config.vocab_size)
    length = max(map(len, ids)) + max_new_tokens + 16
    slots = fit_slots(batch_size, slot_bytes(model, length), device)
    tgt = SlotTarget(model, slots, length)
    requests = [Request(p, max_new_tokens, key=i) for i, p in enumerate(ids)]
    bw, weights = copy_bandwidth(device), weight_bytes(model)
    kv = slot_bytes(model, tgt.length) * slots
    result: dict[str, Any] = {"target": target or shape, "prompts": len(ids), "slots": slots, "length": tgt.length,
                              "mean_prompt_tokens": float(np.mean([len(p) for p in ids])),
                              "max_new_tokens": max_new_tokens, "device": torch.cuda.get_device_name(device),
                              "bandwidth_GBps": bw / 1e9, "weight_GB": weights / 1e9, "kv_GB": kv / 1e9,
                              "bound_tok_s": slots * bw / weights,
                              "bound_with_kv_tok_s": slots * bw / (weights + kv)}  # fmt: skip
    outputs = {}
    for name, graphs in (("eager", False), ("graphs", True)):
        engine = Engine(tgt, stop, graphs=graphs)
        list(engine.stream([Request(ids[0], 8, key=-1)]))  # warm-up, and the graph's capture
        torch.cuda.synchronize(device)
        steps, t0 = engine.steps, time.perf_counter()
        done = {c.request.key: c.ids for c in engine.stream(requests)}
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        tokens = sum(map(len, done.values()))
        outputs[name] = [done[i] for i in range(len(ids))]
        steps = engine.steps - steps
        result |= {f"{name}_seconds": seconds, f"{name}_tok_s": tokens / seconds, f"{name}_steps": steps,
                   f"{name}_occupancy": tokens / max(1, steps * slots)}  # fmt: skip
    result["new_tokens"] = sum(map(len, outputs["graphs"]))
    result["graphs_equal_eager"] = outputs["graphs"] == outputs["eager"]
    result["graphs_vs_eager"] = result["graphs_tok_s"] / result["eager_tok_s"]
    result["fraction_of_bound"] = result["graphs_tok_s"] / result["bound_tok_s"]
    return result


def untrained_like(export: Path, out: Path, seed: int = 0) -> Path:
    """A drafter of an export's family and shape with seeded random weights: the tau of no training."""
    from dflash_cache import drafters

    _, config, family = drafters.load_serving(export)
    torch.manual_seed(seed)
    family.save_serving(family.model(config), config, out)
    return out


def evaluation(target: str, drafters: dict[str, Path], data: str, *, max_new_tokens: int = 512,
               limit: int | None = None, batch_size: int | None = None,
               out: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """`dflash eval` of each drafter on the same prompts (the target alone once, with the first),
    the whole run timed, each figure beside the bound of its decoding."""
    from dflash_cache.app_config import EvalConfig
    from dflash_cache.evaluate import evaluate

    t0 = time.perf_counter()
    result: dict[str, Any] = {"target": target, "data": data, "max_new_tokens": max_new_tokens, "runs": {}}
    for i, (name, drafter) in enumerate(drafters.items()):
        cfg = EvalConfig(target=target, drafter=drafter, data=data, max_new_tokens=max_new_tokens, limit=limit,
                         batch_size=batch_size)  # fmt: skip
        r = evaluate(cfg, baseline=i == 0)
        result["runs"][name] = {k: getattr(r, k) for k in ("tau", "tau_per_prompt", "histogram", "steps",
                                                           "new_tokens", "spec_tok_s")}  # fmt: skip
        result["runs"][name]["seconds"] = r.settings["spec_seconds"]
        result["batch_size"], result["prompts"] = r.settings["batch_size"], r.settings["prompts"]
        if i == 0:
            result["runs"]["target alone"] = {"tok_s": r.target_tok_s, "seconds": r.settings["target_seconds"],
                                              "new_tokens": r.settings["target_new_tokens"]}  # fmt: skip
    result["seconds"] = time.perf_counter() - t0
    if torch.cuda.is_available():
        device = torch.device("cuda")
        model = load_model(target, device)
        bw, weights = copy_bandwidth(device), weight_bytes(model)
        result |= {"bandwidth_GBps": bw / 1e9, "weight_GB": weights / 1e9,
                   "target_alone_bound_tok_s": result["batch_size"] * bw / weights}  # fmt: skip
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result
