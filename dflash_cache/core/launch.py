"""Starting a run's workers: one process per GPU (or per CPU process), this process alone, or the
one torchrun started; and Ctrl-C across them and across the ranks of a sharded copy."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_cache.core.devices import DeviceError, Worker
from dflash_cache.core.groups import STORE_ENV, Group
from dflash_cache.core.interrupts import ready_for_interrupts, starting_children, takes_interrupts


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
