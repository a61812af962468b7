"""Ctrl-C across the processes of a run: the process the user started answers it, once.

A terminal sends SIGINT to the whole foreground process group, so the worker and writer processes
of a run get it too. A child still importing torch would print a traceback, so children start
with SIGINT blocked, a mask they inherit through fork and exec, and decide what it means once
they are ready (`ready_for_interrupts`). The parent keeps answering it meanwhile: a Ctrl-C that
arrives while children are being started is held, not discarded, and raised when they all are
(`starting_children`). Ignoring SIGINT around the start instead, which children inherit too,
would drop a Ctrl-C that arrives in that window, and a slow start on a loaded machine makes the
window seconds long. This module imports nothing heavy: unit writers import it before zarr.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_SIGINT = {signal.SIGINT}


def takes_interrupts() -> bool:
    """Whether this process answers Ctrl-C at all (a `cmd &` of a non-interactive shell ignores it)."""
    return signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


@contextmanager
def held() -> Iterator[None]:
    """Run the block whole: a Ctrl-C that reaches this process meanwhile raises KeyboardInterrupt
    when the block ends. For shutdown code that puts on queues, joins threads and ends processes:
    an interrupt raised halfway through it can leave a lock taken or a queue's feeder thread
    stuck, and the process then hangs at exit. Only the main thread may change signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextmanager
def starting_children() -> Iterator[None]:
    """Processes spawned inside start with SIGINT blocked. A Ctrl-C that reaches this process
    meanwhile raises KeyboardInterrupt when the block ends (`held`), after the children exist, so
    that the caller can end them."""
    with held():
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGINT)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a held Ctrl-C is delivered here, to the recorder


def ready_for_interrupts(interruptible: bool) -> None:
    """In a child started by `starting_children`, once it is ready: from now on a Ctrl-C raises
    KeyboardInterrupt here (`interruptible`, a worker the parent ends on Ctrl-C), or is ignored
    (a writer, which finishes what it was given and ends with its parent). One that arrived
    while it was starting is delivered now."""
    signal.signal(signal.SIGINT, signal.default_int_handler if interruptible else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGINT)


def ignore_from_now() -> None:
    """A command whose work is done and reported: a Ctrl-C while the process exits has nothing
    left to interrupt (and would otherwise print a traceback from an exit hook, or kill the
    process by the signal after Python stopped answering it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
