"""The slot attention kernels (kernels/slot_attention.py), run on the CPU by Triton's interpreter,
against the masked attention path and against themselves in other steps: a query's output must be
the same bits in a decode step, a verify step, and a buffer cut in pieces or not. The GPU suite
checks the same compiled, through the whole step (tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.generate.slots import SlotStep, _masked, _rows_of
from dflash_cache.kernels import slot_attention as slot_kernel
from dflash_cache.kernels import triton_support
from dflash_cache.kernels.tiles import AttentionTiles

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # conftest: the kernels on the CPU


@pytest.mark.parametrize("split", [0, 64])
def test_slot_kernel_equals_the_masked_path(split):
    """Decode steps, causal verify steps and the drafter's bidirectional block, rows of other slots
    and grouped-query heads, in one piece and cut at every 64 keys (merged by the last piece of a
    row to finish): the masked SDPA path in float32."""
    tiles = AttentionTiles(split=split or 10**9, block_n=64)
    g = torch.Generator().manual_seed(0)
    S, L, heads, kv, d = 3, 200, 6, 2, 32
    k_buf, v_buf = (torch.randn(S, L, kv, d, generator=g).bfloat16() for _ in range(2))
    for T, seen, causal in ((1, [30, 150, 200], True), (5, [30, 150, 200], True), (8, [60, 150, 130], False)):
        rows = torch.tensor([2, 0, 1])
        query = torch.randn(3, T, heads, d, generator=g).bfloat16()
        got = slot_kernel.attention(query, k_buf, v_buf, rows.int(), torch.tensor(seen).int(), causal, d**-0.5, tiles)
        positions = torch.tensor(seen)[:, None] - T + torch.arange(T)
        step = SlotStep(positions, seen=torch.tensor(seen), rows=rows, causal=causal)
        want = _masked(query.float(), *(t.float() for t in _rows_of(k_buf, v_buf, step)), step, d**-0.5)
        assert float((got.float() - want).norm() / want.norm()) < 1e-2


def test_slot_kernel_gives_a_query_the_same_bits_in_any_step():
    """A query's output does not depend on the step around it: a verify step's 5 queries against 5
    decode steps, over a buffer cut in pieces of 64 keys, where the decode steps' rows reach one
    piece or several (the last piece to finish leaves its counter at zero for the next step); and a
    query that sees one piece gets the same bits whether the buffer is cut or not."""
    g = torch.Generator().manual_seed(3)
    heads, kv, d = 6, 2, 32
    k_buf, v_buf = (torch.randn(1, 200, kv, d, generator=g).bfloat16() for _ in range(2))
    slot = torch.tensor([0], dtype=torch.int32)
    cut_at_64 = AttentionTiles(split=64, block_n=64)

    def attend(query, seen, tiles=cut_at_64):
        seen = torch.tensor([seen], dtype=torch.int32)
        return slot_kernel.attention(query, k_buf, v_buf, slot, seen, True, 0.2, tiles)

    query = torch.randn(1, 5, heads, d, generator=g).bfloat16()
    for seen in (150, 67):  # at 67 the first two queries see one piece alone, the verify step's row two
        block = attend(query, seen)
        for t in range(5):
            assert torch.equal(attend(query[:, t : t + 1].contiguous(), seen - 4 + t)[:, 0], block[:, t])
        assert not triton_support._COUNTS["slot_kernel", block.device].any()
    one = query[:, :1].contiguous()
    cut = attend(one, 50)
    assert torch.equal(attend(one, 50, AttentionTiles(split=10**9, block_n=64)), cut)


def window_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: list[int],
                     seen: list[int], causal: bool, window: int, scale: float) -> torch.Tensor:  # fmt: skip
    """Sliding-window attention written out query by query, in float64: query t of row i, at position
    seen[i] - T + t, against the keys at positions j < its limit with |position - j| < window."""
    b, T, heads, d = query.shape
    groups = heads // keys.shape[2]
    out = torch.zeros(b, T, heads, d, dtype=torch.float64)
    for i in range(b):
        for t in range(T):
            at = seen[i] - T + t
            j = torch.tensor([j for j in range(at + 1 if causal else seen[i]) if abs(at - j) < window])
            k = keys[rows[i], j].double().repeat_interleave(groups, 1)  # [n, heads, d]
            v = values[rows[i], j].double().repeat_interleave(groups, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", query[i, t].double(), k) * scale, dim=-1)
            out[i, t] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.parametrize("split", [0, 64])
def test_slot_kernel_window_equals_the_rule(split):
    """A sliding layer's window (z-lab's rule: keys within W positions of the query's own) over rows
    longer than W: the drafter's bidirectional block with W above and below the block's size, a
    causal verify step and a decode step, in one piece and cut at every 64 keys; the kernel and the
    masked path (the window's keys gathered) against the rule written out query by query."""
    tiles = AttentionTiles(split=split or 10**9, block_n=64)
    g = torch.Generator().manual_seed(5)
    S, L, heads, kv, d = 3, 256, 4, 2, 16
    k_buf, v_buf = (torch.randn(S, L, kv, d, generator=g).bfloat16() for _ in range(2))
    rows = [2, 0, 1]
    for T, seen, causal, window in ((8, [200, 40, 256], False, 70), (8, [200, 9, 130], False, 3),
                                    (5, [150, 30, 256], True, 100), (1, [150, 256, 64], True, 65)):  # fmt: skip
        query = torch.randn(3, T, heads, d, generator=g).bfloat16()
        want = window_reference(query, k_buf, v_buf, rows, seen, causal, window, d**-0.5)
        got = slot_kernel.attention(query, k_buf, v_buf, torch.tensor(rows).int(), torch.tensor(seen).int(), causal,
                                    d**-0.5, tiles, window)  # fmt: skip
        assert float((got.double() - want).norm() / want.norm()) < 1e-2
        step = SlotStep(torch.tensor(seen)[:, None] - T + torch.arange(T), seen=torch.tensor(seen),
                        rows=torch.tensor(rows), causal=causal)  # fmt: skip
        masked = _masked(query.double(), *(t.double() for t in _rows_of(k_buf, v_buf, step)), step, d**-0.5, window)
        torch.testing.assert_close(masked, want, rtol=1e-9, atol=1e-9)
        full = _masked(query.double(), *(t.double() for t in _rows_of(k_buf, v_buf, step)), step, d**-0.5)
        assert float((full - want).norm() / want.norm()) > 1e-2  # the window changes these rows' outputs
