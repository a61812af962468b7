"""Sliding-window draft layers against independent computations: the training attention (the exact
SDPA path and flex attention, run eagerly on the CPU) against a dense mask of the rule written out
pair by pair; the flex tiles a sliding layer visits against the same rule, and their number bounded
by the window; the settings' checks; the serving config's fields and their round trip, both
families; the drafter served through z-lab's reference code and through generate's BlockProposer
against the training forward, over contexts longer than the window; and `dflash train
--sliding-window` from the command line.

The rule (z-lab's reference, `dflash` 0.1.0 `_attention_mask`, with `is_causal` false): in a sliding
layer of window W the block token at position q = anchor + k sees the context positions j < anchor
with q - j < W, and the block tokens at positions j with |q - j| < W."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.drafters import attention
from dflash_cache.drafters.attention import TILE, BlockLayout, block_attention

B = 4


def packed_layout(lengths: list[int], per_seq: int, seed: int = 0, block_size: int = B) -> BlockLayout:
    """Sequences packed together, each with up to `per_seq` sorted random anchors (anchor 0 allowed)."""
    g = torch.Generator().manual_seed(seed)
    seq, anchor = [], []
    for s, n in enumerate(lengths):
        if n >= block_size:
            a = torch.randperm(n - block_size + 1, generator=g)[:per_seq].sort().values
            seq += [s] * len(a)
            anchor += a.tolist()
    return BlockLayout.build(torch.tensor([0, *lengths]).cumsum(0), torch.tensor(seq), torch.tensor(anchor), block_size)


def rule_mask(layout: BlockLayout, window: int | None) -> torch.Tensor:
    """[queries, context + block keys]: the attention rule pair by pair, from each key's and query's
    sequence, block and position alone."""
    nb, B_, nc = layout.num_blocks, layout.block_size, layout.num_context
    q_seq = layout.block_seq.repeat_interleave(B_)
    q_anchor = layout.block_anchor.repeat_interleave(B_)
    q_pos = q_anchor + torch.arange(B_).repeat(nb)
    q_blk = torch.arange(nb * B_) // B_
    k_seq = torch.cat([layout.ctx_seq, q_seq])
    k_pos = torch.cat([layout.ctx_pos, q_pos])
    k_blk = torch.cat([torch.full((nc,), -1), q_blk])
    context = (k_blk[None] < 0) & (k_seq[None] == q_seq[:, None]) & (k_pos[None] < q_anchor[:, None])
    visible = context | (k_blk[None] == q_blk[:, None])
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None]).abs() < window
    return visible


def dense_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of every query over [context ; block keys] under `mask`, GQA by repetition."""
    groups = q.shape[1] // k_ctx.shape[1]
    k = torch.cat([k_ctx, k_blk]).repeat_interleave(groups, 1)
    v = torch.cat([v_ctx, v_blk]).repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask[None], float("-inf")).softmax(-1), v)


def random_qkv(layout: BlockLayout, heads: int = 4, kv_heads: int = 2, d: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    nq, nc = layout.num_blocks * layout.block_size, layout.num_context
    shapes = [(nq, heads, d), (nc, kv_heads, d), (nc, kv_heads, d), (nq, kv_heads, d), (nq, kv_heads, d)]
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


# ----------------------------------------------------------------------------- training attention


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [1, 3, B + 1, 17, 64])
def test_window_attention_is_the_rule(impl, window, monkeypatch):
    """Both training paths (flex attention eagerly on the CPU) give the dense rule's attention and
    gradients, over packed sequences longer than the window, with many anchors each and GQA; windows
    below the block size mask block keys too. Full attention there is something else."""
    monkeypatch.setattr(attention, "_flex_compiled", None)  # eager flex on the CPU
    layout = packed_layout([300, 40, 9, 130], per_seq=12)
    tensors = random_qkv(layout)
    inputs = tensors if impl == "sdpa" else [t.detach() for t in tensors]  # flex has no backward on a CPU
    out = block_attention(*inputs, layout, impl=impl, window=window)
    want = dense_attention(*tensors, rule_mask(layout, window))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    full = dense_attention(*tensors, rule_mask(layout, None))
    assert (out - full).abs().max() > 1e-3
    if impl == "sdpa":
        probe = torch.randn_like(out)
        grads = torch.autograd.grad((out * probe).sum(), tensors)
        want_grads = torch.autograd.grad((want * probe).sum(), tensors)
        for g, wg in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, wg, rtol=1e-9, atol=1e-10)


def tile_mask(layout: BlockLayout, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(what flex attention lets through, the full tiles) as [queries, keys] masks, from the
    BlockMask a sliding layer builds: the visited tiles' pairs where its mask_mod allows them, and
    every pair of a full tile (where mask_mod never runs)."""
    mask = layout.flex_block_mask(window)
    nq, nk = layout.num_blocks * layout.block_size, layout.num_context + layout.num_blocks * layout.block_size
    counts, indices, full_counts, full_indices = layout.kv_tiles(window)

    def tiles(counts, indices):
        out = torch.zeros(len(counts), -(-nk // TILE), dtype=torch.bool)
        for t, (c, row) in enumerate(zip(counts.tolist(), indices.tolist(), strict=True)):
            out[t, row[:c]] = True
        return out.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:nq, :nk]

    q, k = torch.arange(nq)[:, None], torch.arange(nk)[None]
    partial = tiles(counts, indices) & mask.mask_mod(0, 0, q, k)
    full = tiles(full_counts, full_indices)
    assert not (partial & full).any()
    return partial | full, full


@pytest.mark.parametrize("window", [None, 2, 7, 150, 700])
def test_flex_tiles_visit_the_window_alone(window):
    """The key tiles a query tile visits, with mask_mod inside them and full tiles taken whole, let
    through exactly the rule's pairs; with a window, a tile visits at most its blocks' windows
    (O(W) tiles a block, however far apart their anchors and however long the context)."""
    layouts = [packed_layout([3000, 200, 1500], per_seq=40, seed=2), packed_layout([5000], per_seq=3, seed=4),
               packed_layout([900, 12, 900], per_seq=300, seed=5, block_size=16)]  # fmt: skip
    for layout in layouts:
        allowed, full = tile_mask(layout, window)
        rule = rule_mask(layout, window)
        assert torch.equal(allowed, rule)
        assert not (full & ~rule).any()
        if window is None:
            continue
        counts, indices, full_counts, _ = layout.kv_tiles(window)
        blocks = torch.bincount(torch.arange(layout.num_blocks) * layout.block_size // TILE,
                                minlength=len(counts))  # fmt: skip
        own = 2 + layout.block_size // TILE
        assert ((counts + full_counts) <= (blocks + 1) * (window // TILE + 2) + own).all()


def test_sdpa_pieces_stay_within_the_window():
    """The exact path's pieces of a sliding layer score at most twice the window of context (and the
    whole prefix without one)."""
    layout = packed_layout([5000, 300], per_seq=30, seed=3)
    for window in (8, 100):
        plan = layout.sdpa_plan(window)
        assert all(hi - lo <= 2 * window for _, _, _, lo, hi in plan)
        assert [p[:2] for p in plan] == sorted(p[:2] for p in plan)
        assert sum(q1 - q0 for q0, q1, *_ in plan) == layout.num_blocks * B
    assert any(lo == 0 and hi > 1000 for *_, lo, hi in layout.sdpa_plan(None))
