"""The loader's I/O: planned batches -> reader threads -> reused host slots -> the device.

Reader threads decode each sample of a batch (long ones in pieces) straight into one of
`prefetch + 1` host buffers ("slots", pinned on CUDA hosts) that are allocated once and reused: a
slot is only handed to the readers when it is free, so host memory is bounded by the slot count,
not by the dataset. The host-to-device copy runs on a side CUDA stream behind an event; the
consumer's stream waits on that event (the host does not), and the slot goes back to the pool
once the event has completed. Layer selection and fp8 dequantisation run on the device after the
copy. At most two batches are on the device: the one last handed over and the next one.

On a CPU device the same code runs without streams or events (the "copy" is a plain copy, so a
batch never aliases a slot that readers will overwrite).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dflash_cache.cache.unit.codec import decode_hidden
from dflash_cache.cache.unit.layout import RowFormat, host_rows
from dflash_cache.cache.unit.read import UnitReader
from dflash_cache.train.batching import Planned


@dataclass
class PackedBatch:
    """One packed batch, already on the target device (sample_index stays on the CPU)."""

    context: torch.Tensor  # [N, K'*H] bf16 (bf16 storage) or float32 dequantised (fp8 storage)
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    offsets: torch.Tensor  # [S+1] int64 packed sequence boundaries
    sample_index: torch.Tensor  # [S] int64 source rows, on the CPU
    num_tokens: int
    step_tokens: int  # context tokens of this step summed over all ranks (for a token-based schedule)
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # CPU copies of (input_ids, loss_mask, offsets)
    step_samples: tuple[int, ...] = ()  # samples of this step, per rank
    epoch: int = 0
    index: int = 0  # the batch's place in this rank's epoch
    final: torch.Tensor | None = None  # [N, H] the target's final hidden state, as context; when asked for


class _Slot:
    """One reusable host buffer, big enough for the largest batch; pinned when the device is CUDA."""

    def __init__(self, index: int, rows: int, row: RowFormat, pin: bool):
        self.index = index
        self.arrays = host_rows(rows, row, pin)  # hidden (+ hidden_scale, final_hidden, final_scale)
        self.hidden, self.scale = self.arrays["hidden"], self.arrays.get("hidden_scale")
        self.final, self.final_scale = self.arrays.get("final_hidden"), self.arrays.get("final_scale")
        self.input_ids = torch.empty(rows, dtype=torch.int32, pin_memory=pin)
        self.loss_mask = torch.empty(rows, dtype=torch.uint8, pin_memory=pin)
        self.offsets = torch.empty(rows + 1, dtype=torch.int64, pin_memory=pin)
        # numpy views over the same memory: what UnitReader.read_into decodes into.
        self.np = {key: t.numpy().view(row.hidden_dtype) if t.dtype == torch.int16 else t.numpy()
                   for key, t in self.arrays.items()}  # fmt: skip
        self.np |= {"input_ids": self.input_ids.numpy(), "loss_mask": self.loss_mask.numpy()}

    @property
    def nbytes(self) -> int:
        tensors = [*self.arrays.values(), self.input_ids, self.loss_mask, self.offsets]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Pending:
    """A batch whose samples the readers are decoding into `slot`, one future per sample."""

    planned: Planned
    slot: _Slot
    futures: list[Future]
    num_tokens: int


@dataclass
class _Staged:
    """A batch whose copy to the device has been issued; `event` marks the copy's end on CUDA."""

    batch: PackedBatch
    slot: _Slot
    event: torch.cuda.Event | None


