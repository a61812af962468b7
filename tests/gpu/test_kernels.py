"""The GPU kernels compiled, each against an independent computation: the slot attention kernels
(Triton's and flash's varlen path) against the masked path, under programmatic dependent launch and
with pieces merged by the last to finish; the product kernel and its q/k/v form with RoPE against
torch's own ops, each token's bits the same in a step of any size; the loss, argmax and DSpark
Markov kernels against torch. tests/test_*_kernel.py run the same kernels interpreted on the CPU."""

from __future__ import annotations

import pytest
import torch
from test_dspark import markov_case

from dflash_cache.generate import slots as slot_module
from dflash_cache.generate.cuda_graph import Graph
from dflash_cache.generate.slots import SlotCache, SlotStep, slot_attention
from gpu.common import CUDA, GPU

pytestmark = GPU


@pytest.mark.parametrize("kernel", ["triton", "flash"])
def test_slot_attention_kernels_equal_the_masked_path(kernel, monkeypatch):
    """Each GPU kernel over the padded slot buffers (per-row key counts: the Triton kernel, flash's
    varlen path) against the masked SDPA path in float32, for decode steps, causal verify steps and
    the drafter's bidirectional block, with grouped-query heads and rows of other slots."""
    assert slot_module._KERNELS[kernel], f"{kernel} attention is not available here"
    monkeypatch.setitem(slot_module._KERNELS, "triton" if kernel == "flash" else "flash", False)
    g = torch.Generator(device=CUDA).manual_seed(0)
    S, L, heads, kv, d = 5, 96, 8, 2, 64
    for T, causal in ((1, True), (9, True), (9, False), (17, True)):
        cache = SlotCache(1, S, L, kv, d, dtype=torch.bfloat16, device=CUDA)
        cache.k[0].normal_(generator=g)
        cache.v[0].normal_(generator=g)
        seen = torch.tensor([T, 17, 40, 77, L], device=CUDA)
        positions = seen[:, None] - T + torch.arange(T, device=CUDA)
        q = torch.randn(S, T, heads, d, device=CUDA, generator=g, dtype=torch.bfloat16)
        k = torch.randn(S, T, kv, d, device=CUDA, generator=g, dtype=torch.bfloat16)
        v = torch.randn(S, T, kv, d, device=CUDA, generator=g, dtype=torch.bfloat16)
        for rows in (None, torch.tensor([4, 0, 2], device=CUDA)):
            picked = slice(None) if rows is None else rows
            step = SlotStep(positions[picked], seen=seen[picked], rows=rows, causal=causal)
            got = slot_attention(cache, 0, q[picked], k[picked], v[picked], step, d**-0.5).float()
            ref_cache = SlotCache(1, S, L, kv, d, dtype=torch.float32, device=CUDA)
            ref_cache.k[0].copy_(cache.k[0])
            ref_cache.v[0].copy_(cache.v[0])
            want = slot_module._masked(q[picked].float(), ref_cache.k[0][picked], ref_cache.v[0][picked], step,
                                       d**-0.5)  # fmt: skip
            err = float((got - want).norm() / want.norm())
            assert err < 1e-2, (kernel, T, causal, rows, err)
    assert slot_module._KERNELS[kernel], "the kernel's own first-call check turned it off"


