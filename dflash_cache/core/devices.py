"""`--gpus` parsing, process launch, and the torchrun environment, shared by both stages."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_cache.core.errors import UserError
from dflash_cache.core.interrupts import ready_for_interrupts, starting_children, takes_interrupts
from dflash_cache.core.settings import int_list

T = TypeVar("T")


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


def torchrun_worker(gpus: list[int] | None = None) -> Worker | None:
    """The worker described by torchrun's environment, or None outside torchrun.

    torchrun starts `--nproc-per-node` processes on each node; LOCAL_RANK picks this one's GPU,
    from `gpus` where given (`--gpus 5-7` beside an extraction on 0-4 must not take GPUs 0-2)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    local = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if gpus:
        if len(gpus) != local_world:
            raise DeviceError(
                f"--gpus names {len(gpus)} GPUs but torchrun starts {local_world} processes on this "
                f"node: give --nproc-per-node {len(gpus)}, or leave --gpus out (GPU = LOCAL_RANK)"
            )
        device = torch.device("cuda", gpus[local])
    else:
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return Worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, local, local_world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(index: int, fn: Callable, devices: list[torch.device], args: tuple, interruptible: bool) -> None:
    """A spawned worker: started deaf to Ctrl-C (see launch), it answers it from here on."""
    ready_for_interrupts(interruptible)  # a KeyboardInterrupt here ends quietly: torch's spawn wrapper swallows it
    _run(index, fn, devices, args)


def _run(index: int, fn: Callable, devices: list[torch.device], args: tuple) -> None:
    worker = Worker(index, len(devices), devices[index], index)
    if worker.device.type == "cuda":
        torch.cuda.set_device(worker.device)
    fn(worker, *args)


def launch(fn: Callable[..., None], args: tuple, *, gpus: list[int] | None = None, procs: int = 1,
           store: bool = False) -> None:  # fmt: skip
    """Run `fn(worker, *args)` once per GPU (or per CPU process), or in this process.

    Under torchrun this process is one worker already. A single CPU process runs inline, so the
    simple case needs no subprocess. MASTER_ADDR/PORT are set for torch.distributed. With `store`,
    this process also serves the key-value store through which several copies of a sharded model
    (`Group`) each form their own process group, as torchrun's agent serves its workers: it outlives
    every worker, so no copy loses it when another ends first.
    """
    worker = torchrun_worker(gpus)
    if worker is not None:
        if procs > 1 and not gpus:
            raise DeviceError(f"--procs {procs} under torchrun: torchrun's --nproc-per-node sets the processes")
        if worker.device.type == "cuda":
            torch.cuda.set_device(worker.device)
        fn(worker, *args)
        return
    devices = [torch.device("cuda", g) for g in gpus] if gpus else [torch.device("cpu")] * max(1, procs)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    if len(devices) == 1:
        _run(0, fn, devices, args)
        return
    served = None
    if store:
        served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.environ[STORE_ENV] = f"127.0.0.1:{served.port}"
    # The workers import torch, transformers and the stage before they run: a Ctrl-C then would
    # print a traceback from each. They start deaf to it (dflash_cache.core.interrupts), and this
    # process ends them on Ctrl-C, also on one that came while they were being started.
    context = None
    try:
        with starting_children():
            context = mp.start_processes(_entry, args=(fn, devices, args, takes_interrupts()), nprocs=len(devices),
                                         join=False, start_method="spawn")  # fmt: skip
        if store:
            _settle(context.processes, COPY_GRACE_S)
        while not context.join():
            pass
    except KeyboardInterrupt:
        _end(context.processes if context is not None else [], COPY_GRACE_S if store else 0.0)
        raise
    finally:
        if served is not None:
            os.environ.pop(STORE_ENV, None)


STORE_ENV = "DFLASH_GROUP_STORE"  # host:port of the store that launch serves to its workers
COPY_GRACE_S = 60.0  # how long the ranks of sharded copies get to stop together on Ctrl-C (copy_interrupts)