def _pieces(start: int, stop: int, piece: int) -> list[tuple[int, int]]:
    """[start, stop) cut at the multiples of `piece` (whole chunks when piece is a multiple of the
    chunk size, so no chunk is decoded by two readers)."""
    cuts = [start, *range((start // piece + 1) * piece, stop, piece), stop]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class BatchStream:
    """The loader's I/O: planned batches -> reader threads -> reused host slots -> the device.

    `readers` is the loader's dict of open units (it grows while a cache is followed). Attributes
    the loader reports: `wait_seconds` (cumulative time the consumer was blocked waiting for data),
    `host_slots` (the reused host buffers, `prefetch + 1` of them, allocated once) and
    `peak_slots_in_use` (instrumentation: never above `len(host_slots)`). `row` is what the slots hold
    and the readers read: the final hidden state only when it has `final`.
    """

    def __init__(self, readers: dict[int, UnitReader], *, row: RowFormat, slot_rows: int, device: torch.device,
                 layer_index: list[int], prefetch: int, threads: int, piece_rows: int):  # fmt: skip
        self.readers = readers
        self.device = device
        self._cuda = device.type == "cuda"
        self._num_layers = row.layers
        self._all_layers = list(layer_index) == list(range(row.layers))
        self._layer_index = torch.tensor(layer_index, dtype=torch.int64, device=device)
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        if self._stream is not None:  # the side stream uses _layer_index, made on the current stream
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self.slot_rows = slot_rows
        self.host_slots = [_Slot(i, slot_rows, row, self._cuda) for i in range(prefetch + 1)]
        self.peak_slots_in_use = 0
        self.wait_seconds = 0.0
        # a reader task decodes at most this many rows: a few of the cache's chunks (several MiB)
        self.piece_rows = piece_rows
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dflash-reader")

    def run(self, source: Source, epoch: int, start: int) -> Iterator[PackedBatch]:
        """The source's batches on the device, in order; the first is batch `start` of `epoch`."""
        flight = _InFlight(self, source)
        try:
            flight.submit(block=True)
            nxt = flight.stage(block=True)
            while nxt is not None:
                current, nxt = nxt, None
                flight.submit()
                # Copy batch i+1 while the trainer works on batch i, if its reads are done;
                # otherwise yield batch i now and stage i+1 when the trainer asks for it.
                nxt = flight.stage(block=False)
                flight.submit()
                yield self._hand_over(current, epoch, start)
                start += 1
                current = None  # the loader's reference: at most this batch and the next on the device
                if nxt is None:
                    flight.submit(block=True)
                    nxt = flight.stage(block=True)
        finally:
            flight.close()

    def _submit_reads(self, planned: Planned, slot: _Slot) -> _Pending:
        """Reader tasks that decode the batch into the slot: one per sample, and a long sample cut
        into pieces along the cache's chunks, so that the readers share it (one 24K-token sample
        is about 1 GB of hidden states: one thread decoding it alone starved the GPU)."""
        batch = planned.samples
        lengths = batch.length
        offsets = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = int(offsets[-1])
        if n > self.slot_rows:
            raise RuntimeError(f"batch of {n} tokens exceeds the host slot of {self.slot_rows} rows")
        slot.offsets.numpy()[: len(offsets)] = offsets
        futures = []
        for i in range(len(batch)):
            unit, start, length, dst = int(batch.unit[i]), int(batch.start[i]), int(batch.length[i]), int(offsets[i])
            for lo, hi in _pieces(start, start + length, self.piece_rows):
                futures.append(self._pool.submit(self._read_rows, slot, unit, lo, hi, dst + lo - start))
        return _Pending(planned, slot, futures, n)

    def _read_rows(self, slot: _Slot, unit: int, start: int, stop: int, dst: int) -> None:
        reader = self.readers[unit]
        for key in slot.np:  # hidden, input_ids, loss_mask (+ hidden_scale for fp8, final_hidden, final_scale)
            reader.read_into(key, start, stop, out=slot.np[key][dst : dst + stop - start])

    def _copy_to_device(self, job: _Pending) -> _Staged:
        """Copy a decoded slot to the device (side stream on CUDA), then select layers and
        dequantise there; the event recorded after it tells both the consumer and the slot pool."""
        n, s, slot = job.num_tokens, len(job.planned.samples), job.slot

        def up(t: torch.Tensor) -> torch.Tensor:
            # An explicit copy, also on the CPU, where .to() would alias the reused slot.
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            out.copy_(t, non_blocking=self._cuda)
            return out

        with torch.cuda.stream(self._stream) if self._cuda else nullcontext():
            hidden = up(slot.hidden[:n])
            scale = up(slot.scale[:n]) if slot.scale is not None else None
            input_ids = up(slot.input_ids[:n]).long()
            loss_mask = up(slot.loss_mask[:n]).bool()
            offsets = up(slot.offsets[: s + 1])
            context = self._context(hidden, scale, n)
            final = None
            if slot.final is not None:
                fscale = up(slot.final_scale[:n]) if slot.final_scale is not None else None
                final = decode_hidden(up(slot.final[:n]), fscale, 1)
            event = None
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
        batch = PackedBatch(
            context=context,
            input_ids=input_ids,
            loss_mask=loss_mask,
            offsets=offsets,
            sample_index=torch.from_numpy(job.planned.samples.sample_index.copy()),
            num_tokens=n,
            step_tokens=job.planned.step_tokens,
            step_samples=job.planned.step_samples,
            # block building needs these on the host; reading them back from the device would
            # make the host wait for the GPU every step
            host=(slot.input_ids[:n].clone(), slot.loss_mask[:n].clone(), slot.offsets[: s + 1].clone()),
            final=final,
        )
        return _Staged(batch, slot, event)

    def _context(self, hidden: torch.Tensor, scale: torch.Tensor | None, n: int) -> torch.Tensor:
        """Storage bits on the device -> [n, K'*H] of the selected layers."""
        return decode_hidden(hidden, scale, self._num_layers, None if self._all_layers else self._layer_index)

    def _hand_over(self, staged: _Staged, epoch: int, index: int) -> PackedBatch:
        """Make the consumer's stream (not the host) wait for the copy, and tell the caching
        allocator that the consumer's stream uses tensors allocated on the side stream."""
        batch = staged.batch
        batch.epoch, batch.index = epoch, index
        if staged.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(staged.event)
            for t in (batch.context, batch.input_ids, batch.loss_mask, batch.offsets, batch.final):
                if t is not None:
                    t.record_stream(stream)
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _InFlight:
    """One `BatchStream.run`'s batches between the source and the consumer: the free host slots,
    the reads submitted (in batch order), the copies whose slot is not free yet, and the next batch
    taken from the source while it waits for a slot. The time the consumer waits here is added to
    the stream's `wait_seconds`."""

    def __init__(self, stream: BatchStream, source: Source):
        self.stream, self.source = stream, source
        self.free: list[_Slot] = list(stream.host_slots)
        self.pending: deque[_Pending] = deque()
        self.copying: deque[tuple[_Slot, torch.cuda.Event | None]] = deque()
        self.held: list[Planned] = []

    def reclaim(self, block: bool) -> None:
        """A slot is free again once the copy out of it has completed (event query). When nothing
        else can make progress (`block`), wait for the oldest copy (event synchronize)."""
        copying, free = self.copying, self.free
        while copying and (copying[0][1] is None or copying[0][1].query()):
            free.append(copying.popleft()[0])
        if block and not free and copying:
            t0 = time.perf_counter()
            copying[0][1].synchronize()
            self.stream.wait_seconds += time.perf_counter() - t0
            free.append(copying.popleft()[0])

    def submit(self, block: bool = False) -> None:
        """Hand free slots to the readers, one batch per slot, in batch order. Only when nothing is
        being read (the consumer would have nothing to take) does it wait for the source (a
        followed extraction) or for a slot."""
        stream = self.stream
        while True:
            if not self.held:
                t0 = time.perf_counter()
                batch = self.source.next(block=block and not self.pending)
                stream.wait_seconds += time.perf_counter() - t0
                if batch is None:
                    return
                self.held.append(batch)
            self.reclaim(block=not self.pending)
            if not self.free:
                return
            slot = self.free.pop()
            stream.peak_slots_in_use = max(stream.peak_slots_in_use, len(stream.host_slots) - len(self.free))
            self.pending.append(stream._submit_reads(self.held.pop(), slot))

    def stage(self, block: bool) -> _Staged | None:
        """Issue the device copy of the next batch in order, once all its samples are decoded
        (futures in batch order: whichever reader finishes first, batch i stays batch i)."""
        if not self.pending:
            return None
        job = self.pending[0]
        if not block and not all(f.done() and f.exception() is None for f in job.futures):
            return None  # not ready, or failed: the blocking path raises it in its turn
        t0 = time.perf_counter()
        try:
            for f in job.futures:
                f.result()  # a CorruptUnit raised by a reader propagates here, naming the unit
        finally:
            self.stream.wait_seconds += time.perf_counter() - t0
        self.pending.popleft()
        staged = self.stream._copy_to_device(job)
        self.copying.append((job.slot, staged.event))
        return staged

    def close(self) -> None:
        """Stop the source, cancel the reads not started, and wait until no reader or copy uses a slot."""
        self.source.close()
        for job in self.pending:
            for f in job.futures:
                f.cancel()
        wait_futures([f for job in self.pending for f in job.futures])  # readers must leave the slots
        for _, event in self.copying:
            if event is not None:
                event.synchronize()


class Source(Protocol):
    """Where `BatchStream.run` takes this rank's batches from, in order: `ListSource`, or a
    followed epoch (`follow.FollowedEpoch`)."""

    def next(self, block: bool) -> Planned | None:
        """The next batch; None when there is none yet (only if not `block`) or none left."""

    def close(self) -> None:
        """Stop: no batch is taken after this."""


class ListSource:
    """An epoch whose batches are all known (a complete cache)."""

    def __init__(self, batches: list[Planned]):
        self.todo = deque(batches)

    def next(self, block: bool) -> Planned | None:
        return self.todo.popleft() if self.todo else None

    def close(self) -> None:
        pass