@pytest.mark.parametrize("pieces", [1, 3])
def test_slot_kernel_under_pdl_reads_what_the_kernel_before_it_wrote(pieces):
    """With programmatic dependent launch (the slot kernels' own, on a Hopper GPU), the slot kernel
    may start while the compiled kernel that makes its query still runs. Replayed as one graph (the
    engine's), with a new query each time, it gives the bits of the same two kernels without PDL,
    over a buffer walked whole and one cut into pieces (merged by the last piece to finish)."""
    from dflash_cache.kernels import slot_attention as slot_kernel
    from dflash_cache.kernels.tiles import DEFAULT_ATTENTION_TILES, AttentionTiles
    from dflash_cache.kernels.triton_support import pdl_options

    g = torch.Generator(device=CUDA).manual_seed(0)
    length = pieces * DEFAULT_ATTENTION_TILES.split
    keys, values = (torch.randn(1, length, 2, 64, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in "kv")
    queries = torch.randn(4, 1, 9, 8, 64, device=CUDA, generator=g, dtype=torch.bfloat16)
    slot, seen = torch.zeros(1, dtype=torch.int32, device=CUDA), torch.full((1,), length, device=CUDA).int()
    assert slot_kernel.pieces(length) == pieces
    assert pdl_options(keys)["PDL"], "this GPU launches without PDL"
    outs = {}
    for pdl in (False, True):
        tiles = AttentionTiles(pdl=pdl)
        torch._dynamo.reset()  # the second compile of the same function, with other options
        make_query = torch.compile(lambda x: x * 1.5 + 0.25, options={"triton.enable_pdl": pdl})
        graph = Graph(lambda x, f=make_query, t=tiles: (slot_kernel.attention(f(x), keys, values, slot, seen, True,
                                                                              0.125, t),))  # fmt: skip
        outs[pdl] = torch.stack([graph(q.clone())[0].clone() for q in queries])  # the graph keeps the first q
        assert graph.graph is not None and not graph.broken, "captured and replayed, not run eagerly"
    assert torch.equal(outs[True], outs[False])
    assert not torch.equal(outs[True][0], outs[True][1])


def bf16_randn(seed: int):
    """randn(*shape, scale=1.0): seeded normal bf16 tensors on the GPU, scaled."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return lambda *shape, scale=1.0: (torch.randn(*shape, device=CUDA, generator=g) * scale).to(torch.bfloat16)


def test_product_kernel_equals_torchs_ops_and_keeps_each_tokens_bits():
    """The product kernel compiled, on SmolLM2's layer shapes (K 576 and 1536; N 960, 576, 3072 as
    [gate; up]): each kind against torch's own bf16 ops of the same operands, to their summation
    order; each token's bits the same in steps of 1, 8 and 17 tokens; and a chain of products that
    reads what the one before wrote, replayed as one graph with programmatic dependent launch (each
    kernel loads its weights before it waits for its input), bit for bit as launched plainly."""
    import torch.nn.functional as F

    from dflash_cache.generate.layer_products import TENSOR_OPS, KernelProducts
    from dflash_cache.kernels.tiles import ProductTiles
    from dflash_cache.kernels.triton_support import pdl_options

    randn = bf16_randn(0)
    H, inter = 576, 1536
    w = {"qkv": randn(960, H, scale=H**-0.5), "gate_up": randn(2 * inter, H, scale=H**-0.5),
         "o": randn(H, H, scale=H**-0.5), "down": randn(H, inter, scale=inter**-0.5)}  # fmt: skip
    norm, bias = 1 + randn(H, scale=0.2), randn(960, scale=0.1)
    x, res, act = randn(17, H), randn(17, H), randn(17, inter)
    kinds = {
        "normed": lambda how, r: how.normed(x[r], norm, 1e-5, w["qkv"], bias),
        "gated": lambda how, r: how.gated(x[r], norm, 1e-5, w["gate_up"], None, F.silu),
        "residual o": lambda how, r: how.residual(res[r], x[r], w["o"], None),
        "residual down": lambda how, r: how.residual(res[r], act[r], w["down"], None),
    }
    for kind, run in kinds.items():
        got, want = run(KernelProducts(), slice(None)).float(), run(TENSOR_OPS, slice(None)).float()
        assert float((got - want).norm() / want.norm()) < 5e-3, kind
        for part in [slice(i, i + 1) for i in range(17)] + [slice(2, 10), slice(9, 17)]:
            assert torch.equal(run(KernelProducts(), part).float(), got[part]), (kind, part)

    kernel = KernelProducts()

    def chain(h, products=kernel):
        for _ in range(3):
            a = products.gated(h, norm, 1e-5, w["gate_up"], None, F.silu)
            h = products.residual(h, a, w["down"], None)
            q = products.normed(h, norm, 1e-5, w["qkv"], bias)
            h = products.residual(h, q[:, :H], w["o"], None)
        return (h,)

    assert pdl_options(x)["PDL"], "this GPU launches without PDL"
    inputs = [randn(1, H) for _ in range(3)]
    graph = Graph(chain)
    replayed = [graph(h.clone())[0].clone() for h in inputs]
    assert graph.graph is not None and not graph.broken, "captured and replayed, not run eagerly"
    plain = KernelProducts(ProductTiles(pdl=False))
    for h, got in zip(inputs, replayed, strict=True):
        assert torch.equal(got, chain(h, plain)[0])
    assert not torch.equal(replayed[0], replayed[1])


def test_qkv_product_with_rope_equals_torchs_ops_and_keeps_each_tokens_bits():
    """The q/k/v product kernel with RoPE and the cache writes in its epilogue, compiled, on
    SmolLM2's attention shape (9 heads, 3 kv heads of 64, hidden 576), two rows in slots 2 and 0
    at positions past 1000: its queries, keys and values against torch's own bf16 ops; each token's
    the same bits when it is stepped alone."""
    from dflash_cache.generate.layer_products import TENSOR_OPS, KernelProducts

    randn = bf16_randn(0)
    heads, kv_heads, d, H, T = 9, 3, 64, 576, 9

    w, bias, norm = randn((heads + 2 * kv_heads) * d, H, scale=H**-0.5), None, 1 + randn(H, scale=0.2)
    x = randn(2, T, H)
    positions = torch.tensor([[1000], [40]], device=CUDA) + torch.arange(T, device=CUDA)
    angles = positions[..., None] * 10000 ** (-torch.arange(0, d, 2, device=CUDA) / d)
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    slot = torch.tensor([[2], [0]], device=CUDA)

    def run(how, t=slice(None)):
        caches = [torch.zeros(3, 1040, kv_heads, d, device=CUDA, dtype=torch.bfloat16) for _ in "kv"]
        q, _, _ = how.qkv(x[:, t], norm, 1e-5, w, bias, None, None, cos[:, t], sin[:, t],
                          (*caches, slot, positions[:, t]), heads, kv_heads)  # fmt: skip
        return q, caches

    q, caches = run(KernelProducts())
    want_q, want_caches = run(TENSOR_OPS)
    for got, want in ((q, want_q), *zip(caches, want_caches, strict=True)):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-3
    for t in range(T):
        q1, caches1 = run(KernelProducts(), slice(t, t + 1))
        assert torch.equal(q1[:, 0], q[:, t])
        for row in range(2):
            at = (slot[row, 0], positions[row, t])
            assert all(torch.equal(a[at], b[at]) for a, b in zip(caches1, caches, strict=True))


@pytest.mark.parametrize("with_target", [True, False])
def test_loss_kernel_equals_the_reference_chunk(with_target):
    """The loss's Triton kernel, compiled, against `losses._tv_chunk` eager over a vocabulary of
    SmolLM2's size (tests/test_loss_kernel.py runs it interpreted on small ones)."""
    from dflash_cache.drafters.losses import _tv_chunk
    from dflash_cache.kernels import loss as loss_kernel

    g = torch.Generator(device=CUDA).manual_seed(0)
    n, v = 64, 49152
    logits = (torch.randn(n, v, generator=g, device=CUDA) * 3).bfloat16()
    target = (logits.float() + torch.randn(n, v, generator=g, device=CUDA)).bfloat16() if with_target else None
    labels = torch.randint(0, v, (n,), generator=g, device=CUDA)
    labels[:8] = logits[:8].float().argmax(-1)
    a, b = torch.rand(n, generator=g, device=CUDA), torch.rand(n, generator=g, device=CUDA)
    want = _tv_chunk(logits, target, labels, a, b)  # float32 expressions, eager
    assert loss_kernel.fits(logits)
    ce, l1, hits, accept, grad = loss_kernel.tv_chunk(logits.clone(), target, labels, a, b)
    for x, y in zip((ce, l1, accept), (want[0], want[1], want[3]), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert torch.equal(hits, want[2]) and hits[:8].all()
    torch.testing.assert_close(grad.float(), want[4], rtol=2**-7, atol=1e-7)  # the kernel's is bf16


def test_argmax_kernel_compiled_is_torchs_argmax():
    """The greedy argmax kernels compiled, on SmolLM2's vocabulary: torch's index, the first of
    equal maxima across the programs' blocks, for the rows of a verify step."""
    from dflash_cache.kernels import argmax as argmax_kernel

    logits = bf16_randn(0)(3, 8, 49152)
    logits[0, 0, [40000, 5000, 5001]] = 20.0
    logits[1, 2] = 0.5
    want = logits.argmax(-1)
    assert want[0, 0] == 5000 and want[1, 2] == 0
    assert torch.equal(argmax_kernel.argmax(logits), want)
    assert torch.equal(argmax_kernel.argmax(logits.float()), want)


@pytest.mark.parametrize("T", [1, 8])
def test_slot_kernel_pieces_merged_by_the_last_to_finish_are_the_attention(T):
    """The last piece of a row to finish merges the row's pieces (an atomic count a tile): over 64
    rows that see 1 to 4 pieces, the masked path's attention, the same bits 20 times over whichever
    program finishes last, and every count back at zero after."""
    from dflash_cache.kernels import slot_attention as slot_kernel
    from dflash_cache.kernels import triton_support
    from dflash_cache.kernels.tiles import DEFAULT_ATTENTION_TILES

    randn = bf16_randn(1)
    length = 4 * DEFAULT_ATTENTION_TILES.split
    keys, values = randn(64, length, 3, 64), randn(64, length, 3, 64)
    query = randn(64, T, 9, 64)
    rows = torch.arange(64, device=CUDA).flip(0)
    seen = torch.randint(T, length + 1, (64,), device=CUDA, generator=torch.Generator(CUDA).manual_seed(2))
    got = slot_kernel.attention(query, keys, values, rows.int(), seen.int(), True, 0.125)
    positions = seen[:, None] - T + torch.arange(T, device=CUDA)
    step = SlotStep(positions, seen=seen, rows=rows, causal=True)
    want = slot_module._masked(query.float(), *(t.float() for t in slot_module._rows_of(keys, values, step)), step,
                               0.125)  # fmt: skip
    assert float((got.float() - want).norm() / want.norm()) < 1e-2
    for _ in range(20):
        assert torch.equal(slot_kernel.attention(query, keys, values, rows.int(), seen.int(), True, 0.125), got)
    assert not triton_support._COUNTS["slot_kernel", keys.device].any()


@pytest.mark.parametrize("lookup", [False, True], ids=["latents", "table rows"])
def test_markov_kernel_gives_torchs_argmax_of_the_same_logits_compiled(lookup):
    """DSpark's fused Markov step compiled (tests/test_dspark.py's `markov_case`): the first of
    equal maxima, within a program and across programs, as torch's argmax picks it."""
    got, want = markov_case(CUDA, lookup)
    assert torch.equal(got, want)
