"""`--gpus` parsing, where a worker runs (`Worker`), and keeping the device fed: host-to-device
copies that queue, the GPU throttle, denormals flushed on a CPU."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflash_cache.core.errors import UserError
from dflash_cache.core.settings import int_list


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`. A host tensor goes through pinned memory: a copy from pageable memory
    returns only once the GPU's stream has reached it, so the host would wait out the kernels queued
    before it (the previous step's, the previous batch's) before preparing the next; a copy from
    pinned memory is queued."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceError(UserError, ValueError):
    """A device request this machine cannot serve."""


@dataclass(frozen=True)
class Worker:
    """Where one process runs and which share of the work it owns."""

    rank: int
    world_size: int
    device: torch.device
    local_rank: int = 0
    local_world_size: int | None = None  # processes on this machine; None: all of them (one machine)

    @property
    def on_this_machine(self) -> int:
        """Processes sharing this machine's CPU cores (torchrun's other nodes have their own)."""
        return self.local_world_size or self.world_size


def parse_gpus(spec: str) -> list[int]:
    """'0-4' -> [0..4]; '0,2,5-7' -> [0, 2, 5, 6, 7]; each id a GPU of this machine."""
    try:
        ids = int_list(spec)
    except ValueError as e:
        why = str(e) if str(e).startswith("the range") else "expected ids and ranges like 0-4 or 0,2,5-7"
        raise DeviceError(f"--gpus {spec!r}: {why}") from None
    return check_gpus(ids)


def check_gpus(ids: list[int] | None) -> list[int] | None:
    """GPU ids (from a flag or a config file) that are distinct and exist on this machine."""
    if ids is None:
        return None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise DeviceError(f"--gpus {ids}: expected distinct non-negative ids")
    available = torch.cuda.device_count()
    missing = [i for i in ids if i >= available]
    if missing:
        raise DeviceError(f"--gpus {ids}: GPU {missing[0]} does not exist (this machine has {available})")
    return ids


def default_device() -> torch.device:
    """The device this process runs on: its current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class GpuThrottle:
    """Keeps the launching thread at most `depth` batches ahead of the GPU.

    Unchecked, it fills CUDA's launch queue and then blocks inside a kernel launch while holding
    the GIL, which starves the threads that compress units (extract) or decode batches (train).
    Waiting on an event instead releases the GIL while the GPU works.
    """

    def __init__(self, cuda: bool, depth: int = 2):
        self.cuda, self.depth = cuda, depth
        self.events: deque[torch.cuda.Event] = deque()

    def mark(self) -> None:
        if not self.cuda:
            return
        event = torch.cuda.Event()
        event.record()
        self.events.append(event)
        while len(self.events) > self.depth:
            self.events.popleft().synchronize()


@contextmanager
def flush_denormals(device: torch.device) -> Iterator[None]:
    """On a CPU, treat float denormals as zero while inference runs. Small models' activations
    decay into them, and x86 arithmetic on denormals is slow: eval's target decoding ran at 10.8
    tokens/s with them and 105 without (issue 17). Restored afterwards: the setting is global."""
    if device.type != "cpu" or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
