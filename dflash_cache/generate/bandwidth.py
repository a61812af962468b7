"""A decode step's memory-bandwidth bound: the bytes of weights a step reads, and the device's
bandwidth measured by a copy. `dflash bench regen` and `dflash eval-sets` set their speeds
against it.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn


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
