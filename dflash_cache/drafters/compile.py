"""`torch.compile` for the CUDA path of the drafter's pieces: its layer stages, the chunked losses
and flex attention."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch._inductor import config as inductor_config

_INDUCTOR_OPTIONS = ({"triton.mix_order_reduction_non_strict_mode": True}
                     if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode") else {})


def compile_for_cuda(fn: Callable, **kwargs) -> Callable | None:
    """`torch.compile(fn)` for the CUDA path, or None where compiling is unsupported. Compiled
    lazily: nothing is compiled until the first call. Shapes vary from batch to batch, so the
    kernels are built for dynamic sizes.

    The compiled pieces are small stages that run inside a DDP module's forward. Dynamo's DDP
    optimizer would split each of them at gradient-bucket boundaries, which only pays for a
    whole-model compile; on two H200s it kept rank 0 compiling for minutes while rank 1 waited
    in the first all-reduce (BENCHMARKS.md, "Compiled stages under DDP"). DDP already overlaps the all-reduce with
    the backward through its own bucket hooks, so it is turned off.

    Inductor fuses two reductions of different loop orders only above a size it checks with a
    guard on the token count, so the first batch on the other side of 5,120 context tokens
    recompiled the layer stages mid-run (a 20 s stall on an H200). Its non-strict mode skips
    those size checks: two recompiles fewer a process, at the same step time (BENCHMARKS.md,
    "Recompiles")."""
    torch._dynamo.config.optimize_ddp = False
    try:
        return torch.compile(fn, **{"dynamic": True, "options": _INDUCTOR_OPTIONS, **kwargs})
    except Exception:  # pragma: no cover - torch.compile unsupported on this Python/platform
        return None


def compiled_or_eager(fn: Callable, what: str) -> Callable:
    """`fn` compiled for fixed shapes (a decode step's, captured in a CUDA graph), which falls back
    to `fn` itself, with one warning, when the compiler fails on it."""
    compiled = torch.compile(fn, dynamic=False)
    state = {"fn": compiled}

    def call(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a compiler failure: run eagerly, loudly
            if state["fn"] is fn:
                raise
            first = (str(e).strip().splitlines() or [""])[0][:200]  # inductor appends pages of advice
            warnings.warn(f"torch.compile of {what} failed ({type(e).__name__}: {first}); running it eagerly",
                          stacklevel=2)  # fmt: skip
            state["fn"] = fn
            return fn(*args, **kwargs)

    return call
