"""Following a cache that `dflash extract` is still writing: which units the trainer takes, when.

The first epoch of a run on an incomplete cache consumes committed units in *windows*: each time
the loader runs out of work it asks for everything committed since the last window. Whether the
extraction is finished is read from the cache alone: every unit of the plan in `cache.json` is
committed. No process has to be alive for the trainer to know it is done.

Whether the missing units are being written is another question (`writer`): an extract holds the
cache's lock on this host, or its heartbeat (`cache/heartbeat.py`) is fresh, from any host. A run
that starts on a cache lacking units that nothing writes is refused (`refuse_unwritten`), since it
would wait forever; one that waits says what for, every `report_every` seconds.

DDP ranks must see the same windows in the same order, or they would run different numbers of
steps and hang. Rank 0 decides; a thread on every rank takes part in a broadcast on a gloo group
every `poll` seconds (a heartbeat when there is nothing new, so no collective ever waits long),
and hands windows to its loader through a queue. The threads' collectives run on their own group,
so they never interleave with the training's collectives: a rank blocked in an all-reduce cannot
deadlock a rank waiting for units.

`FollowedEpoch` turns the windows into this rank's batches, the source the loader streams a
followed epoch from; the windows it took are what a checkpoint keeps of that epoch (`state`, read
back by `saved_windows`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from dflash_cache.cache.heartbeat import HEARTBEAT, live_beat
from dflash_cache.cache.spec import CACHE_JSON
from dflash_cache.cache.store import FROZEN, committed_units, extract_running, unit_name
from dflash_cache.core.errors import UserError
from dflash_cache.core.paths import PathKindError
from dflash_cache.train.batching import Planned, SampleTable


@dataclass(frozen=True)
class Window:
    """Units that became available together; `final` when they complete the cache."""

    units: tuple[int, ...]
    final: bool


def is_complete(cache_dir: Path, num_units: int) -> bool:
    """Every unit of the plan is committed."""
    return len(committed_units(cache_dir)) >= num_units


class FollowError(UserError, RuntimeError):
    """A cache that training would wait for although nothing is writing it."""


def writer(cache_dir: Path) -> str | None:
    """What is writing `cache_dir` now, in words, or None: an extract that holds its lock on this
    host, or one anywhere whose heartbeat (`CACHE/.heartbeat`, heartbeat.py) is fresh."""
    if extract_running(cache_dir):
        return "an extract holds its lock on this host"
    beat = live_beat(cache_dir)
    if beat is not None:
        return f"an extract on {beat.host} (pid {beat.pid}) wrote its {HEARTBEAT} {beat.age:.0f}s ago"
    return None


NO_WRITER = f"no extract is writing it (none holds its lock on this host, and no fresh {HEARTBEAT} from any host)"


def progress_line(cache_dir: Path, committed: int, planned: int) -> str:
    """What a trainer following `cache_dir` waits for: units committed of the plan, and who writes."""
    return f"{cache_dir}: {committed} of {planned} units committed; {writer(cache_dir) or NO_WRITER}"


def refuse_unwritten(cache_dir: Path, num_units: int) -> None:
    """Refuse to follow a cache that lacks units and that nothing is writing: training would wait
    forever. The message names the missing units and the two ways on."""
    cache_dir = Path(cache_dir)
    committed = committed_units(cache_dir)
    if len(committed) >= num_units or writer(cache_dir) is not None:
        return
    missing = [unit_name(u) for u in range(num_units) if u not in committed]
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    finish = f"finish it with the `dflash extract --out {cache_dir} ...` command that made it (it resumes)"
    units = f"{len(committed)} committed unit{'s' if len(committed) > 1 else ''}"
    rest = (f", or train on the {units} with --no-follow" if committed
            else "; it has no unit to train on yet")  # fmt: skip
    raise FollowError(f"{cache_dir} lacks {len(missing)} of the {num_units} units of its plan ({shown}) and "
                      f"{NO_WRITER}: {finish}{rest}")  # fmt: skip


def wait_for_cache(cache_dir: Path, *, poll: float = 0.5, appear: float = 0.0,
                   on_wait: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Wait for the cache.json and frozen weights of a cache that an extract is still preparing
    (tokenizing, planning and loading the target come first), as long as an extract writes it
    (`writer`). A path that does not exist is an error at once, so that a mistyped --cache never
    waits, unless `appear` allows it that many seconds to be created (`--follow` asked for
    explicitly: a trainer started at the same moment as its extract). An existing directory
    without cache.json and without a live extract returns at once, so the caller's error can say
    what is wrong with it. `on_wait(text)` hears what it waits for, once per thing."""
    cache_dir = Path(cache_dir)
    deadline = time.monotonic() + appear
    if not cache_dir.exists() and appear > 0 and on_wait is not None:
        on_wait(f"waiting up to {appear:.0f}s for `dflash extract` to create {cache_dir}")
    while not cache_dir.exists():
        if time.monotonic() >= deadline:
            waited = f" after waiting {appear:.0f}s" if appear > 0 else ""
            raise PathKindError(f"--cache {cache_dir} does not exist{waited} (to train beside an extraction, "
                                f"start `dflash extract --out {cache_dir}` first, or give --follow)")  # fmt: skip
        time.sleep(poll)
    told = False
    while not all((cache_dir / name).exists() for name in (CACHE_JSON, FROZEN)):
        who = writer(cache_dir)
        if who is None:
            return
        if not told and on_wait is not None:
            on_wait(f"waiting for `dflash extract` to write {cache_dir}/{CACHE_JSON} ({who})")
            told = True
        time.sleep(poll)


