"""One chunk of the drafter's loss over the vocabulary as one Triton kernel, on a GPU.

A chunk's logits are [rows, V] with V the target's vocabulary (49K to 250K). The loss needs three
walks over each row: the log-sum-exps of the draft's and the target's logits, then the L1 distance
between their softmaxes with <sign(p - q), p>, then the gradient, which needs both row sums. A
small drafter (hidden 576) spends more time moving these logits than multiplying them, so the
bytes decide: the kernel reads each bf16 logit once a walk, keeps every float32 intermediate in
registers, and writes the bf16 gradient over the logits, where the compiled PyTorch expression
wrote a float32 gradient and cast it in another pass. Cross-entropy alone (no target) takes two
walks.

It computes what `losses._tv_chunk` does (the reference on every other device, and in the tests,
through Triton's interpreter), up to the order of float32 sums.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dflash_cache.kernels.tiles import DEFAULT_LOSS_TILES, LossTiles
from dflash_cache.kernels.triton_support import available, on_device


def fits(head: Tensor) -> bool:
    """Whether the kernel serves a loss over this LM head's logits: half precision, where Triton runs."""
    return available() and on_device(head) and head.dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk(X, T, LABEL, CE_SCALE, L1_SCALE, CE, L1, HIT, V, HAS_TARGET: tl.constexpr, BLOCK: tl.constexpr):
        """Row `program_id`: its cross-entropy, L1 and argmax hit into CE, L1, HIT, and the loss's
        gradient wrt its logits over X (bf16), in place."""
        row = tl.program_id(0).to(tl.int64)
        x_row, t_row = X + row * V, T + row * V
        label = tl.load(LABEL + row)
        cols = tl.arange(0, BLOCK)
        # walk 1: running max and sum of exp for both rows, and the draft's argmax (first of equals)
        x_top = tl.full([BLOCK], float("-inf"), tl.float32)
        x_sum = tl.zeros([BLOCK], tl.float32)
        t_top = tl.full([BLOCK], float("-inf"), tl.float32)
        t_sum = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            n = start + cols
            inside = n < V
            x = tl.load(x_row + n, mask=inside, other=float("-inf")).to(tl.float32)
            top = tl.maximum(x_top, x)
            safe = tl.where(top == float("-inf"), 0.0, top)
            x_sum = x_sum * tl.exp(x_top - safe) + tl.exp(x - safe)
            x_top = top
            better = x > best
            best_at = tl.where(better, n, best_at)
            best = tl.where(better, x, best)
            if HAS_TARGET:
                t = tl.load(t_row + n, mask=inside, other=float("-inf")).to(tl.float32)
                top = tl.maximum(t_top, t)
                safe = tl.where(top == float("-inf"), 0.0, top)
                t_sum = t_sum * tl.exp(t_top - safe) + tl.exp(t - safe)
                t_top = top
        m = tl.max(x_top, 0)
        x_lse = m + tl.log(tl.sum(x_sum * tl.exp(x_top - m), 0))
        top_value = tl.max(best, 0)
        argmax = tl.min(tl.where(best == top_value, best_at, V), 0)
        ce = x_lse - tl.load(x_row + label).to(tl.float32)
        ce_scale = tl.load(CE_SCALE + row)
        l1_scale = tl.load(L1_SCALE + row)
        l1 = 0.0
        tilt = 0.0
        # walk 2: |p - q|_1 and <sign(p - q), p>
        if HAS_TARGET:
            m = tl.max(t_top, 0)
            t_lse = m + tl.log(tl.sum(t_sum * tl.exp(t_top - m), 0))
            l1_part = tl.zeros([BLOCK], tl.float32)
            tilt_part = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                n = start + cols
                inside = n < V
                p = tl.exp(tl.load(x_row + n, mask=inside, other=float("-inf")).to(tl.float32) - x_lse)
                q = tl.exp(tl.load(t_row + n, mask=inside, other=float("-inf")).to(tl.float32) - t_lse)
                d = p - q
                l1_part += tl.abs(d)
                tilt_part += tl.where(d > 0, p, tl.where(d < 0, -p, 0.0))
            l1 = tl.sum(l1_part, 0)
            tilt = tl.sum(tilt_part, 0)
        tl.store(CE + row, ce)
        tl.store(L1 + row, l1)
        tl.store(HIT + row, (argmax == label).to(tl.int8))
        # walk 3: the gradient, ce_scale (p - onehot) + l1_scale p (sign(p - q) - <sign, p>), over X
        for start in range(0, V, BLOCK):
            n = start + cols
            inside = n < V
            p = tl.exp(tl.load(x_row + n, mask=inside, other=float("-inf")).to(tl.float32) - x_lse)
            g = p * ce_scale - tl.where(n == label, ce_scale, 0.0)
            if HAS_TARGET:
                q = tl.exp(tl.load(t_row + n, mask=inside, other=float("-inf")).to(tl.float32) - t_lse)
                d = p - q
                sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
                g += (l1_scale * p) * (sign - tilt)
            tl.store(x_row + n, g.to(X.dtype.element_ty), mask=inside)

    return chunk


def tv_chunk(logits: Tensor, target_logits: Tensor | None, labels: Tensor, ce_scale: Tensor, l1_scale: Tensor,
             tiles: LossTiles = DEFAULT_LOSS_TILES) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """`losses._tv_chunk` as one kernel: (ce, L1, argmax hits, acceptance rates, the gradient wrt
    the logits), its programs walking and launched by `tiles`. The gradient is written over
    `logits` (the caller's buffer, which it no longer needs) in their dtype; the rest are float32
    [rows] and bool [rows]."""
    rows, vocab = logits.shape
    if not logits.is_contiguous():
        raise ValueError("the logits must be contiguous")
    if target_logits is not None and (target_logits.shape != logits.shape or not target_logits.is_contiguous()):
        raise ValueError("target_logits must be contiguous and shaped as the logits")
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    l1 = torch.empty_like(ce)
    hits = torch.empty(rows, dtype=torch.int8, device=logits.device)
    if rows:
        _kernel()[(rows,)](logits, logits if target_logits is None else target_logits, labels.contiguous(),
                           ce_scale.float().contiguous(), l1_scale.float().contiguous(), ce, l1, hits, vocab,
                           HAS_TARGET=target_logits is not None, BLOCK=tiles.block, num_warps=tiles.warps)  # fmt: skip
    accept = (1 - 0.5 * l1).clamp(0, 1)
    return ce, l1, hits.bool(), accept, logits
