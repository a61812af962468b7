"""The greedy argmax kernels (argmax_kernel.py), run on the CPU by Triton's interpreter, against
torch's argmax: the same index, the first of equal maxima, wherever the maxima fall among the
programs' blocks. The GPU suite runs them compiled, in every greedy step (tests/gpu/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.kernels import argmax as argmax_kernel

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # conftest: the kernels on the CPU


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_kernel_is_torchs_argmax(dtype):
    """Rows of 3,000 values (three blocks of 1,024 and a part): random ones, a maximum repeated in
    three blocks, in one block twice, in the last partial block, every value equal, and -inf beside
    one finite value; as [rows, V], [2, 3, V] and a strided view."""
    V = 3000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g).to(dtype)
    x[1, [2999, 1500, 1030]] = 9.0
    x[2, [700, 40]] = 9.0
    x[3, 2999] = 9.0
    x[4] = 1.5
    x[5] = float("-inf")
    x[5, 2048] = -3.0
    assert argmax_kernel.fits(x)
    want = x.argmax(-1)
    assert want[1:].tolist() == [1030, 40, 2999, 0, 2048]
    assert torch.equal(argmax_kernel.argmax(x), want)
    y = torch.randn(2, 3, V, generator=g).to(dtype)
    assert torch.equal(argmax_kernel.argmax(y), y.argmax(-1))
    strided = torch.randn(V, 4, generator=g).to(dtype).t()  # its last dimension not contiguous
    assert torch.equal(argmax_kernel.argmax(strided), strided.argmax(-1))
