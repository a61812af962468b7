"""Chunked losses over the frozen LM head: full logits (blocks x slots x a 150-250K vocabulary:
several GB) never exist at once, and no chunk's logits are computed twice. On a GPU each chunk's
walks over its logits are one Triton kernel (`kernels/loss.py`, cut by its `LossTiles`); elsewhere
they are the functions below.

`chunked_loss` is the weighted cross-entropy (DFlash); `chunked_tv_loss` adds the total-variation
(L1) distance to the target's own distribution and a low-rank logit bias (DSpark).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_cache.drafters.compile import compile_for_cuda
from dflash_cache.kernels import loss as loss_kernel
from dflash_cache.kernels.tiles import DEFAULT_LOSS_TILES, LossTiles


def _ce_chunk(logits: Tensor, labels: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's weighted cross-entropy sum, argmax hits, and the loss's gradient wrt the logits.

    `scale` is each row's weight over the batch's total weight. Softmax runs in float32. On CUDA
    this is compiled, so the passes over the [chunk, vocab] logits fuse into a few kernels.
    """
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    target = lf.gather(1, labels[:, None]).squeeze(1)
    loss = ((lse - target) * scale).sum()
    grad = torch.exp(lf - lse[:, None])
    grad.scatter_add_(1, labels[:, None], -torch.ones_like(target)[:, None])
    return loss, lf.argmax(-1) == labels, grad * scale[:, None]


_ce_chunk_cuda = compile_for_cuda(_ce_chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum(w * ce(hidden @ W^T)) / sum(w), with the gradient computed chunk by chunk during the
    forward pass: each chunk's logits live only while it is processed and are never recomputed
    (recomputing them in backward, as activation checkpointing does, costs a third more LM-head
    FLOPs)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, tiles):  # noqa: ANN001 - autograd signature
        scale = weights.float() / weights.float().sum().clamp_min(1e-12)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ce = _ce_chunk_cuda if hidden.is_cuda and _ce_chunk_cuda is not None else _ce_chunk
        fused = tiles is not None and loss_kernel.fits(weight)
        no_l1 = torch.zeros_like(scale) if fused else None  # the kernel's L1 weights: cross-entropy alone
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk_size):
            h = hidden[s : s + chunk_size].to(weight.dtype)
            logits, rows, w = F.linear(h, weight), labels[s : s + chunk_size], scale[s : s + chunk_size]
            if fused:
                part, _, ok, _, g = loss_kernel.tv_chunk(logits, None, rows, w, no_l1[s : s + chunk_size], tiles)
                part = (part * w).sum()
            else:
                part, ok, g = ce(logits, rows, w)
            total += part
            correct[s : s + chunk_size] = ok
            g = g.to(weight.dtype)
            if need_h:
                grad_h[s : s + chunk_size] = g @ weight
            if need_w:
                grad_w += (g.T @ h).to(grad_w.dtype)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):  # noqa: ANN001 - autograd signature
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        grad_w = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def chunked_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_size: int = 4096,
    kernel_tiles: LossTiles | None = DEFAULT_LOSS_TILES,
) -> tuple[Tensor, Tensor]:
    """Weighted cross-entropy sum(w*ce)/sum(w) over the vocabulary, chunk by chunk.

    Full logits (anchors x slots x 150-250K vocab: several GB) never exist at once, and no chunk's
    logits are computed twice (see _LinearCrossEntropy). Softmax runs in float32. Returns (loss,
    correct [N] bool = argmax == label); loss is 0, with a graph, when sum(w) == 0. Where the loss
    kernel runs, its programs are cut by `kernel_tiles` (None: the PyTorch expression instead).
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return _LinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights, chunk_size, kernel_tiles)


def _tv_chunk(logits: Tensor, target_logits: Tensor | None, labels: Tensor, ce_scale: Tensor, l1_scale: Tensor
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """One chunk of `chunked_tv_loss`: (sum of ce, sum of L1, argmax hits, acceptance rates, the
    gradient wrt the logits). `ce_scale`, `l1_scale` [c] are each row's weight in the loss. The
    L1 term is |p - q|_1 between the softmaxes of the logits and of the target's logits; its
    gradient wrt the logits is p * (s - <s, p>) with s = sign(p - q). Softmax in float32."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    p = torch.exp(lf - lse[:, None])
    ce = lse - lf.gather(1, labels[:, None]).squeeze(1)
    grad = p * ce_scale[:, None]
    grad.scatter_add_(1, labels[:, None], -ce_scale[:, None])
    if target_logits is None:
        l1 = torch.zeros_like(ce)
    else:
        d = p - torch.softmax(target_logits.float(), dim=-1)
        l1 = d.abs().sum(-1)
        sign = torch.sign(d)
        grad += (l1_scale[:, None] * p) * (sign - (sign * p).sum(-1, keepdim=True))
    accept = (1 - 0.5 * l1).clamp(0, 1)
    return ce, l1, lf.argmax(-1) == labels, accept, grad


_tv_chunk_cuda = compile_for_cuda(_tv_chunk)


