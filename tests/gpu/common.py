"""What the GPU suite's modules share: the marks that gate them (`gpu`, skipped without CUDA), the
device, and decoding prompts through an engine."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.generate import Engine, Request

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def decode(engine: Engine, prompts, max_new: int) -> list[list[int]]:
    done = {c.request.key: c.ids for c in engine.stream(Request(p, max_new, key=i) for i, p in enumerate(prompts))}
    return [done[i] for i in range(len(prompts))]