class UnitFeed:
    """Windows of newly committed units for one rank, identical on every rank.

    `request()` (rank 0's loader, when it has no more work queued) asks for the next window;
    `get(block)` returns the next window or None. `known` are the windows a resumed run already
    consumed: their units are never handed out again.
    """

    def __init__(
        self,
        cache_dir: Path,
        num_units: int,
        *,
        known: list[Window] = (),
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        poll: float = 0.5,
        on_status: Callable[[dict], None] | None = None,
        on_wait: Callable[[str], None] | None = None,
        report_every: float = 60.0,
    ):
        if world_size > 1 and group is None:
            raise ValueError("a multi-rank feed needs a gloo process group for its broadcasts")
        self.cache_dir = Path(cache_dir)
        self.num_units = num_units
        self.rank, self.world_size, self.group = rank, world_size, group
        self.poll = poll
        self.on_status = on_status
        self.on_wait, self.report_every = on_wait, report_every
        self._changed = self._said = time.monotonic()  # when the committed count last moved; last told
        self.windowed = {u for w in known for u in w.units}
        self.committed = len(self.windowed)
        self._windows: queue.Queue[Window | BaseException] = queue.Queue()
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-follow", daemon=True)
        self._thread.start()

    # -- the loader's side --------------------------------------------------------------------

    def request(self) -> None:
        """Ask for the next window (only rank 0's request counts; others just wait for it)."""
        self._wanted.set()

    def get(self, block: bool) -> Window | None:
        try:
            item = self._windows.get(block=block)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop following (an early end): rank 0 tells the other ranks' threads to stop too."""
        self._stop.set()
        self._wanted.set()
        self._thread.join(timeout=None if self.rank == 0 else 60)

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                message = self._decide() if self.rank == 0 else None
                if self.world_size > 1:
                    box = [message]
                    dist.broadcast_object_list(box, src=0, group=self.group)
                    message = box[0]
                kind, payload = message
                if kind == "window":
                    self._windows.put(payload)
                    if payload.final:
                        return
                elif kind == "stop":
                    return
                else:
                    self.committed = payload
        except BaseException as e:  # surfaces in the loader, on the training thread
            self._windows.put(e)

    def _decide(self) -> tuple[str, object]:
        """Rank 0: the next window when asked for and there is one; else a heartbeat."""
        self._wanted.wait(self.poll)
        if self._stop.is_set():
            return "stop", None
        committed = set(committed_units(self.cache_dir))
        if len(committed) != self.committed:
            self._changed = time.monotonic()
        self.committed = len(committed)
        if self.on_status is not None:
            self.on_status(self.status())
        if self._wanted.is_set():
            new = sorted(committed - self.windowed)
            final = len(committed) >= self.num_units
            if new or final:
                self._wanted.clear()
                self.windowed.update(new)
                return "window", Window(tuple(new), final)
            self._still_waiting()
            time.sleep(self.poll)  # asked, but nothing new yet: look again after a pause
        return "wait", self.committed

    def _still_waiting(self) -> None:
        """Say what training waits for, every `report_every` seconds while no unit commits."""
        now = time.monotonic()
        if self.on_wait is not None and now - max(self._changed, self._said) >= self.report_every:
            self._said = now
            self.on_wait("waiting for units: " + progress_line(self.cache_dir, self.committed, self.num_units))

    def status(self) -> dict:
        """What the progress bar shows: units committed/planned and whether an extract runs."""
        return {
            "committed": self.committed,
            "planned": self.num_units,
            "extract_running": writer(self.cache_dir) is not None,
        }


