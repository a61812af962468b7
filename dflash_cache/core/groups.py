"""Process groups of a run, and copies of a model sharded over several processes (`Group`):
which ranks form a copy, and the process group that each copy forms of its own."""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from dflash_cache.core.devices import DeviceError, Worker

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """The copy of a model that a worker runs, where one copy is sharded over `size` processes.

    Ranks `index * size ... index * size + size - 1` run copy `index` of `count`. Work is dealt to
    copies, not ranks; every rank of a copy runs the same forwards, and the copy's first rank, its
    lead, is the one that writes. With `size` 1 every worker is a copy of its own and its lead.
    """

    index: int  # which copy this worker belongs to
    count: int  # copies running side by side
    size: int = 1  # processes sharding one copy
    rank: int = 0  # this worker's place in its copy

    @classmethod
    def of(cls, w: Worker, size: int) -> Group:
        return cls(w.rank // size, copies(w.world_size, size), size, w.rank % size)

    @property
    def lead(self) -> bool:
        """Whether this worker writes its copy's results."""
        return self.rank == 0

    @property
    def first_lead(self) -> bool:
        """Whether this worker writes what the whole run writes once (the lead of copy 0)."""
        return self.index == 0 and self.lead


def copies(processes: int, size: int) -> int:
    """How many copies of `size` processes each `processes` processes run; refused unless whole."""
    if size < 1 or processes % size:
        raise DeviceError(f"--tp {size}: {processes} processes do not split into copies of {size}; start a "
                          "multiple of --tp processes (--gpus, --procs, or torchrun's)")  # fmt: skip
    return processes // size


def lead_says(group: Group, value: T) -> T:
    """The lead's `value` on every rank of its copy (under the copy's process group), so that the
    ranks act alike on what only the lead looked at; `value` itself where a copy is one rank."""
    if group.size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


STORE_ENV = "DFLASH_GROUP_STORE"  # host:port of the store that launch serves to its workers


def shared_store(w: Worker) -> dist.Store:
    """The key-value store that every worker of the run reaches: the one `launch` serves, or under
    torchrun its rendezvous store (served by torchrun's agent)."""
    where = os.environ.get(STORE_ENV)
    if where:
        host, port = where.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False)
    return next(dist.rendezvous("env://", w.rank, w.world_size))[0]


@contextmanager
def process_group(w: Worker, group: Group | None = None) -> Iterator[None]:
    """The default process group of a run of several workers (NCCL on GPUs, gloo on CPUs), for
    the block's duration; a single worker gets none. With `group`, the default group is the
    worker's copy alone (its `size` ranks), each copy's formed under a prefix of `shared_store`:
    a copy then shards its model as if it were the whole world, which is what transformers'
    sharded loading expects.

    Whatever holds the group, such as a DDP model, is freed before the group is destroyed. A
    DDP reducer that outlives destroy_process_group ends the group itself when it is freed,
    holding the GIL, and ProcessGroupGloo's destructor then joins a thread that waits for the
    GIL: the worker hangs at exit (seen once in tests/test_train.py's DDP gradient test, torch
    2.13 CPU). So cycles are collected first, and a failed block's frames, which the exception
    keeps alive, are cleared."""
    distributed = (group.size if group else w.world_size) > 1
    backend = "nccl" if w.device.type == "cuda" else "gloo"
    if distributed and not dist.is_initialized():
        if group is None or group.count == 1:
            dist.init_process_group(backend, rank=w.rank, world_size=w.world_size)
        else:
            store = dist.PrefixStore(f"copy{group.index}/", shared_store(w))
            dist.init_process_group(backend, store=store, rank=group.rank, world_size=group.size)
    try:
        yield
    except BaseException as e:
        if distributed:
            traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if distributed and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
