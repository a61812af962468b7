"""The DFlash training objective: anchors, block layout, the block attention rule, and a chunked,
slot-decayed cross-entropy (the rules: docs/architecture.md, "Where each rule lives"). The layout,
the attention rule, anchor picking, the chunked LM-head loop and the block metrics are shared by
every drafter family (`dflash_cache.drafters`); the DFlash family's objective is `forward_blocks`.

A batch is packed: S sequences concatenated with `offsets [S+1]`. From it, `make_blocks` samples
anchors and builds blocks of B tokens: slot 0 holds the anchor token, slots 1..B-1 the mask
token, and slot k is trained to predict the token at anchor+k (same position, not shifted).
Block j attends to the context of its own sequence strictly before its anchor and
bidirectionally to its own B tokens; `block_attention` implements that rule with flex attention
on GPU and with an exact chunked SDPA elsewhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor import config as inductor_config
from torch.nn.attention.flex_attention import BlockMask, flex_attention

if TYPE_CHECKING:  # the loader's batch; the objective needs only its host ids and its context
    from dflash_cache.train.loader import Batch


_INDUCTOR_OPTIONS = ({"triton.mix_order_reduction_non_strict_mode": True}
                     if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode") else {})


def compile_for_cuda(fn, **kwargs):
    """`torch.compile(fn)` for the CUDA path, or None where compiling is unsupported. Compiled
    lazily: nothing is compiled until the first call. Shapes vary from batch to batch, so the
    kernels are built for dynamic sizes.

    The compiled pieces are small stages that run inside a DDP module's forward. Dynamo's DDP
    optimizer would split each of them at gradient-bucket boundaries, which only pays for a
    whole-model compile; on two H200s it kept rank 0 compiling for minutes while rank 1 waited
    in the first all-reduce (BENCHMARKS.md, "Compiled stages under DDP"). DDP already overlaps the all-reduce with
    the backward through its own bucket hooks, so it is turned off.

    Inductor fuses two reductions of different loop orders only above a size it checks with a
    guard on the token count, so the first batch on the other side of 5,120 context tokens
    recompiled the layer stages mid-run (a 20 s stall on an H200). Its non-strict mode skips
    those size checks: two recompiles fewer a process, at the same step time (BENCHMARKS.md,
    "Recompiles")."""
    torch._dynamo.config.optimize_ddp = False
    try:
        return torch.compile(fn, **{"dynamic": True, "options": _INDUCTOR_OPTIONS, **kwargs})
    except Exception:  # pragma: no cover - torch.compile unsupported on this Python/platform
        return None


_flex_compiled = compile_for_cuda(flex_attention, dynamic=None)
_flex_broken = False  # set once if the compiled kernel fails; then the SDPA path is used

# Budget, in attention-matrix elements per head, for one SDPA call of the exact path.
SDPA_CHUNK_ELEMS = 1 << 23
TILE = 128  # flex attention's block size, for queries and keys

# gamma of the slot decay exp(-(k-1)/gamma), from the DFlash paper.
_PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


# ----------------------------------------------------------------------------- layout


@dataclass
class BlockLayout:
    """Where every context token and every block of a packed batch sits.

    Blocks must be grouped by sequence in sequence order (make_blocks guarantees it); the
    exact attention path relies on that to cut the batch into per-sequence pieces.
    """

    block_size: int
    ctx_seq: Tensor  # [Nc] sequence id of each context token
    ctx_pos: Tensor  # [Nc] position of each context token within its sequence
    block_seq: Tensor  # [nb] sequence of each block
    block_anchor: Tensor  # [nb] anchor position (within its sequence) of each block
    offsets: Tensor  # [S+1] int64: sequence s is context rows offsets[s]:offsets[s+1]
    _flex_mask: object | None = field(default=None, init=False, repr=False, compare=False)
    _sdpa_plan: list | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls, offsets: Tensor, block_seq: Tensor, block_anchor: Tensor, block_size: int
    ) -> BlockLayout:
        """Layout from sequence offsets and each block's (sequence, anchor)."""
        offsets = offsets.to(torch.int64)
        lengths = offsets.diff()
        seq_ids = torch.arange(len(lengths), device=offsets.device)
        ctx_seq = torch.repeat_interleave(seq_ids, lengths)
        ctx_pos = torch.arange(int(offsets[-1]), device=offsets.device) - offsets[ctx_seq]
        return cls(
            block_size=block_size,
            ctx_seq=ctx_seq,
            ctx_pos=ctx_pos,
            block_seq=block_seq.to(device=offsets.device, dtype=torch.int64),
            block_anchor=block_anchor.to(device=offsets.device, dtype=torch.int64),
            offsets=offsets,
        )

    @property
    def num_blocks(self) -> int:
        return self.block_seq.shape[0]

    @property
    def num_context(self) -> int:
        return self.ctx_seq.shape[0]

    def query_positions(self) -> Tensor:
        """[nb*B] RoPE position of every block token: anchor + slot."""
        slots = torch.arange(self.block_size, device=self.block_anchor.device)
        return (self.block_anchor[:, None] + slots).reshape(-1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> BlockLayout:
        def mv(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        return BlockLayout(
            self.block_size,
            mv(self.ctx_seq),
            mv(self.ctx_pos),
            mv(self.block_seq),
            mv(self.block_anchor),
            mv(self.offsets),
        )

    def flex_block_mask(self) -> BlockMask:
        """The flex BlockMask of the attention rule over [context ; block tokens], built once.

        The tiles each query tile must visit come straight from the layout (`kv_tiles`), so no
        [Q, KV] mask is ever evaluated and nothing is compiled per batch shape; `mask_mod`
        decides inside the visited tiles. Every lookup table is padded past the next multiple of
        128 with ids that match nothing, so the mask_mod stays in bounds in padded tiles too.
        """
        if self._flex_mask is not None:
            return self._flex_mask
        B, nc, dev = self.block_size, self.num_context, self.block_seq.device
        nq = self.num_blocks * B

        def padded(t: Tensor, fill: int) -> Tensor:
            n = t.shape[0]
            return F.pad(t, (0, -n % 128 + 128), value=fill)

        blk = torch.arange(nq, device=dev) // B
        q_seq = padded(self.block_seq.repeat_interleave(B), -2)
        q_anchor = padded(self.block_anchor.repeat_interleave(B), -2)
        q_blk = padded(blk, -2)
        kv_seq = padded(torch.cat([self.ctx_seq, torch.full_like(blk, -1)]), -3)
        kv_pos = padded(torch.cat([self.ctx_pos, torch.zeros_like(blk)]), -3)
        kv_blk = padded(torch.cat([torch.full_like(self.ctx_seq, -1), blk]), -3)

        def mask_mod(b, h, q_idx, kv_idx):
            in_context = (kv_seq[kv_idx] == q_seq[q_idx]) & (kv_pos[kv_idx] < q_anchor[q_idx])
            return in_context | (kv_blk[kv_idx] == q_blk[q_idx])

        counts, indices, full_counts, full_indices = self.kv_tiles()
        self._flex_mask = BlockMask.from_kv_blocks(
            counts[None, None], indices[None, None], full_counts[None, None], full_indices[None, None],
            BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(nq, nc + nq),
        )  # fmt: skip
        return self._flex_mask

    def kv_tiles(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For each 128-query tile, the 128-key tiles it may attend to, split as flex wants them:
        (counts [Qt], indices [Qt, KVt]) of the partial tiles, where mask_mod decides pair by
        pair, and (full_counts, full_indices) of the full tiles, where every pair is allowed and
        mask_mod never runs. The first `counts[t]` entries of row t are used; int32.

        A query tile holds the tokens of a run of consecutive blocks, grouped by sequence. Their
        context lies between the start of the first block's sequence and the furthest
        `sequence start + anchor` among them (one contiguous range that may include some tiles
        of sequences in between: mask_mod masks those), and their own block keys sit at
        `Nc + query index`. When the tile's blocks all belong to one sequence, the context tiles
        before its smallest anchor are full: at long context that is nearly all of them, and
        skipping mask_mod there is what makes the attention kernel fast (BENCHMARKS.md).
        """
        B, nc, dev = self.block_size, self.num_context, self.block_seq.device
        nq = self.num_blocks * B
        n_qt, n_kvt = -(-nq // TILE), -(-(nc + nq) // TILE)
        starts = self.offsets[self.block_seq]  # context start of each block's sequence
        ends = starts + self.block_anchor  # one past the last visible context token
        first_tile = torch.arange(self.num_blocks, device=dev) * B // TILE  # a block may straddle
        last_tile = ((torch.arange(self.num_blocks, device=dev) + 1) * B - 1) // TILE  # two tiles

        def per_tile(values: Tensor, reduce: str, init: int) -> Tensor:
            out = torch.full((n_qt,), init, dtype=torch.int64, device=dev)
            for tile in (first_tile, last_tile):
                out.scatter_reduce_(0, tile, values, reduce)
            return out

        lo, hi, min_end = per_tile(starts, "amin", nc), per_tile(ends, "amax", 0), per_tile(ends, "amin", nc)
        one_seq = per_tile(self.block_seq, "amin", 1 << 62) == per_tile(self.block_seq, "amax", -1)
        t = torch.arange(n_qt, device=dev)
        # own keys: the whole blocks the tile's queries belong to (at nc + their token indices)
        own_lo = (nc + t * TILE // B * B) // TILE
        own_hi = (nc + torch.clamp(-(-(t + 1) * TILE // B) * B, max=nq) - 1) // TILE
        ctx_lo = lo // TILE
        ctx_hi = torch.minimum((hi - 1) // TILE, own_lo - 1)  # a shared tile is counted as own
        n_ctx = torch.where(hi > lo, ctx_hi - ctx_lo + 1, 0).clamp(min=0)
        # full context tiles: wholly inside [sequence start, start + smallest anchor)
        full_lo = -(-lo // TILE)
        n_full = torch.where(one_seq & (hi > lo), min_end // TILE - full_lo, 0).clamp(min=0)
        before = torch.where(n_full > 0, full_lo - ctx_lo, n_ctx)
        after = torch.where(n_full > 0, ctx_hi - (full_lo + n_full) + 1, 0)
        counts, indices = _tile_runs([(ctx_lo, before), (full_lo + n_full, after), (own_lo, own_hi - own_lo + 1)],
                                     n_kvt)  # fmt: skip
        full_counts, full_indices = _tile_runs([(full_lo, n_full)], n_kvt)
        return counts, indices, full_counts, full_indices

    def sdpa_plan(self) -> list[tuple[int, int, int, int]]:
        """(q_start, q_end, ctx_start, ctx_len) pieces for the exact path, in query order.

        A piece is a run of consecutive blocks of one sequence; its context is that sequence's
        prefix up to the largest anchor in the run. Runs are cut so that a piece's score matrix
        stays near SDPA_CHUNK_ELEMS elements per head.
        """
        if self._sdpa_plan is not None:
            return self._sdpa_plan
        B = self.block_size
        seqs = self.block_seq.tolist()
        anchors = self.block_anchor.tolist()
        offsets = self.offsets.tolist()
        plan: list[tuple[int, int, int, int]] = []
        j = 0
        while j < len(seqs):
            s, start = seqs[j], j
            if start > 0 and s < seqs[start - 1]:
                raise ValueError("blocks must be grouped by sequence, in sequence order")
            while j < len(seqs) and seqs[j] == s:
                nq = (j - start + 1) * B
                if j > start and nq * (anchors[j] + nq) > SDPA_CHUNK_ELEMS:
                    break
                j += 1
            plan.append((start * B, j * B, offsets[s], max(anchors[start:j])))
        self._sdpa_plan = plan
        return plan


def _tile_runs(runs: list[tuple[Tensor, Tensor]], width: int) -> tuple[Tensor, Tensor]:
    """Rows of tile ids made of consecutive runs: run i of row t is `length[t]` ids from
    `start[t]`. Returns (counts [rows] int32, indices [rows, width] int32, zero past the count)."""
    j = torch.arange(width, device=runs[0][0].device)
    indices = torch.zeros(runs[0][0].shape[0], width, dtype=torch.int64, device=j.device)
    done = torch.zeros_like(runs[0][0])
    for start, length in runs:
        inside = (j >= done[:, None]) & (j < (done + length)[:, None])
        indices = torch.where(inside, start[:, None] + j - done[:, None], indices)
        done = done + length
    return done.to(torch.int32), indices.to(torch.int32)


# ----------------------------------------------------------------------------- attention


def block_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    layout: BlockLayout,
    scale: float | None = None,
    impl: str | None = None,
) -> Tensor:
    """Attention of block queries over [own-sequence context before the anchor ; own block].

    q [nq, Hq, D] with nq = nb*B; k_ctx, v_ctx [Nc, Hkv, D]; k_blk, v_blk [nq, Hkv, D]; Hq a
    multiple of Hkv (GQA: query head h reads kv head h // (Hq/Hkv)). Returns [nq, Hq, D].
    impl: "flex", "sdpa", or None (flex on CUDA when it works, else sdpa).
    """
    global _flex_broken
    if q.shape[0] == 0:
        return q * 0  # keeps the graph for an empty batch
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl is None:
        use_flex = q.is_cuda and _flex_compiled is not None and not _flex_broken
        if use_flex:
            try:
                return _flex_path(q, k_ctx, v_ctx, k_blk, v_blk, layout, scale)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # compile/kernel failure: fall back once, loudly
                _flex_broken = True
                warnings.warn(
                    f"flex_attention failed ({type(e).__name__}: {e}); "
                    "falling back to the exact SDPA path",
                    stacklevel=2,
                )
        impl = "sdpa"
    if impl == "flex":
        return _flex_path(q, k_ctx, v_ctx, k_blk, v_blk, layout, scale)
    if impl == "sdpa":
        return _sdpa_path(q, k_ctx, v_ctx, k_blk, v_blk, layout, scale)
    raise ValueError(f"unknown attention impl {impl!r}")


def _flex_path(q, k_ctx, v_ctx, k_blk, v_blk, layout, scale) -> Tensor:
    fn = _flex_compiled if _flex_compiled is not None else flex_attention
    k = torch.cat([k_ctx, k_blk]).transpose(0, 1).unsqueeze(0)
    v = torch.cat([v_ctx, v_blk]).transpose(0, 1).unsqueeze(0)
    out = fn(
        q.transpose(0, 1).unsqueeze(0),
        k,
        v,
        block_mask=layout.flex_block_mask(),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _sdpa_path(q, k_ctx, v_ctx, k_blk, v_blk, layout, scale) -> Tensor:
    """Exact attention without a [nq, nq] score block: each query scores its sequence's context
    prefix and its own block's B keys, and one softmax runs over both. Most of a dense
    [context ; all blocks] mask would be masked out, so this is several times cheaper on CPU."""
    B = layout.block_size
    groups = q.shape[1] // k_ctx.shape[1]
    anchors = layout.block_anchor
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 at least
    outs = []
    for q0, q1, c0, n_ctx in layout.sdpa_plan():
        nb = (q1 - q0) // B
        qs = q[q0:q1].view(nb, B, *q.shape[1:]).transpose(1, 2)  # [nb, Hq, B, D]
        kc = k_ctx[c0 : c0 + n_ctx].repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, T, D]
        vc = v_ctx[c0 : c0 + n_ctx].repeat_interleave(groups, dim=1).transpose(0, 1)
        kb = k_blk[q0:q1].view(nb, B, *k_blk.shape[1:]).repeat_interleave(groups, dim=2).transpose(1, 2)
        vb = v_blk[q0:q1].view(nb, B, *v_blk.shape[1:]).repeat_interleave(groups, dim=2).transpose(1, 2)
        s_ctx = torch.einsum("nhbd,htd->nhbt", qs, kc).to(acc) * scale
        visible = torch.arange(n_ctx, device=q.device) < anchors[q0 // B : q1 // B, None]  # [nb, T]
        s_ctx = s_ctx.masked_fill(~visible[:, None, None, :], float("-inf"))
        s_blk = torch.einsum("nhbd,nhcd->nhbc", qs, kb).to(acc) * scale
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(v_ctx.dtype)
        o = torch.einsum("nhbt,htd->nhbd", p[..., :n_ctx], vc) + torch.einsum("nhbc,nhcd->nhbd", p[..., n_ctx:], vb)
        outs.append(o.transpose(1, 2).reshape(q1 - q0, *q.shape[1:]))
    return torch.cat(outs)


# ----------------------------------------------------------------------------- anchors, blocks


def default_gamma(block_size: int) -> float:
    """Slot-decay gamma: the paper's 7 / 5 / 4 for B = 16 / 10 / 8.

    Fallback for other B: linear interpolation between those points, extended past them along
    the nearest segment (slope 1/2 below 10, 1/3 above 10), and never below 1.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if block_size in _PUBLISHED_GAMMA:
        return _PUBLISHED_GAMMA[block_size]
    if block_size < 10:
        return max(1.0, 4.0 + (block_size - 8) / 2)
    return 5.0 + (block_size - 10) / 3


def slot_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """[B] loss weight per slot: 0 at slot 0 (the given anchor), exp(-(k-1)/gamma) at k >= 1.

    Early slots weigh most because a draft is accepted only up to its first wrong token.
    """
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(
    loss_mask: Tensor, block_size: int, max_anchors: int, generator: torch.Generator
) -> Tensor:
    """Sorted anchor positions of one sequence: supervised p with p + B <= len, at most
    max_anchors of them drawn uniformly without replacement (fresh for each generator state).
    """
    n_valid = loss_mask.shape[0] - block_size + 1
    if n_valid <= 0 or max_anchors <= 0:
        return torch.zeros(0, dtype=torch.int64)
    return pick_anchors(torch.nonzero(loss_mask[:n_valid].cpu() != 0).flatten(), max_anchors, generator)


def pick_anchors(candidates: Tensor, max_anchors: int, generator: torch.Generator) -> Tensor:
    """At most max_anchors of the sorted candidate positions, drawn uniformly without replacement,
    sorted; all of them when there are no more."""
    if candidates.numel() > max_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator, device=generator.device)
        candidates = candidates[pick[:max_anchors].cpu()].sort().values
    return candidates


def anchors_by_sequence(loss_mask: Tensor, offsets: Tensor, anchors: Callable[[Tensor], Tensor]
                        ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(sequence, anchor position) of every block of a packed batch, grouped by sequence in order:
    `anchors(loss_mask of one sequence)` gives a sequence's sorted anchors."""
    bounds = offsets.tolist()
    seq_of, anchor_of = [], []
    for s in range(len(bounds) - 1):
        a = anchors(loss_mask[bounds[s] : bounds[s + 1]])
        seq_of.append(torch.full_like(a, s))
        anchor_of.append(a)
    block_seq = torch.cat(seq_of) if seq_of else torch.zeros(0, dtype=torch.int64)
    block_anchor = torch.cat(anchor_of) if anchor_of else torch.zeros(0, dtype=torch.int64)
    return block_seq, block_anchor


def drafter_cost(lengths: np.ndarray, block_size: int, max_anchors: int) -> float:
    """A packed batch's relative drafter compute, from its sample lengths: its block tokens (an
    upper bound: anchors need supervised positions) plus its context tokens."""
    anchors = np.minimum(np.maximum(np.asarray(lengths) - block_size + 1, 0), max_anchors)
    return float(block_size * anchors.sum() + np.sum(lengths))


@dataclass
class Blocks:
    """The training blocks of one packed batch; flatten [nb, B] to [nb*B] for the model."""

    layout: BlockLayout
    input_ids: Tensor  # [nb, B] anchor token at slot 0, mask token after
    labels: Tensor  # [nb, B] the token each slot predicts (DFlash: at anchor + slot)
    weights: Tensor  # [nb, B] float32 slot decay * loss mask; 0 where a slot is not trained (DFlash: slot 0)
    first_slot: int = 1  # the slot of the first drafted token (DFlash: 1; a family that drafts from slot 0: 0)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Blocks:
        return Blocks(
            self.layout.to(device, non_blocking),
            self.input_ids.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.weights.to(device, non_blocking=non_blocking),
            self.first_slot,
        )


def make_blocks(
    input_ids: Tensor,
    loss_mask: Tensor,
    offsets: Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    max_anchors: int = 512,
    generator: torch.Generator,
    gamma: float | None = None,
) -> Blocks:
    """Sample anchors per sequence and build the blocks of a packed batch.

    Index work runs on the CPU (anchor sampling needs host-side counts); call this on host
    tensors in the loader and move the result with Blocks.to(device).
    """
    input_ids, loss_mask, offsets = input_ids.cpu(), loss_mask.cpu(), offsets.cpu().long()
    B = block_size
    block_seq, block_anchor = anchors_by_sequence(loss_mask, offsets,
                                                  lambda m: sample_anchors(m, B, max_anchors, generator))  # fmt: skip

    rows = (offsets[block_seq] + block_anchor)[:, None] + torch.arange(B)  # [nb, B]
    labels = input_ids[rows].long()
    ids = torch.full_like(labels, mask_token_id)
    ids[:, 0] = labels[:, 0]
    weights = slot_weights(B, gamma)[None, :] * (loss_mask[rows] != 0).float()
    layout = BlockLayout.build(offsets, block_seq, block_anchor, B)
    return Blocks(layout=layout, input_ids=ids, labels=labels, weights=weights)


# ----------------------------------------------------------------------------- loss, metrics


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
    def forward(ctx, hidden, weight, labels, weights, chunk_size):  # noqa: ANN001 - autograd signature
        scale = weights.float() / weights.float().sum().clamp_min(1e-12)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ce = _ce_chunk_cuda if hidden.is_cuda and _ce_chunk_cuda is not None else _ce_chunk
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk_size):
            h = hidden[s : s + chunk_size].to(weight.dtype)
            part, ok, g = ce(F.linear(h, weight), labels[s : s + chunk_size], scale[s : s + chunk_size])
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
        return grad_h, grad_w, None, None, None


def chunked_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_size: int = 4096,
) -> tuple[Tensor, Tensor]:
    """Weighted cross-entropy sum(w*ce)/sum(w) over the vocabulary, chunk by chunk.

    Full logits (anchors x slots x 150-250K vocab: several GB) never exist at once, and no chunk's
    logits are computed twice (see _LinearCrossEntropy). Softmax runs in float32. Returns (loss,
    correct [N] bool = argmax == label); loss is 0, with a graph, when sum(w) == 0.
    """
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return _LinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights, chunk_size)


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
    def forward(ctx, hidden, weight, bias, bias_weight, labels, ce_scale, l1_scale, target, chunk_size):  # noqa: ANN001
        need_h, need_b, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        chunk = _tv_chunk_cuda if hidden.is_cuda and _tv_chunk_cuda is not None else _tv_chunk
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_b = torch.zeros_like(bias) if need_b else None
        grad_w2 = torch.zeros_like(bias_weight, dtype=acc) if need_w2 else None
        n = hidden.shape[0]
        ce, l1 = torch.zeros(n, dtype=acc, device=hidden.device), torch.zeros(n, dtype=acc, device=hidden.device)
        hits = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        accept = torch.zeros(n, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            h = hidden[s:e].to(weight.dtype)
            logits = F.linear(h, weight)
            if bias is not None:  # the low-rank bias added by the GEMM itself: no second [chunk, V] pass
                z = bias[s:e].to(weight.dtype)
                logits = torch.addmm(logits, z, bias_weight.to(weight.dtype).T)
            tl = None if target is None else F.linear(target[s:e].to(weight.dtype), weight)
            ce[s:e], l1[s:e], hits[s:e], accept[s:e], g = chunk(logits, tl, labels[s:e], ce_scale[s:e], l1_scale[s:e])
            g = g.to(weight.dtype)
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
        return grad_h, None, grad_b, grad_w2, None, None, None, None, None


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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Cross-entropy plus the total-variation (L1) distance to the target's own distribution, chunk
    by chunk over the vocabulary, as `chunked_loss` does for cross-entropy alone.

    Row i's logits are `hidden[i] @ W^T`, plus `bias[i] @ bias_weight^T` when given (a low-rank
    logit bias, e.g. a Markov head's); `target[i]` is the target's hidden state whose LM-head
    softmax is the distribution matched (None: no L1 term). Returns (sum_i ce_scale_i * ce_i +
    l1_scale_i * L1_i, differentiable wrt hidden, bias and bias_weight; and per row, detached:
    ce, L1, argmax == label, and the acceptance rate clamp(1 - L1 / 2, 0, 1))."""
    if hidden.shape[0] == 0:
        zero = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        total = hidden.sum() * 0.0 + (0.0 if bias is None else bias.sum() * 0.0 + bias_weight.sum() * 0.0)
        return total, zero, zero, torch.zeros(0, dtype=torch.bool, device=hidden.device), zero
    if (bias is None) != (bias_weight is None):
        raise ValueError("bias and bias_weight come together")
    return _TVLoss.apply(hidden, lm_head_weight, bias, bias_weight, labels, ce_scale, l1_scale, target, chunk_size)


def forward_blocks(model: torch.nn.Module, embed: Tensor, head: Tensor, batch: Batch, *, block_size: int,
                   mask_token_id: int, max_anchors: int, gamma: float | None, loss_chunk: int,
                   generator: torch.Generator) -> tuple[Tensor, Tensor, Blocks]:  # fmt: skip
    """Blocks from anchors, frozen embedding, drafter, chunked decayed loss: the forward of a
    training step (`stage.train_step` adds the backward) and of validation (`validate.Validator`).
    Returns the loss, which block tokens the argmax predicted right, and the blocks."""
    ids, mask, offsets = batch.host
    blocks = make_blocks(ids, mask, offsets, block_size=block_size, mask_token_id=mask_token_id,
                         max_anchors=max_anchors, generator=generator, gamma=gamma)  # fmt: skip
    # Only weighted slots reach the LM head: never slot 0 (the given anchor), nor unsupervised ones.
    scored = blocks.weights.flatten().nonzero().squeeze(1).to(embed.device, non_blocking=True)
    blocks = blocks.to(embed.device, non_blocking=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if embed.is_cuda else nullcontext()
    with autocast:
        block_embeds = F.embedding(blocks.input_ids.flatten(), embed)
        hidden = model(block_embeds, batch.context.to(embed.dtype), blocks.layout)
        loss, hits = chunked_loss(hidden[scored], head, blocks.labels.flatten()[scored],
                                  blocks.weights.flatten()[scored], loss_chunk)  # fmt: skip
    correct = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=hits.device).index_copy_(0, scored, hits)
    return loss, correct.view_as(blocks.labels), blocks


def block_metrics(correct: Tensor, weights: Tensor, first: int = 1) -> dict[str, Tensor]:
    """Raw sums for per-slot accuracy and implied acceptance length, all-reducible across ranks.

    correct, weights: [nb, B]. A slot counts where its weight > 0. Per block, the implied
    acceptance length is 1 + the run of correct slots from slot `first` (the first drafted one:
    1 in DFlash's blocks), ended by the first wrong or unweighted slot. Turn the (summed) result
    into JSON-ready floats with summarize_metrics.
    """
    valid = weights > 0
    hit = correct.bool() & valid
    accept = 1 + hit[:, first:].long().cumprod(dim=1).sum(dim=1)
    return {
        "slot_correct": hit.sum(0).double(),
        "slot_count": valid.sum(0).double(),
        "accept_sum": accept.sum().double(),
        "blocks": torch.tensor(float(correct.shape[0]), dtype=torch.float64, device=correct.device),
    }


def summarize_metrics(sums: dict[str, Tensor], first: int = 1) -> dict:
    """Plain floats and lists from block_metrics sums: slot_acc[i] is the accuracy of the i-th
    drafted token, slot first + i (DFlash: slot_acc[k-1] is slot k's; 0.0 where a slot had no
    counted tokens), accept_len is the mean over blocks."""
    correct = sums["slot_correct"].tolist()[first:]
    count = sums["slot_count"].tolist()[first:]
    blocks = float(sums["blocks"])
    return {
        "slot_acc": [c / n if n > 0 else 0.0 for c, n in zip(correct, count, strict=True)],
        "slot_count": [int(n) for n in count],
        "accept_len": float(sums["accept_sum"]) / blocks if blocks > 0 else 0.0,
        "blocks": int(blocks),
    }