WindowPlan = Callable[[int, Window, SampleTable], tuple[list[Planned], SampleTable]]
"""This rank's batches of follow window number n, given the rows carried in, and the rows it carries on."""


class FollowedEpoch:
    """A followed epoch: this rank's batches, window by window, as units commit.

    Each window's batches are a pure function of (seed, window number, the window's units, the
    rows carried from the window before): leftover batches that do not divide among the ranks
    are carried into the next window, and split in the final one. So the windows alone (kept in
    checkpoints) reproduce the epoch's batch sequence, on every rank.

    `windows` and `start_batch` are what a resumed run had taken and trained; `plan` plans a window
    (`index.RankPlan.window`); `feed(known=, on_status=)` opens the `UnitFeed` of the windows to
    come, unless the replayed ones end the epoch; `on_status`, when given, hears the feed's status
    with the units this rank has read.
    """

    def __init__(self, windows: list[Window], start_batch: int, *, plan: WindowPlan, feed: Callable[..., UnitFeed],
                 on_status: Callable[[dict], None] | None = None):  # fmt: skip
        self.plan, self.on_status = plan, on_status
        self.windows: list[Window] = []
        self.carry = SampleTable.concat([])
        self.todo: deque[tuple[Planned, int]] = deque()  # (batch, window number)
        self.final = False
        self.units_read = 0
        for w in windows:  # replay what a resumed run had taken
            self._add(w)
        for _ in range(start_batch):
            if not self.todo:
                raise ValueError(f"start_batch {start_batch} is past the checkpoint's follow windows")
            self._pop()
        self.feed = None
        if not self.final:
            self.feed = feed(known=self.windows, on_status=self._status if on_status is not None else None)

    def _add(self, w: Window) -> None:
        mine, self.carry = self.plan(len(self.windows), w, self.carry)
        self.todo.extend((planned, len(self.windows)) for planned in mine)
        self.windows.append(w)
        self.final = w.final
        if not mine:
            self.units_read += len(w.units)  # nothing of this window for this rank to read

    def _pop(self) -> Planned:
        batch, window = self.todo.popleft()
        if not self.todo or self.todo[0][1] != window:
            self.units_read += len(self.windows[window].units)
        return batch

    def next(self, block: bool) -> Planned | None:
        """The next batch; None when none has been planned yet (only if not `block`) or the epoch is over."""
        while not self.todo:
            if self.final:
                return None
            self.feed.request()
            window = self.feed.get(block)
            if window is None:
                return None
            self._add(window)
        return self._pop()

    def state(self) -> dict:
        """The windows taken so far (all ranks agree), as checkpoints keep them."""
        return {"windows": [[list(w.units), w.final] for w in self.windows]}

    def _status(self, status: dict) -> None:
        self.on_status({**status, "read": self.units_read})

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()


def saved_windows(state: dict | None) -> list[Window]:
    """The follow windows a checkpoint's follow state (`FollowedEpoch.state`) records."""
    return [Window(tuple(u), bool(f)) for u, f in (state or {}).get("windows", [])]