def _settle(processes: list, grace: float) -> None:
    """Wait until every worker has ended, or one has failed and the others have had `grace` seconds
    to end too. A rank of a sharded copy that dies leaves its partners with a failed collective,
    which they end on cleanly if given the time; torch's join would terminate them at once."""
    import multiprocessing.connection

    running = list(processes)
    while running:
        multiprocessing.connection.wait([p.sentinel for p in running])
        running = [p for p in running if p.exitcode is None]
        if any(p.exitcode for p in processes if p.exitcode is not None):
            _end(running, grace)
            return


def _end(processes: list, grace: float) -> None:
    """End the workers after a Ctrl-C: those still running after `grace` seconds (a second Ctrl-C
    cuts it short) are terminated. Workers of sharded copies stop at their next forward together
    and commit nothing half-done; terminated inside a collective, they would leave their buffers
    and semaphores behind."""
    deadline = time.monotonic() + grace
    try:
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join()


@contextmanager
def copy_interrupts(group: Group) -> Iterator[Callable[[Callable], Callable]]:
    """Ctrl-C in a copy of a sharded model, answered by all its ranks at the same forward.

    A rank that stopped at once would leave the others of its copy waiting for it inside a
    collective, where no signal reaches Python. So in a copy of several ranks a Ctrl-C is only
    noted, and the wrapper that this yields puts before each forward of `fn` a check that the
    ranks make together (over gloo, on the host: no GPU sync); when any of them was interrupted
    all raise KeyboardInterrupt there. A copy of one rank keeps Ctrl-C as it is."""
    if group.size == 1:
        yield lambda fn: fn
        return
    noted: list[int] = []
    flags = dist.new_group(backend="gloo")
    previous = signal.getsignal(signal.SIGINT)
    own = previous is not signal.SIG_IGN and threading.current_thread() is threading.main_thread()
    if own:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))

    def together(fn: Callable) -> Callable:
        def run(*args, **kwargs):
            flag = torch.tensor([len(noted)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=flags)
            if flag.item():
                raise KeyboardInterrupt
            return fn(*args, **kwargs)

        return run

    try:
        yield together
    finally:
        if own:
            signal.signal(signal.SIGINT, previous)


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


def idle_cores(interval: float = 0.2) -> float:
    """Cores this machine leaves idle right now (from /proc/stat over `interval` seconds); all of
    them where that cannot be read."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks[:8])  # idle + iowait, all but guest time

    cores = _cores()
    try:
        idle0, total0 = sample()
        time.sleep(interval)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return float(cores)
    return cores * (idle1 - idle0) / max(1, total1 - total0)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(share: int, idle: Callable[[], float] = idle_cores) -> int:
    """torch threads for a CPU worker: its share of the cores (`share` workers on this machine),
    and no more than the cores that are idle when it starts, so that a run beside other busy
    processes does not thrash. On 2 cores beside another busy process, a train with torch's
    default of one thread per core ran at 62 tokens/s and with one thread at 1,273: OpenMP teams
    spin while a member waits for a core (the CLI also makes them sleep instead on a machine
    without GPUs: cli/__init__.py). Never more than the process has; OMP_NUM_THREADS, where
    set, is kept."""
    fair = max(1, min(_cores() // share, torch.get_num_threads()))
    return fair if "OMP_NUM_THREADS" in os.environ else max(1, min(fair, int(idle() + 0.5)))


@contextmanager
def worker_threads(w: Worker, per_gpu: int | None = None, idle: Callable[[], float] = idle_cores) -> Iterator[None]:
    """torch's intra-op CPU threads for one worker while it runs, restored after (a one-process
    run works inside the caller's process). A CPU worker takes `cpu_threads` (the workers on this
    machine split its cores: torchrun's other nodes have their own), and a GPU worker takes at
    most `per_gpu`: where its CPU work is small ops and copies, spinning OpenMP teams of several
    processes only fight over the cores."""
    before = torch.get_num_threads()
    if w.device.type == "cpu":
        torch.set_num_threads(cpu_threads(w.on_this_machine, idle))
    elif w.device.type == "cuda" and per_gpu is not None:
        torch.set_num_threads(min(per_gpu, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_device() -> torch.device:
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
