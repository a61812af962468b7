"""Sliding-window draft layers on the GPU, against the exact paths that tests/test_window.py checks
against the rule on the CPU: flex attention compiled (whose tiles skip what lies outside a window)
against the exact SDPA path, forward and backward; the Triton slot kernel with a window, in one
piece and cut, against the masked path; and BlockProposer (compiled layers, the kernel, bf16)
against the training forward (flex, float32) at anchors far past the window, for both families."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_same_grads
from test_window import (
    DSparkConfig,
    DSparkDrafter,
    F,
    Recorder,
    S,
    packed_layout,
    random_drafter,
    same_weights,
    windowed,
)

from dflash_cache import drafters
from dflash_cache.drafters import attention
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.generate import slots as slot_module
from dflash_cache.generate.slots import SlotCache, SlotStep, slot_attention
from gpu.common import CUDA, GPU

pytestmark = GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [8, 100, 700])
def test_flex_window_equals_the_exact_path(dtype, window):
    """Compiled flex attention with a sliding layer's BlockMask (its mask_mod inside the visited
    tiles, the full tiles whole) against the exact SDPA path, forward and gradients, over long
    sequences with scattered anchors, blocks of 16 (window 8: block keys masked too) and GQA; the
    window visits fewer tiles than full attention."""
    assert attention._flex_compiled is not None
    layout = packed_layout([3000, 17, 1000, 64], per_seq=40, seed=0, block_size=16).to(CUDA)
    nq, nc, hq, hkv, d = layout.num_blocks * 16, layout.num_context, 8, 2, 64
    g = torch.Generator(device=CUDA).manual_seed(0)
    shapes = [(nq, hq, d), (nc + nq, hkv, d), (nc + nq, hkv, d)]  # q; keys, values of [context ; blocks]
    tensors = [torch.randn(*s, device=CUDA, generator=g, dtype=dtype, requires_grad=True) for s in shapes]
    probe = torch.randn(nq, hq, d, device=CUDA, generator=g, dtype=dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    results = []
    for impl in ("flex", "sdpa"):
        out = attention.block_attention(*tensors, layout, impl=impl, window=window)
        results.append((out, torch.autograd.grad((out * probe).sum(), tensors)))
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    assert_same_grads(results[0][1], results[1][1], tol)
    windowed_tiles = sum(int(t.sum()) for t in layout.kv_tiles(window)[::2])
    assert windowed_tiles < sum(int(t.sum()) for t in layout.kv_tiles()[::2])


@pytest.mark.parametrize("length", [192, 1024])  # one piece (split 256), four
def test_slot_kernel_window_equals_the_masked_path(length):
    """The Triton kernel with a window (its programs counted from the row's lowest visible key's
    piece) against the masked path in float32: decode steps, causal verify steps and the drafter's
    bidirectional block, windows above and below the step's size, rows of other slots."""
    assert slot_module._KERNELS["triton"], "Triton attention is not available here"
    g = torch.Generator(device=CUDA).manual_seed(1)
    S_, heads, kv, d = 5, 8, 2, 64
    cache = SlotCache(1, S_, length, kv, d, dtype=torch.bfloat16, device=CUDA)
    cache.k[0].normal_(generator=g)
    cache.v[0].normal_(generator=g)
    ref_k, ref_v = cache.k[0].float(), cache.v[0].float()
    for T, causal in ((1, True), (9, True), (16, False)):
        seen = torch.tensor([T, 40, 190, length // 2 + 7, length], device=CUDA)
        positions = seen[:, None] - T + torch.arange(T, device=CUDA)
        slot = torch.arange(S_, device=CUDA)[:, None]
        k, v = cache.k[0][slot, positions], cache.v[0][slot, positions]  # the step's own, rewritten as they are
        q = torch.randn(S_, T, heads, d, device=CUDA, generator=g, dtype=torch.bfloat16)
        for window in (5, 70, 300):
            for rows in (None, torch.tensor([4, 0, 2], device=CUDA)):
                picked = slice(None) if rows is None else rows
                step = SlotStep(positions[picked], seen=seen[picked], rows=rows, causal=causal)
                got = slot_attention(cache, 0, q[picked], k[picked], v[picked], step, d**-0.5, window=window).float()
                want = slot_module._masked(q[picked].float(), ref_k[picked], ref_v[picked], step, d**-0.5, window)
                err = float((got - want).norm() / want.norm())
                assert err < 1e-2, (T, causal, window, rows, err)
    assert slot_module._KERNELS["triton"], "the kernel's own first-call check turned it off"


@pytest.mark.parametrize("name,types", [("dflash", [S, F]), ("dspark", [S, S])])
def test_block_proposer_serves_what_was_trained_on_the_gpu(name, types):
    """BlockProposer on the GPU (compiled layers, the slot kernel over a buffer cut in pieces, bf16)
    gives the logits of the training forward (flex attention compiled, float32) at anchors far past
    the window; full attention would give others."""
    from dflash_cache.generate import BlockProposer

    geometry = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "intermediate_size": 192, "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "max_position_embeddings": 4096, "num_hidden_layers": 6}  # fmt: skip
    family = drafters.family(name)
    cfg = windowed(DSparkConfig if name == "dspark" else DrafterConfig, 100, types, geometry=geometry, block_size=8)
    model = random_drafter(cfg, DSparkDrafter if name == "dspark" else DFlashDrafter).to(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(3)
    embed = torch.randn(256, 128, device=CUDA, generator=g)
    head = torch.randn(256, 128, device=CUDA, generator=g) / 8
    ctx = torch.randn(900, cfg.fc_inputs, device=CUDA, generator=g)
    anchors, last = [870, 333], torch.tensor([17, 4], device=CUDA)

    def served(model) -> torch.Tensor:
        model = model.bfloat16()
        proposer = BlockProposer(model, embed=embed.bfloat16(), head=head.bfloat16(), slots=2, length=1024,
                                 family=family)  # fmt: skip
        for row, a in enumerate(anchors):
            proposer.add_context(ctx[None, :a], torch.arange(a, device=CUDA)[None], torch.tensor([row], device=CUDA))
        recorder = Recorder()
        proposer.propose(last, torch.tensor(anchors, device=CUDA), recorder)
        return recorder.all().float()

    want = []
    for a, t in zip(anchors, last.tolist(), strict=True):
        block = family.block_input(torch.tensor([t], device=CUDA), cfg.block_size, cfg.mask_token_id)
        layout = attention.BlockLayout.build(torch.tensor([0, a], device=CUDA), torch.zeros(1, dtype=torch.long,
                                             device=CUDA), torch.tensor([a], device=CUDA), cfg.block_size)  # fmt: skip
        recorder = Recorder()
        with torch.no_grad():
            hidden = model(embed[block[0]], ctx[:a], layout)
            family.draft(model, hidden[None], block, head, recorder)
        want.append(recorder.all()[0])
    want = torch.stack(want)
    full = same_weights(model, dataclasses.replace(cfg, sliding_window=None, layer_types=None)).to(CUDA)
    got = served(model)
    err = float((got - want).norm() / want.norm())
    assert err < 3e-2, err
    assert float((served(full) - want).norm() / want.norm()) > 5 * err
