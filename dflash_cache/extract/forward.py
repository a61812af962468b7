"""The extract stage's forward loop: a process's units run through the target, unpadded, encoded
and copied out into the unit buffers that writer processes commit.

Per process, the GPU runs batch n+1 while batch n's unpadded hidden states are copied to the host
on a side stream, straight into one of a few reused pinned unit buffers, and writer processes
(commit.py) compress and commit finished units out of those same buffers, in shared memory. A unit
buffer is only reused once its unit is on disk, so host memory is bounded by the buffer count,
whatever the dataset size.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from dflash_cache.cache.spec import CacheSpec
from dflash_cache.cache.store import WORK
from dflash_cache.cache.unit.codec import encode_rows
from dflash_cache.cache.unit.layout import RowFormat
from dflash_cache.core.devices import GpuThrottle, to_device
from dflash_cache.core.errors import ExtractError
from dflash_cache.extract.commit import WRITER_NICENESS, BufferLayout, Committer, SharedBuffers
from dflash_cache.extract.plan import ForwardBatch, Unit
from dflash_cache.extract.prefill import Chunking, Target, forwards


def extract_units(
    target: Target,
    units: list[Unit],
    dataset,
    spec: CacheSpec,
    out: Path,
    device: torch.device,
    report: Callable[[dict], None],
    *,
    writers: int | None = None,
    chunk: Chunking | int | None = None,
) -> None:
    """The per-process pipeline: forward, unpad, copy out on a side stream into a shared unit
    buffer, commit in writer processes (commit.py).

    `target` maps right-padded input ids [b, T] to the tapped layers' hidden states (and the final
    hidden state after them when the cache holds it); the benchmark passes a random model of real
    shape here, the CLI the loaded target. A batch longer than `chunk` tokens runs sample by sample
    in chunks (prefill.py; a `Chunking` finds its chunk where a sample's forward runs out of GPU
    memory), each chunk's rows copied out as it comes, into the same unit buffer rows one forward
    would fill.
    """
    if not units:
        return
    row = RowFormat.of(spec)
    chunking = Chunking.of(chunk)
    cuda = device.type == "cuda"
    writers = writers or (6 if cuda else 2)
    # One buffer fills while each writer holds one: the forward only waits when every writer is
    # busy, i.e. when compression or the disk bounds the run.
    layout = BufferLayout(count=min(writers + 1, len(units)), rows=max(u.num_tokens for u in units), row=row)
    shared = SharedBuffers(layout)
    buffers = [{key: torch.from_numpy(a) for key, a in arrays.items()} for arrays in shared.arrays]
    pinner = _Pinner(shared) if cuda else None
    copy_stream = torch.cuda.Stream(device) if cuda else None
    pad_id = spec.tokenizer.pad_token_id or 0
    committer = Committer(out, spec.storage, shared, writers, report, prepare=pinner and pinner.pin,
                          niceness=WRITER_NICENESS if cuda else 0)  # fmt: skip
    throttle = GpuThrottle(cuda)
    rate = _Rate()
    try:
        for unit in units:
            ids, mask, sample_index = unit_tokens(dataset, unit)
            index = None
            for r0, _, lengths, _, inp, rows in unit_batches(unit, ids, pad_id, device):
                for a, b, outputs, where in chunking.forwards(target, inp, rows, lengths):
                    encoded = encode_rows(outputs, where, row)
                    if index is None:  # taken this late, a wait for a free buffer overlaps the forward
                        index = committer.take()
                    copy_out(copy_stream, buffers[index], r0 + a, r0 + b, encoded)
                    throttle.mark()
                    rate.add(b - a)
                    report({"tokens": b - a, "padded": outputs[0].shape[0] * outputs[0].shape[1]})
            ready = torch.cuda.Event() if cuda else None
            if ready is not None:
                ready.record(copy_stream)
            committer.commit(index, unit.id, unit.num_tokens, unit.offsets, sample_index, ids, mask, ready)
    except BaseException:
        committer.close(check=False)  # the first error is the one to report
        raise
    else:
        committer.close()
    finally:
        report({"buffer_wait_s": committer.wait_s, "forward_tokens_per_s": rate.per_s})
        if pinner is not None:
            torch.cuda.synchronize(device)
            pinner.unpin()


def follow_units(target: Target, units: list[Unit], dataset, spec: CacheSpec, device: torch.device,
                 chunk: int | None = None) -> None:  # fmt: skip
    """A sharded copy's other ranks: the lead's forwards, batch for batch and chunk for chunk
    (each forward exchanges partial results between the ranks of the copy), with nothing kept;
    the lead commits."""
    pad_id = spec.tokenizer.pad_token_id or 0
    for unit in units:
        ids = unit_tokens(dataset, unit)[0]
        for _, _, lengths, _, inp, rows in unit_batches(unit, ids, pad_id, device):
            for _ in forwards(target, inp, rows, lengths, chunk):
                pass


def unit_batches(unit: Unit, ids: np.ndarray, pad_id: int, device: torch.device,
                 batches: Iterable[ForwardBatch] | None = None) -> Iterator[tuple]:  # fmt: skip
    """A unit's forwards (or those of its `batches`): per batch its rows r0:r1 of the unit, its
    lengths, the batch, the padded inputs and the flat indices of their real tokens (`batch_inputs`)."""
    for batch in unit.batches if batches is None else batches:
        lengths = unit.lengths[batch.start : batch.stop]
        r0, r1 = int(unit.offsets[batch.start]), int(unit.offsets[batch.stop])
        yield (r0, r1, lengths, batch, *batch_inputs(ids[r0:r1], lengths, batch.max_len, pad_id, device))


class _Rate:
    """Tokens/s of the forward loop from its first batch to its last: the rate a long run settles
    at, without start-up and without the final commits. Summed over ranks it is the aggregate."""

    def __init__(self) -> None:
        self.first = self.last = 0.0
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.last = time.perf_counter()
        if not self.first:
            self.first = self.last
        else:
            self.tokens += tokens  # the first batch's tokens precede `first`'s clock

    @property
    def per_s(self) -> float:
        return self.tokens / (self.last - self.first) if self.last > self.first else 0.0


class _Pinner:
    """Page-locks the shared unit buffers, one at a time, so device-to-host copies into them are
    true async DMA. Pinning costs about a second per GiB, so the Committer does it in the
    background while the first forward runs. If the driver refuses, the copies still work, only
    synchronously, and a warning says so."""

    def __init__(self, shared: SharedBuffers):
        self.shared = shared
        self.pinned: list[int] = []
        self.failed = False

    def pin(self, index: int) -> None:
        if self.failed:
            return
        address = self.shared.arrays[index]["hidden"].ctypes.data  # buffer `index` starts its stride
        try:
            err = torch.cuda.cudart().cudaHostRegister(address, self.shared.layout.stride, 0)  # releases the GIL
            err = int(getattr(err, "value", err))
        except Exception as e:  # noqa: BLE001 - any failure only costs the asynchrony of the copies
            err = e
        if err != 0:
            self.failed = True
            warnings.warn(f"could not pin the unit buffers ({err}); device-to-host copies will be synchronous",
                          stacklevel=2)  # fmt: skip
            return
        self.pinned.append(address)

    def unpin(self) -> None:
        for address in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        self.pinned.clear()


def unit_tokens(dataset, unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A unit's packed input ids and loss mask, and the source row of each sample."""
    rows = dataset.select(unit.rows.tolist())
    ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in rows["input_ids"]])
    mask = np.concatenate([np.asarray(x, dtype=np.uint8) for x in rows["loss_mask"]])
    if len(ids) != unit.num_tokens:
        raise ExtractError(f"unit {unit.id}: tokenized data changed under the plan (delete {WORK}/ and rerun)")
    return ids, mask, np.asarray(rows["sample_index"], dtype=np.int64)


def batch_inputs(
    ids: np.ndarray, lengths: np.ndarray, max_len: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [b, max_len] input ids and the flat indices of their real tokens."""
    b = len(lengths)
    padded = np.full((b, max_len), pad_id, dtype=np.int64)
    index = np.empty(int(lengths.sum()), dtype=np.int64)
    pos = 0
    for i, n in enumerate(lengths):
        padded[i, :n] = ids[pos : pos + n]
        index[pos : pos + n] = i * max_len + np.arange(n)
        pos += n
    return to_device(torch.from_numpy(padded), device), to_device(torch.from_numpy(index), device)


def copy_out(stream, buf: dict[str, torch.Tensor], r0: int, r1: int, encoded: dict[str, torch.Tensor]) -> None:
    """Device-to-host copy of one batch's storage arrays (`encode_rows`) into the unit buffer's
    arrays of the same names, on the side stream when on CUDA."""
    if stream is None:
        for key, t in encoded.items():
            buf[key][r0:r1].copy_(t)
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for key, t in encoded.items():
            buf[key][r0:r1].copy_(t, non_blocking=True)
            t.record_stream(stream)
