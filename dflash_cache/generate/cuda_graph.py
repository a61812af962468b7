"""A function of device tensors captured as one CUDA graph and replayed: on a GPU the engine's whole
step (draft, verify, accept, context update) runs so, without the per-kernel launch cost that
dominates small models."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import torch
from torch import Tensor


class Graph:
    """`fn(*inputs)` captured as a CUDA graph on its first call, replayed after; the outputs are the
    graph's own tensors, overwritten by the next replay. The graph reads and updates the first
    call's input tensors in place: a later call with those same tensors copies nothing. Falls back
    to eager once, with a warning, if capture fails."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]]):
        self.fn, self.graph, self.inputs, self.outputs, self.broken = fn, None, None, None, False

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if self.broken:
            return self.fn(*inputs)
        if self.graph is None:
            try:
                self._capture(inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, loudly
                self.broken = True
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly", stacklevel=2)
                return self.fn(*inputs)
        for mine, given in zip(self.inputs, inputs, strict=True):
            if mine is not given:
                mine.copy_(given)
        self.graph.replay()
        return self.outputs

    def _capture(self, inputs: tuple[Tensor, ...]) -> None:
        self.inputs = inputs
        before = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the same cache writes a real step makes, so harmless
            for _ in range(2):
                self.fn(*inputs)
            for t, saved in zip(inputs, before, strict=True):  # but not the step's own advance
                t.copy_(saved)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: an unreachable engine freed then would return its
        # pinned host buffers, and the host allocator's event calls would invalidate the capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph):
                self.outputs = self.fn(*self.inputs)
        finally:
            if collecting:
                gc.enable()
        self.graph = graph
