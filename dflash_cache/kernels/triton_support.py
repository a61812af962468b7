"""Where the project's Triton kernels can run: on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1: how the CPU tests run them). Light: importing it loads no Triton."""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

_INSTALLED = importlib.util.find_spec("triton") is not None  # found without importing it


def available() -> bool:
    """Whether Triton is installed (it ships with torch's CUDA builds). A constant, so that a
    compiled function that asks traces nothing."""
    return _INSTALLED


def interpreted() -> bool:
    """Whether Triton runs kernels on the CPU, in its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device(t: Tensor) -> bool:
    """Whether `t` sits where Triton kernels run: a GPU tensor, or a CPU one under the interpreter
    (`available` says whether Triton itself imports)."""
    return t.is_cuda or (t.device.type == "cpu" and interpreted())


def pdl_options(t: Tensor, wanted: bool = True) -> dict:
    """Launch options for a kernel with a `PDL` flag. On a Hopper GPU or newer it launches with
    programmatic dependent launch: it may start while the kernel before it finishes, and waits for
    it (`tl.extra.cuda.gdc_wait`) before it reads anything that kernel may write, so a step's
    kernels chain without the launch gap between them, and work that reads nothing of the step (a
    product's weights) overlaps the kernel before. After a kernel that never signals (the
    compiler's, cuBLAS's), it starts when that one ends, as usual. Elsewhere (the interpreter, older
    GPUs), and where not `wanted` (a benchmark's plain launch), the stream orders kernels as usual."""
    if not wanted or not t.is_cuda or interpreted() or torch.cuda.get_device_capability(t.device)[0] < 9:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


_COUNTS: dict[tuple[str, torch.device], Tensor] = {}


def zeroed_counts(owner: str, device: torch.device, n: int) -> Tensor:
    """n int32 counters, zero, for a kernel whose programs count themselves done so that the last
    one finishes the work (merging the others' partial results) and sets its counter back to zero.
    One buffer per owner and device, reused by every launch: kernels on one stream run one after
    the other (a kernel launched with PDL waits for the one before it first). Made by a call
    before any CUDA graph captures one."""
    counts = _COUNTS.get((owner, device))
    if counts is None or counts.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run a step of this size once before capturing it in a CUDA graph")
        counts = _COUNTS[owner, device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return counts
