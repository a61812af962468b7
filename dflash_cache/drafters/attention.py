"""The block attention rule and the layout it reads (the rules: docs/architecture.md, "Where each rule lives").

A batch is packed: S sequences concatenated with `offsets [S+1]`, and blocks of B tokens sit at
anchors in them (`blocks.py`). Block j attends to the context of its own sequence strictly before
its anchor and bidirectionally to its own B tokens, never to other blocks; `block_attention`
implements that rule with flex attention on GPU and with an exact chunked SDPA elsewhere.

Flex attention reads the queries packed by key head: the `groups` query heads that share a key
head, for the B tokens of one block, are one run of `groups * B` rows. A 128-row query tile then
holds one or two blocks' queries instead of 128 / B blocks, so it visits about the keys of one
block's context rather than the union of eight anchors' (at long context with a window, nearly
half of what an unpacked tile visits is outside each of its blocks' windows).

A sliding layer (`window` W) keeps of that only the keys within W positions of the query, z-lab's
reference rule (`dflash` 0.1.0, `_attention_mask`): the block token at position q = anchor + k sees
the context positions [q - W + 1, anchor) and the block tokens at positions j with |q - j| < W (all
B of them when B <= W). Both paths then visit only the window's keys: the cost of a block's
attention is O(W), whatever the context (docs/reference/serving-format.md, "Sliding-window layers").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_cache.core.devices import to_device
from dflash_cache.drafters.compile import compile_for_cuda

_flex_compiled = compile_for_cuda(flex_attention, dynamic=None)
_flex_broken = False  # set once if the compiled kernel fails; then the SDPA path is used

# Budget, in attention-matrix elements per head, for one SDPA call of the exact path.
SDPA_CHUNK_ELEMS = 1 << 23
TILE = 128  # flex attention's block size, for queries and keys


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
    _flex_masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # by (window, groups)
    _sdpa_plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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

    def to(self, device: torch.device | str) -> BlockLayout:
        """The layout on `device` (`to_device`: queued behind the GPU's work, never waiting for it)."""
        return BlockLayout(self.block_size, *(to_device(t, device) for t in (
            self.ctx_seq, self.ctx_pos, self.block_seq, self.block_anchor, self.offsets)))  # fmt: skip

    def flex_block_mask(self, window: int | None = None, groups: int = 1) -> BlockMask:
        """The flex BlockMask of the attention rule, queries packed by key head (the module
        docstring) against [context ; block tokens], built once per (window, groups); window None:
        full attention.

        The tiles each query tile must visit come straight from the layout (`kv_tiles`), so no
        [Q, KV] mask is ever evaluated and nothing is compiled per batch shape; `mask_mod`
        decides inside the visited tiles. Every lookup table is padded past the next multiple of
        128 with ids that match nothing, so the mask_mod stays in bounds in padded tiles too.
        """
        if (window, groups) in self._flex_masks:
            return self._flex_masks[window, groups]
        B, nc, dev = self.block_size, self.num_context, self.block_seq.device
        nq, rows = self.num_blocks * B, self.num_blocks * B * groups

        def padded(t: Tensor, fill: int) -> Tensor:
            n = t.shape[0]
            return F.pad(t, (0, -n % 128 + 128), value=fill)

        def per_row(per_token: Tensor) -> Tensor:  # token-wise [nq] -> packed rows [nq * groups]
            return per_token.view(-1, 1, B).expand(-1, groups, B).reshape(-1)

        blk = torch.arange(nq, device=dev) // B
        q_seq = padded(self.block_seq.repeat_interleave(B * groups), -2)
        q_anchor = padded(self.block_anchor.repeat_interleave(B * groups), -2)
        q_blk = padded(torch.arange(rows, device=dev) // (B * groups), -2)
        kv_seq = padded(torch.cat([self.ctx_seq, torch.full_like(blk, -1)]), -3)
        kv_pos = padded(torch.cat([self.ctx_pos, torch.zeros_like(blk)]), -3)
        kv_blk = padded(torch.cat([torch.full_like(self.ctx_seq, -1), blk]), -3)

        if window is None:

            def mask_mod(b, h, q_idx, kv_idx):
                in_context = (kv_seq[kv_idx] == q_seq[q_idx]) & (kv_pos[kv_idx] < q_anchor[q_idx])
                return in_context | (kv_blk[kv_idx] == q_blk[q_idx])

        else:
            q_pos = padded(per_row(self.query_positions()), -2)
            if window < B:  # the query's own token as a key, for the block keys' distance below
                q_key = padded(per_row(torch.arange(nc, nc + nq, device=dev)), -2)

            def mask_mod(b, h, q_idx, kv_idx):
                in_context = ((kv_seq[kv_idx] == q_seq[q_idx]) & (kv_pos[kv_idx] < q_anchor[q_idx])
                              & (kv_pos[kv_idx] > q_pos[q_idx] - window))  # fmt: skip
                own = kv_blk[kv_idx] == q_blk[q_idx]
                if window < B:  # block keys too, by their distance from the query's token
                    own = own & ((kv_idx - q_key[q_idx]).abs() < window)
                return in_context | own

        counts, indices, full_counts, full_indices = self.kv_tiles(window, groups)
        self._flex_masks[window, groups] = BlockMask.from_kv_blocks(
            counts[None, None], indices[None, None], full_counts[None, None], full_indices[None, None],
            BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(rows, nc + nq),
        )  # fmt: skip
        return self._flex_masks[window, groups]

    def kv_tiles(self, window: int | None = None, groups: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For each 128-row query tile (queries packed by `groups`, the module docstring), the
        128-key tiles it may attend to, split as flex wants them: (counts [Qt], indices [Qt, KVt])
        of the partial tiles, where mask_mod decides pair by pair, and (full_counts, full_indices)
        of the full tiles, where every pair is allowed and mask_mod never runs. The first
        `counts[t]` entries of row t are used; int32.

        A query tile holds the queries of a run of consecutive blocks, grouped by sequence. Their
        context lies between the start of the first block's sequence and the furthest
        `sequence start + anchor` among them (one contiguous range that may include some tiles
        of sequences in between: mask_mod masks those), and their own block keys sit at
        `Nc + token index`. When the tile's blocks all belong to one sequence, the context tiles
        before its smallest anchor are full: at long context that is nearly all of them, and
        skipping mask_mod there is what makes the attention kernel fast (BENCHMARKS.md).

        With a window, a tile visits only the context tiles of its blocks' windows (`_window_tiles`).
        """
        if window is not None:
            return self._window_tiles(window, groups)
        nc, nq = self.num_context, self.num_blocks * self.block_size
        n_kvt = -(-(nc + nq) // TILE)
        starts = self.offsets[self.block_seq]  # context start of each block's sequence
        ends = starts + self.block_anchor  # one past the last visible context token
        per_tile = partial(self._per_tile, groups=groups)

        lo, hi, min_end = per_tile(starts, "amin", nc), per_tile(ends, "amax", 0), per_tile(ends, "amin", nc)
        one_seq = per_tile(self.block_seq, "amin", 1 << 62) == per_tile(self.block_seq, "amax", -1)
        own_lo, own_hi = self._own_tiles(groups)
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

    def _block_tiles(self, groups: int) -> list[Tensor]:
        """Every query tile each block's rows fall in, as a list of [nb] tile ids (a block's
        `groups * B` rows may straddle tiles or span several; ids repeat for a block with fewer)."""
        rows, j = groups * self.block_size, torch.arange(self.num_blocks, device=self.block_seq.device)
        first, last = j * rows // TILE, ((j + 1) * rows - 1) // TILE
        return [torch.minimum(first + k, last) for k in range(-(-rows // TILE) + 1)]

    def _per_tile(self, values: Tensor, reduce: str, init: int, groups: int) -> Tensor:
        """[query tiles]: `reduce` of the blocks' `values` over the blocks each query tile holds."""
        n_qt = -(-self.num_blocks * self.block_size * groups // TILE)
        out = torch.full((n_qt,), init, dtype=torch.int64, device=self.block_seq.device)
        for tile in self._block_tiles(groups):
            out.scatter_reduce_(0, tile, values, reduce)
        return out

    def _own_tiles(self, groups: int) -> tuple[Tensor, Tensor]:
        """(first, last) key tile of each query tile's own block keys: the whole blocks its rows
        belong to, at nc + their token indices."""
        B, nc, nq = self.block_size, self.num_context, self.num_blocks * self.block_size
        rows = groups * B
        t = torch.arange(-(-nq * groups // TILE), device=self.block_seq.device)
        own_lo = (nc + t * TILE // rows * B) // TILE
        own_hi = (nc + torch.clamp(((t + 1) * TILE - 1) // rows * B + B, max=nq) - 1) // TILE
        return own_lo, own_hi

    def _window_tiles(self, window: int, groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`kv_tiles` of a sliding layer: each query tile visits the union of its blocks' window
        tiles (block j's context [anchor - W + 1, anchor)) and its own block keys, so the tiles a
        block costs are O(W) however far apart the tile's anchors lie. A context tile is full
        when every query of a one-sequence tile sees all of it: inside [largest anchor + B - W,
        smallest anchor), the window of the tile's last slot of its furthest block."""
        B, nc, dev = self.block_size, self.num_context, self.block_seq.device
        nq = self.num_blocks * B
        n_qt, n_kvt = -(-nq * groups // TILE), -(-(nc + nq) // TILE)
        starts = self.offsets[self.block_seq]
        ends = starts + self.block_anchor
        lows = starts + (self.block_anchor - window + 1).clamp(min=0)  # slot 0's first visible context key
        # each block's context tiles [lows // TILE, (ends - 1) // TILE], marked on its query tiles
        # through a difference array over the key tiles (a block without context marks nothing; a
        # tile marked twice by one block is still marked; no boolean indexing, which would wait
        # for the GPU)
        marks = torch.zeros(n_qt, n_kvt + 1, dtype=torch.int32, device=dev)
        some = (ends > lows).to(torch.int32)
        for tile in self._block_tiles(groups):
            marks.index_put_((tile, lows // TILE), some, accumulate=True)
            marks.index_put_((tile, (ends - 1) // TILE + 1), -some, accumulate=True)
        kv_t = torch.arange(n_kvt, device=dev)
        own_lo, own_hi = self._own_tiles(groups)
        visit = (marks.cumsum(1)[:, :n_kvt] > 0) | ((kv_t >= own_lo[:, None]) & (kv_t <= own_hi[:, None]))
        per_tile = partial(self._per_tile, groups=groups)
        one_seq = per_tile(self.block_seq, "amin", 1 << 62) == per_tile(self.block_seq, "amax", -1)
        full_start = per_tile(starts + (self.block_anchor + B - window).clamp(min=0), "amax", 0)
        full_end = per_tile(ends, "amin", nc)
        full = one_seq[:, None] & (kv_t >= -(-full_start[:, None] // TILE)) & (kv_t < full_end[:, None] // TILE)
        return (*_tile_list(visit & ~full), *_tile_list(full))

    def sdpa_plan(self, window: int | None = None) -> list[tuple[int, int, int, int, int]]:
        """(q_start, q_end, ctx_start, lo, hi) pieces for the exact path, in query order: queries
        [q_start, q_end) score the context positions [lo, hi) of the sequence whose context rows
        start at ctx_start.

        A piece is a run of consecutive blocks of one sequence; its context is that sequence's
        prefix up to the largest anchor in the run (with a window, from the smallest anchor's
        window start on). Runs are cut so that a piece's score matrix stays near SDPA_CHUNK_ELEMS
        elements per head, and, with a window, so that a piece's context stays within twice the
        window: a block's cost is then O(W) however far apart its run's anchors lie.
        """
        if window in self._sdpa_plans:
            return self._sdpa_plans[window]
        B = self.block_size
        seqs = self.block_seq.tolist()
        anchors = self.block_anchor.tolist()
        offsets = self.offsets.tolist()
        plan: list[tuple[int, int, int, int, int]] = []
        j = 0
        while j < len(seqs):
            s, start = seqs[j], j
            if start > 0 and s < seqs[start - 1]:
                raise ValueError("blocks must be grouped by sequence, in sequence order")
            run_min = run_max = anchors[start]
            while j < len(seqs) and seqs[j] == s:
                nq = (j - start + 1) * B
                a_min, a_max = min(run_min, anchors[j]), max(run_max, anchors[j])
                if window is None:
                    too_big = nq * (anchors[j] + nq) > SDPA_CHUNK_ELEMS
                else:
                    span = a_max - max(0, a_min - window + 1)
                    too_big = nq * (span + nq) > SDPA_CHUNK_ELEMS or span > 2 * window
                if j > start and too_big:
                    break
                run_min, run_max = a_min, a_max
                j += 1
            lo = 0 if window is None else max(0, run_min - window + 1)
            plan.append((start * B, j * B, offsets[s], lo, run_max))
        self._sdpa_plans[window] = plan
        return plan


def _tile_list(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of tile ids from a [rows, tiles] mask: (counts [rows] int32, indices [rows, tiles] int32,
    each row's marked tiles in order, zero past its count)."""
    counts = mask.sum(1)
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    used = torch.arange(mask.shape[1], device=mask.device) < counts[:, None]
    return counts.to(torch.int32), torch.where(used, order, 0).to(torch.int32)


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
    k: Tensor,
    v: Tensor,
    layout: BlockLayout,
    scale: float | None = None,
    impl: str | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention of block queries over [own-sequence context before the anchor ; own block].

    q [nq, Hq, D] with nq = nb*B; k, v [Nc + nq, Hkv, D]: the Nc context rows, then the block
    rows, one tensor as flex reads them (the caller's compiled projections build it, so the
    concatenation is part of their kernels, not a copy of its own). Hq a multiple of Hkv (GQA:
    query head h reads kv head h // (Hq/Hkv)). Returns [nq, Hq, D].
    impl: "flex", "sdpa", or None (flex on CUDA when it works, else sdpa). window: a sliding
    layer's W (the module docstring's rule), None for full attention.
    """
    global _flex_broken
    if q.shape[0] == 0:
        return q * 0  # keeps the graph for an empty batch
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, layout, scale, window)
    if impl is None:
        use_flex = q.is_cuda and _flex_compiled is not None and not _flex_broken
        if use_flex:
            try:
                return _flex_path(*args)
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
        return _flex_path(*args)
    if impl == "sdpa":
        return _sdpa_path(*args)
    raise ValueError(f"unknown attention impl {impl!r}")


def _flex_path(q, k, v, layout, scale, window) -> Tensor:
    """Flex attention with the queries packed by key head (the module docstring)."""
    fn = _flex_compiled if _flex_compiled is not None else flex_attention
    (nq, hq, d), hkv, B = q.shape, k.shape[1], layout.block_size
    groups = hq // hkv
    packed = q.reshape(nq // B, B, hkv, groups, d).permute(2, 0, 3, 1, 4).reshape(1, hkv, nq * groups, d)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out = fn(packed, k, v, block_mask=layout.flex_block_mask(window, groups), scale=scale)
    return out.view(hkv, nq // B, groups, B, d).permute(1, 3, 0, 2, 4).reshape(nq, hq, d)


def _sdpa_path(q, k, v, layout, scale, window) -> Tensor:
    """Exact attention without a [nq, nq] score block: each query scores its sequence's context
    prefix (a sliding layer: its window of it) and its own block's B keys, and one softmax runs
    over both. Most of a dense [context ; all blocks] mask would be masked out, so this is several
    times cheaper on CPU."""
    B, nc = layout.block_size, layout.num_context
    k_ctx, v_ctx, k_blk, v_blk = k[:nc], v[:nc], k[nc:], v[nc:]
    groups = q.shape[1] // k.shape[1]
    anchors = layout.block_anchor
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 at least
    slots = torch.arange(B, device=q.device)
    outs = []
    for q0, q1, c0, lo, hi in layout.sdpa_plan(window):
        nb, n_ctx = (q1 - q0) // B, hi - lo
        qs = q[q0:q1].view(nb, B, *q.shape[1:]).transpose(1, 2)  # [nb, Hq, B, D]
        kc = k_ctx[c0 + lo : c0 + hi].repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, T, D]
        vc = v_ctx[c0 + lo : c0 + hi].repeat_interleave(groups, dim=1).transpose(0, 1)
        kb = k_blk[q0:q1].view(nb, B, *k_blk.shape[1:]).repeat_interleave(groups, dim=2).transpose(1, 2)
        vb = v_blk[q0:q1].view(nb, B, *v_blk.shape[1:]).repeat_interleave(groups, dim=2).transpose(1, 2)
        s_ctx = torch.einsum("nhbd,htd->nhbt", qs, kc).to(acc) * scale
        pos, anchor = torch.arange(lo, hi, device=q.device), anchors[q0 // B : q1 // B, None]
        if window is None:
            visible = (pos < anchor)[:, None, None, :]  # [nb, 1, 1, T]
        else:  # slot k of the block at anchor a sees [a + k - W + 1, a)
            near = pos[None, None, :] > (anchor + slots[None, :] - window)[:, :, None]
            visible = ((pos < anchor)[:, None, :] & near)[:, None]  # [nb, 1, B, T]
        s_ctx = s_ctx.masked_fill(~visible, float("-inf"))
        s_blk = torch.einsum("nhbd,nhcd->nhbc", qs, kb).to(acc) * scale
        if window is not None and window < B:
            s_blk = s_blk.masked_fill((slots[:, None] - slots[None, :]).abs() >= window, float("-inf"))
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(v_ctx.dtype)
        o = torch.einsum("nhbt,htd->nhbd", p[..., :n_ctx], vc) + torch.einsum("nhbc,nhcd->nhbd", p[..., n_ctx:], vb)
        outs.append(o.transpose(1, 2).reshape(q1 - q0, *q.shape[1:]))
    return torch.cat(outs)
