"""Where the project's Triton kernels can run: on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1: how the CPU tests run them). Light: importing it loads no Triton."""

from __future__ import annotations

import functools
import os

from torch import Tensor


@functools.cache
def available() -> bool:
    """Whether Triton imports (it ships with torch's CUDA builds)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels on the CPU, in its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device(t: Tensor) -> bool:
    """Whether `t` sits where Triton kernels run: a GPU tensor, or a CPU one under the interpreter
    (`available` says whether Triton itself imports)."""
    return t.is_cuda or (t.device.type == "cpu" and interpreted())