class _TVLoss(torch.autograd.Function):
    """sum(ce_scale * ce + l1_scale * L1) over rows of logits = hidden @ W^T + bias @ W2^T, chunk by
    chunk, the gradient computed during the forward (as `_LinearCrossEntropy`). W is frozen; the
    low-rank bias `bias` [N, r] and its projection W2 [V, r] get gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, bias_weight, labels, ce_scale, l1_scale, target, chunk_size, tiles):  # noqa: ANN001
        need_h, need_b, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        chunk = _tv_chunk_cuda if hidden.is_cuda and _tv_chunk_cuda is not None else _tv_chunk
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_b = torch.zeros_like(bias) if need_b else None
        grad_w2 = torch.zeros_like(bias_weight, dtype=acc) if need_w2 else None
        n, width = hidden.shape[0], weight.shape[1]
        ce, l1 = torch.zeros(n, dtype=acc, device=hidden.device), torch.zeros(n, dtype=acc, device=hidden.device)
        hits = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        accept = torch.zeros(n, dtype=acc, device=hidden.device)
        fused = tiles is not None and loss_kernel.fits(weight)
        # With the kernel, the bias rides in the head's product: [h; z] @ [W; W2]^T makes the logits
        # and g @ [W; W2] both input gradients, so no product reads the [chunk, V] logits twice.
        joint = torch.cat([weight, bias_weight.to(weight.dtype)], 1) if fused and bias is not None else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            h = hidden[s:e].to(weight.dtype)
            z = None if bias is None else bias[s:e].to(weight.dtype)
            if joint is not None:
                logits = F.linear(torch.cat([h, z], 1), joint)
            elif z is not None:
                logits = torch.addmm(F.linear(h, weight), z, bias_weight.to(weight.dtype).T)
            else:
                logits = F.linear(h, weight)
            tl = None if target is None else F.linear(target[s:e].to(weight.dtype), weight)
            args = (logits, tl, labels[s:e], ce_scale[s:e], l1_scale[s:e])
            walked = loss_kernel.tv_chunk(*args, tiles) if fused else chunk(*args)
            ce[s:e], l1[s:e], hits[s:e], accept[s:e], g = walked
            g = g.to(weight.dtype)
            if joint is not None and need_h and need_b:
                both = g @ joint
                grad_h[s:e], grad_b[s:e] = both[:, :width], both[:, width:]
            else:
                if need_h:
                    grad_h[s:e] = g @ weight
                if need_b:
                    grad_b[s:e] = g @ bias_weight.to(weight.dtype)
            if need_w2:
                grad_w2 += (g.T @ z).to(grad_w2.dtype)
        ctx.save_for_backward(grad_h, grad_b, grad_w2)
        ctx.dtypes = (None if bias is None else bias.dtype, bias_weight.dtype if bias_weight is not None else None)
        total = (ce * ce_scale.to(acc)).sum() + (l1 * l1_scale.to(acc)).sum()
        ctx.mark_non_differentiable(ce, l1, hits, accept)
        return total, ce, l1, hits, accept

    @staticmethod
    def backward(ctx, grad_total, *_unused):  # noqa: ANN001 - autograd signature
        grad_h, grad_b, grad_w2 = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_total.to(grad_h.dtype)
        grad_b = None if grad_b is None else (grad_b * grad_total).to(ctx.dtypes[0])
        grad_w2 = None if grad_w2 is None else (grad_w2 * grad_total).to(ctx.dtypes[1])
        return grad_h, None, grad_b, grad_w2, None, None, None, None, None, None


def chunked_tv_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    ce_scale: Tensor,
    l1_scale: Tensor,
    *,
    bias: Tensor | None = None,
    bias_weight: Tensor | None = None,
    target: Tensor | None = None,
    chunk_size: int = 4096,
    kernel_tiles: LossTiles | None = DEFAULT_LOSS_TILES,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Cross-entropy plus the total-variation (L1) distance to the target's own distribution, chunk
    by chunk over the vocabulary, as `chunked_loss` does for cross-entropy alone.

    Row i's logits are `hidden[i] @ W^T`, plus `bias[i] @ bias_weight^T` when given (a low-rank
    logit bias, e.g. a Markov head's); `target[i]` is the target's hidden state whose LM-head
    softmax is the distribution matched (None: no L1 term). Returns (sum_i ce_scale_i * ce_i +
    l1_scale_i * L1_i, differentiable wrt hidden, bias and bias_weight; and per row, detached:
    ce, L1, argmax == label, and the acceptance rate clamp(1 - L1 / 2, 0, 1)). `kernel_tiles` as
    `chunked_loss` takes them."""
    if hidden.shape[0] == 0:
        zero = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        total = hidden.sum() * 0.0 + (0.0 if bias is None else bias.sum() * 0.0 + bias_weight.sum() * 0.0)
        return total, zero, zero, torch.zeros(0, dtype=torch.bool, device=hidden.device), zero
    if (bias is None) != (bias_weight is None):
        raise ValueError("bias and bias_weight come together")
    return _TVLoss.apply(hidden, lm_head_weight, bias, bias_weight, labels, ce_scale, l1_scale, target, chunk_size,
                         kernel_tiles)  # fmt: skip
