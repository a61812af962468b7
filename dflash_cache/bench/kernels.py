"""Where a profiled step's device time goes: each kernel's class (GEMM, flex attention, the
optimizer, ...) by its name, and the classes' shares of the kernel time. The MFU figures of
BENCHMARKS.md are read against these shares."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel, by its name as the profiler reports it."""
    n = name.lower()
    if "flex" in n or "triton_tem" in n:
        return "flex attention"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "GEMM"
    if "adam" in n:
        return "fused AdamW"
    if "multi_tensor_apply" in n or "lpnorm" in n:
        return "foreach (gradient clipping)"
    if "triton" in n:
        return "fused (triton)"
    if "softmax" in n or "cross_entropy" in n or "nll" in n or "logsumexp" in n:
        return "softmax/CE"
    if "copy" in n or "cast" in n or "memcpy" in n:
        return "copies/casts"
    if "reduce" in n:
        return "reductions"
    return "elementwise/other"


def kernel_breakdown(events: Iterable[Any], steps: int, top: int = 12) -> dict[str, Any]:
    """GPU time a step (ms), its shares by kernel class, and the `top` kernels, from the averaged
    events (`key_averages()`) of a torch profiler that ran `steps` steps. Only the kernels count: a
    host range (an op, an autograd function, a compiled graph) carries its kernels' time too, and so
    does a range annotated on the GPU's timeline (`Optimizer.step#AdamW.step`). Empty where no
    kernel ran (a CPU)."""
    from torch.autograd import DeviceType

    by_class: dict[str, float] = defaultdict(float)
    kernels = []
    for e in events:
        t = e.device_time_total
        if t <= 0 or e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        by_class[kernel_class(e.key)] += t
        kernels.append((t, e.key[:110]))
    total = sum(by_class.values())
    if not total:
        return {}
    return {"kernel_ms_per_step": total / steps / 1e3,
            "profile": {k: round(v / total, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels": [(round(t / total, 3), k) for t, k in sorted(kernels, reverse=True)[:top]]}  # fmt: skip
