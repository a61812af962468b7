"""DFlash objective: chunked loss vs full logits, anchors, blocks, slot weights, metrics, and the
block attention rule vs a dense mask built from the rule's definition."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import packed_rows
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_cache.drafters import attention
from dflash_cache.drafters.attention import BlockLayout, block_attention
from dflash_cache.drafters.blocks import default_gamma, make_blocks, sample_anchors, slot_weights
from dflash_cache.drafters.losses import chunked_loss
from dflash_cache.train.metrics import block_metrics, summarize_metrics

# ----------------------------------------------------------------------------- chunked loss


def loss_inputs(n=50, h=16, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w_lm = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    weights = torch.rand(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) > 0.3)
    return hidden, w_lm, labels, weights.float()


@pytest.mark.parametrize("chunk", [7, 10, 50, 64])  # 50 % 7 != 0; 10 divides 50
def test_chunked_loss_matches_full_logits(chunk):
    hidden, w_lm, labels, weights = loss_inputs()
    logits = hidden @ w_lm.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    ref = (weights.double() * ce).sum() / weights.double().sum()
    ref_grads = torch.autograd.grad(ref, (hidden, w_lm))

    loss, correct = chunked_loss(hidden, w_lm, labels, weights, chunk_size=chunk)
    grads = torch.autograd.grad(loss, (hidden, w_lm))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)  # float32 softmax
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-6)
    assert correct.dtype == torch.bool
    assert torch.equal(correct, logits.argmax(-1) == labels)


def test_chunked_loss_zero_weights_and_empty():
    hidden, w_lm, labels, weights = loss_inputs()
    loss, _ = chunked_loss(hidden, w_lm, labels, torch.zeros_like(weights), chunk_size=8)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(hidden.grad) == 0

    empty = torch.zeros(0, 16, dtype=torch.float64, requires_grad=True)
    loss, correct = chunked_loss(empty, w_lm, labels[:0], weights[:0])
    assert loss.item() == 0.0 and correct.shape == (0,)
    loss.backward()


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_loss_never_holds_full_logits():
    n, v, chunk = 64, 1000, 16
    hidden, w_lm, labels, weights = loss_inputs(n=n, h=8, v=v)
    with LargestTensor() as mode:
        loss, _ = chunked_loss(hidden, w_lm, labels, weights, chunk_size=chunk)
        loss.backward()
    assert mode.largest <= chunk * v  # full logits would be n * v


# ----------------------------------------------------------------------------- anchors, blocks


def test_sample_anchors_rules():
    rng = torch.Generator().manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):
        n = int(torch.randint(0, 80, (1,), generator=rng))
        bsz = [4, 8, 10, 16][int(torch.randint(0, 4, (1,), generator=rng))]
        cap = int(torch.randint(0, 25, (1,), generator=rng))
        mask = (torch.rand(n, generator=rng) < torch.rand(1, generator=rng)).to(torch.uint8)
        a = sample_anchors(mask, bsz, cap, gen)
        valid = [p for p in range(n) if mask[p] == 1 and p + bsz <= n]
        assert a.dtype == torch.int64
        assert len(a) == min(cap, len(valid))
        assert a.tolist() == sorted(set(a.tolist()))  # unique and sorted
        assert set(a.tolist()) <= set(valid)


def test_sample_anchors_fresh_reproducible_uniform():
    mask = torch.ones(40, dtype=torch.uint8)  # 25 valid positions for B=16
    g = torch.Generator().manual_seed(7)
    draws = [sample_anchors(mask, 16, 5, g).tolist() for _ in range(2000)]
    assert len({tuple(d) for d in draws[:20]}) > 15  # fresh per generator state
    g2 = torch.Generator().manual_seed(7)
    assert sample_anchors(mask, 16, 5, g2).tolist() == draws[0]  # same state, same anchors
    freq = torch.bincount(torch.tensor(draws).flatten(), minlength=25) / len(draws)
    assert torch.allclose(freq, torch.full((25,), 5 / 25), atol=0.04)  # uniform
    assert sample_anchors(mask[:15], 16, 5, g).numel() == 0  # shorter than a block
    assert sample_anchors(torch.zeros(40), 16, 5, g).numel() == 0  # nothing supervised


def test_make_blocks():
    lengths = [30, 5, 50, 21]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    n = int(offsets[-1])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 90, (n,), generator=g, dtype=torch.int32)
    mask = (torch.rand(n, generator=g) < 0.7).to(torch.uint8)
    bsz, mask_id = 8, 99
    blocks = make_blocks(
        ids, mask, offsets, block_size=bsz, mask_token_id=mask_id, max_anchors=6,
        generator=torch.Generator().manual_seed(0),
    )
    lay = blocks.layout
    nb = lay.num_blocks
    assert nb > 0 and blocks.input_ids.shape == blocks.labels.shape == (nb, bsz)
    assert lay.block_seq.tolist() == sorted(lay.block_seq.tolist())
    decay = [0.0] + [math.exp(-(k - 1) / 4) for k in range(1, bsz)]
    for j in range(nb):
        s, a = int(lay.block_seq[j]), int(lay.block_anchor[j])
        start = int(offsets[s]) + a
        assert mask[start] == 1 and a + bsz <= lengths[s]
        assert blocks.input_ids[j].tolist() == [int(ids[start])] + [mask_id] * (bsz - 1)
        assert blocks.labels[j].tolist() == ids[start : start + bsz].tolist()  # same position
        for k in range(bsz):
            want = decay[k] * float(mask[start + k])
            assert blocks.weights[j, k].item() == pytest.approx(want, rel=1e-6)
    per_seq = torch.bincount(lay.block_seq, minlength=4).tolist()
    assert per_seq[1] == 0 and max(per_seq) <= 6
    assert lay.ctx_seq.tolist() == [s for s, m in enumerate(lengths) for _ in range(m)]
    assert lay.ctx_pos.tolist() == [p for m in lengths for p in range(m)]
    qpos = lay.query_positions().view(nb, bsz)
    assert torch.equal(qpos, lay.block_anchor[:, None] + torch.arange(bsz))


def test_make_blocks_empty_batch():
    blocks = make_blocks(
        torch.arange(10), torch.zeros(10), torch.tensor([0, 10]), block_size=4,
        mask_token_id=0, generator=torch.Generator(),
    )
    assert blocks.input_ids.shape == (0, 4) and blocks.layout.num_blocks == 0


def test_slot_weights_and_gamma():
    for bsz, gamma in [(16, 7.0), (10, 5.0), (8, 4.0)]:
        assert default_gamma(bsz) == gamma
        w = slot_weights(bsz)
        want = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, bsz)])
        torch.testing.assert_close(w, want)
        assert w[1] == 1.0
    gammas = [default_gamma(b) for b in range(2, 33)]
    assert all(x < y for x, y in zip(gammas, gammas[1:], strict=False))  # fallback is monotone
    assert slot_weights(4, gamma=2.0)[3].item() == pytest.approx(math.exp(-1.0))
    with pytest.raises(ValueError):
        default_gamma(1)


def test_block_metrics_known_answer():
    # 4 blocks, B=5. Rows: correct; weights (0 at slot 0 always).
    correct = torch.tensor(
        [
            [1, 1, 1, 0, 1],  # run 2 -> accept 3
            [0, 1, 1, 1, 1],  # all correct -> accept 5
            [1, 0, 1, 1, 1],  # wrong at slot 1 -> accept 1
            [1, 1, 1, 1, 1],  # slot 3 unweighted ends the run -> accept 3
        ],
        dtype=torch.bool,
    )
    weights = torch.tensor(
        [
            [0, 1.0, 0.8, 0.6, 0.5],
            [0, 1.0, 0.8, 0.6, 0.5],
            [0, 1.0, 0.8, 0.6, 0.5],
            [0, 1.0, 0.8, 0.0, 0.5],
        ]
    )
    sums = block_metrics(correct, weights)
    assert sums["slot_correct"].tolist() == [0, 3, 4, 2, 4]
    assert sums["slot_count"].tolist() == [0, 4, 4, 3, 4]
    assert sums["accept_sum"].item() == 12 and sums["blocks"].item() == 4
    out = summarize_metrics(sums)
    assert out["slot_acc"] == [0.75, 1.0, 2 / 3, 1.0]
    assert out["slot_count"] == [4, 4, 3, 4]
    assert out["accept_len"] == 3.0 and out["blocks"] == 4
    # summed across "ranks"
    twice = {k: v + v for k, v in sums.items()}
    assert summarize_metrics(twice)["accept_len"] == 3.0
    assert isinstance(out["accept_len"], float) and all(isinstance(x, float) for x in out["slot_acc"])


# ----------------------------------------------------------------------------- attention rule


def dense_rule_attention(q, kc, vc, kb, vb, seq, anchor, ctx_seq, ctx_pos, bsz):
    """The rule written out as a full [nq, Nc + nq] mask, one query at a time."""
    nq, nc = q.shape[0], kc.shape[0]
    allowed = torch.zeros(nq, nc + nq, dtype=torch.bool)
    for i in range(nq):
        j = i // bsz
        for t in range(nc):
            allowed[i, t] = ctx_seq[t] == seq[j] and ctx_pos[t] < anchor[j]
        allowed[i, nc + j * bsz : nc + (j + 1) * bsz] = True
    rep = q.shape[1] // kc.shape[1]
    k = torch.cat([kc, kb]).repeat_interleave(rep, 1)
    v = torch.cat([vc, vb]).repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("chunk_elems", [1 << 23, 30])
def test_block_attention_sdpa_matches_dense_rule(chunk_elems, monkeypatch):
    monkeypatch.setattr(attention, "SDPA_CHUNK_ELEMS", chunk_elems)
    bsz, lengths = 3, [9, 2, 14]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    seq, anchor = [0, 0, 0, 2, 2, 2, 2], [0, 4, 6, 1, 2, 7, 11]
    layout = BlockLayout.build(offsets, torch.tensor(seq), torch.tensor(anchor), bsz)
    g = torch.Generator().manual_seed(0)
    nq, nc, hq, hkv, d = len(seq) * bsz, int(offsets[-1]), 4, 2, 8

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, kc, vc, kb, vb = rand(nq, hq, d), rand(nc, hkv, d), rand(nc, hkv, d), rand(nq, hkv, d), \
        rand(nq, hkv, d)
    out = block_attention(q, torch.cat([kc, kb]), torch.cat([vc, vb]), layout)
    ref = dense_rule_attention(
        q, kc, vc, kb, vb, seq, anchor, layout.ctx_seq.tolist(), layout.ctx_pos.tolist(), bsz
    )
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_block_attention_rejects_unsorted_blocks():
    layout = BlockLayout.build(torch.tensor([0, 10, 20]), torch.tensor([1, 0]),
                               torch.tensor([2, 2]), 4)
    x = torch.randn(8, 2, 4)
    with pytest.raises(ValueError):
        block_attention(x, torch.randn(28, 2, 4), torch.randn(28, 2, 4), layout, impl="sdpa")


def _random_layout(g: torch.Generator, bsz: int, long: bool = False) -> BlockLayout:
    """Sequences of mixed lengths (some longer than a 128-token tile), blocks at random anchors,
    grouped by sequence as make_blocks lays them out. `long`: longer sequences with anchors late
    in them, so that query tiles have full context tiles."""
    lengths = torch.randint(300 if long else 2, 1200 if long else 300, (int(torch.randint(1, 6, (1,), generator=g)),),
                            generator=g)  # fmt: skip
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    seq, anchor = [], []
    for s, n in enumerate(lengths.tolist()):
        k = int(torch.randint(0, 24 if long else 12, (1,), generator=g))
        lo = n // 2 if long else 0
        picks = sorted(torch.randint(lo, n - 1, (k,), generator=g).tolist())
        seq += [s] * k
        anchor += [a + 1 for a in picks]
    return BlockLayout.build(offsets, torch.tensor(seq, dtype=torch.int64), torch.tensor(anchor, dtype=torch.int64),
                             bsz)  # fmt: skip


def _allowed(layout: BlockLayout) -> torch.Tensor:
    """[nq, nc + nq]: the attention rule from its definition."""
    bsz = layout.block_size
    j = torch.arange(layout.num_blocks * bsz) // bsz
    q_seq, q_anchor = layout.block_seq[j], layout.block_anchor[j]
    ctx = (layout.ctx_seq[None, :] == q_seq[:, None]) & (layout.ctx_pos[None, :] < q_anchor[:, None])
    return torch.cat([ctx, j[:, None] == j[None, :]], dim=1)


def _listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    listed = torch.zeros(indices.shape, dtype=torch.bool)
    for t in range(indices.shape[0]):
        row = indices[t, : counts[t]]
        assert len(set(row.tolist())) == len(row), "a tile listed twice"
        listed[t, row.long()] = True
    return listed


@pytest.mark.parametrize("bsz", [4, 10, 16])
@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("groups", [1, 3, 13])
def test_flex_tiles_cover_every_allowed_pair(bsz, long, groups):
    """Every (query, key) pair the rule allows lies in a tile that kv_tiles lists for its query
    tile (flex skips unlisted tiles), every pair of a tile listed as full is allowed (flex skips
    mask_mod there), and the listing stays close to the tiles actually needed; with the queries
    packed by key head too (`groups` rows a token: 16 x 13 rows span up to three tiles a block)."""
    g = torch.Generator().manual_seed(bsz)
    fulls = 0
    for _ in range(40):
        layout = _random_layout(g, bsz, long)
        if layout.num_blocks == 0:
            continue
        nq, nc = layout.num_blocks * bsz, layout.num_context
        rows = nq * groups
        counts, indices, full_counts, full_indices = layout.kv_tiles(groups=groups)
        n_qt, n_kvt = -(-rows // 128), -(-(nc + nq) // 128)
        assert counts.shape == full_counts.shape == (n_qt,) and indices.shape == full_indices.shape == (n_qt, n_kvt)
        partial, full = _listed(counts, indices), _listed(full_counts, full_indices)
        assert not (partial & full).any(), "a tile both partial and full"
        listed = partial | full
        allowed = _allowed(layout)[packed_rows(bsz, layout.num_blocks, groups)]
        padded = torch.nn.functional.pad(allowed, (0, n_kvt * 128 - nc - nq, 0, n_qt * 128 - rows))
        tiles = padded.view(n_qt, 128, n_kvt, 128)
        needed = tiles.any(dim=3).any(dim=1)
        assert not (needed & ~listed).any(), "an allowed pair in an unlisted tile"
        for t in range(n_qt):  # only gaps between the sequences of one query tile add tiles
            need = needed[t].nonzero()
            assert not listed[t, : need.min()].any() and not listed[t, need.max() + 1 :].any()
        if not long:
            assert listed.sum() <= needed.sum() + 2 * n_qt
        real_queries = (torch.arange(n_qt * 128) < rows).view(n_qt, 128)
        every = (tiles | ~real_queries[:, :, None, None]).all(dim=3).all(dim=1)  # padded queries are cut off
        assert not (full & ~every).any(), "a tile listed as full holds a forbidden pair"
        fulls += int(full.sum())
    assert fulls > 0 or not long  # long sequences with late anchors must have full tiles


@pytest.mark.parametrize("long", [False, True])
def test_flex_block_mask_gives_the_rule_on_cpu(long):
    """flex_attention (eager, on the CPU) with the layout's BlockMask, full tiles included, equals
    the exact path."""
    g = torch.Generator().manual_seed(1)
    layout = _random_layout(g, 16, long)
    while layout.num_blocks < 3 or (long and layout.kv_tiles()[2].sum() == 0):
        layout = _random_layout(g, 16, long)
    nq, nc, hq, hkv, d = layout.num_blocks * 16, layout.num_context, 4, 2, 8
    q, kb, vb = (torch.randn(nq, h, d, generator=g) for h in (hq, hkv, hkv))
    kc, vc = (torch.randn(nc, hkv, d, generator=g) for _ in range(2))
    k, v = torch.cat([kc, kb]), torch.cat([vc, vb])
    flex = torch.nn.attention.flex_attention.flex_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=layout.flex_block_mask(),
        enable_gqa=True,
    )[0].transpose(0, 1)
    exact = block_attention(q, k, v, layout, impl="sdpa")
    torch.testing.assert_close(flex, exact, rtol=1e-5, atol=1e-5)
