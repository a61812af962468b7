"""The loss's Triton kernel (kernels/loss.py), run on the CPU by Triton's interpreter: one
chunk against `losses._tv_chunk`, and the whole chunked losses through it against plain autograd
over full bf16 logits. The GPU suite checks it compiled (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_cache.drafters.losses import _tv_chunk, chunked_loss, chunked_tv_loss
from dflash_cache.kernels import loss as loss_kernel

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # conftest: the kernel on the CPU
V = 5000  # not a multiple of the kernel's block: its last block is partial


def rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=g) * 3).bfloat16()
    target = (logits.float() + torch.randn(n, V, generator=g)).bfloat16()  # near the draft: |p - q| is not ~2
    labels = torch.randint(0, V, (n,), generator=g)
    labels[0] = logits[0].float().argmax()  # one row the argmax gets right
    return logits, target, labels, torch.rand(n, generator=g), torch.rand(n, generator=g)


@pytest.mark.parametrize("with_target", [True, False])
def test_one_chunk_equals_the_reference(with_target):
    logits, target, labels, a, b = rows(6)
    assert loss_kernel.fits(logits)
    want = _tv_chunk(logits, target if with_target else None, labels, a, b)
    got = loss_kernel.tv_chunk(logits.clone(), target if with_target else None, labels, a, b)
    for name, x, y in zip(("ce", "l1", "hits", "accept"), got[:4], want[:4], strict=True):
        if x.dtype == torch.bool:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y.float(), rtol=1e-5, atol=1e-5, msg=name)
    assert got[2][0] and got[4].dtype == torch.bfloat16
    torch.testing.assert_close(got[4].float(), want[4].float(), rtol=2**-7, atol=1e-6)  # bf16: an ulp of rounding
    assert (got[1] > 0.1).all() == with_target


def test_chunked_losses_through_the_kernel_equal_full_logits(monkeypatch):
    """DFlash's cross-entropy and DSpark's CE + L1 with a low-rank bias, chunked through the kernel
    (bf16 weights, where it runs), against plain autograd over the same bf16 logits in float32."""
    calls = []
    kernel = loss_kernel.tv_chunk
    monkeypatch.setattr(loss_kernel, "tv_chunk", lambda *args: calls.append(1) or kernel(*args))
    g = torch.Generator().manual_seed(1)
    n, h, r = 21, 32, 4
    hidden = (torch.randn(n, h, generator=g)).bfloat16().requires_grad_()
    weight = (torch.randn(V, h, generator=g) * 0.3).bfloat16()
    bias = torch.randn(n, r, generator=g).bfloat16().requires_grad_()
    w2 = (torch.randn(V, r, generator=g) * 0.3).bfloat16().requires_grad_()
    target = torch.randn(n, h, generator=g).bfloat16()
    labels = torch.randint(0, V, (n,), generator=g)
    a, b = torch.rand(n, generator=g), torch.rand(n, generator=g)

    logits = F.linear(hidden, weight).float()
    want = (F.cross_entropy(logits, labels, reduction="none") * a).sum() / a.sum()
    want_grad = torch.autograd.grad(want, hidden)[0]
    for chunk in (8, 21):
        loss, hits = chunked_loss(hidden, weight, labels, a, chunk_size=chunk)
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(hits, logits.argmax(-1) == labels)
        torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0].float(), want_grad.float(), rtol=0.02,
                                   atol=2e-3)  # fmt: skip

    logits = hidden.float() @ weight.float().T + bias.float() @ w2.float().T  # the bf16 inputs, in float32
    p, q = torch.softmax(logits, -1), torch.softmax(F.linear(target, weight).float(), -1)
    want = (a * F.cross_entropy(logits, labels, reduction="none") + b * (p - q).abs().sum(-1)).sum()
    want_grads = torch.autograd.grad(want, [hidden, bias, w2])
    total, *_ = chunked_tv_loss(hidden, weight, labels, a, b, bias=bias, bias_weight=w2, target=target, chunk_size=8)
    torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-4)
    for x, y in zip(torch.autograd.grad(total, [hidden, bias, w2]), want_grads, strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=0.02, atol=0.01 * y.abs().max().item())  # bf16 g
    assert len(calls) == 3 + 1 + 3  # every chunk: 21 rows by 8, by 21, by 8
