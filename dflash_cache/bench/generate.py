"""`dflash bench regen`: new tokens/s of the embedded generation engine beside its memory-bandwidth
bound.

A decode step must read every weight once, so `batch x bandwidth / weight bytes` tokens/s is the
most any decoder reaches at that batch (the bound the figures are set against); reading the rows'
keys and values as well lowers it (`bound_with_kv_tok_s`, for the slot cache, which reads every
row's whole buffer). The bandwidth is measured here, by a device-to-device copy.

regen decodes the same prompts twice, eagerly and with the step captured as a CUDA graph, and
checks that both give the same tokens. The target is a model directory, or a random model of a
named shape built on the GPU (`shapes.SHAPES`), which decodes to its length limit since it never
says its stop token.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_cache.bench.config import RegenBenchConfig
from dflash_cache.bench.shapes import shape_config
from dflash_cache.generate import Engine, Request, StopRule, fit_slots, load_model, slot_bytes
from dflash_cache.generate.bandwidth import copy_bandwidth, weight_bytes
from dflash_cache.generate.dialogue import load_prompts
from dflash_cache.generate.targets import SlotTarget
from dflash_cache.target.load import load_tokenizer, stop_token_ids


def random_model(shape: str, device: torch.device, positions: int = 0) -> nn.Module:
    """A random-weight model of a named shape (`shapes.SHAPES`), built on the device: bf16 on a GPU,
    float32 on a CPU, with at least `positions` positions (the shape's own when more)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = shape_config(shape)
    config = {**config, "max_position_embeddings": max(config.get("max_position_embeddings", 0), positions)}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype)
    return model.eval().requires_grad_(False)


def _prompts(tokenizer, data: str | None, n: int, mean_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The first `n` prompts of `data` through the chat template, or random-token prompts of
    log-normal lengths around `mean_tokens`."""
    if data is not None:
        prompts = load_prompts(data, tokenizer, n)
        return [prompts[i % len(prompts)] for i in range(n)]
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean_tokens), 0.5, n), 8, 4 * mean_tokens).astype(int)
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in lengths]


def regen(target: str | None = None, *, shape: str | None = None, data: str | None = None,
          prompts: int = RegenBenchConfig.prompts, prompt_tokens: int = RegenBenchConfig.prompt_tokens,
          max_new_tokens: int = RegenBenchConfig.max_new_tokens,
          batch_size: int = RegenBenchConfig.batch_size) -> dict[str, Any]:  # fmt: skip
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
