"""The slot engine and its decoder on the GPU: CUDA graphs of the decode and speculative steps
against eager steps and transformers' own decoding, the compiled decoder against the eager one, a
prefill's compilation and attention, and the property greedy speculation rests on: a verify step
gives each token the bits of a one-token step, so speculative replies are the target alone's."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_TARGET, hf_greedy
from test_evaluate import export_random_drafter
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_cache.generate import BlockProposer, Engine, LookupMix, Request, StopRule
from dflash_cache.generate.slots import SlotStep
from dflash_cache.generate.targets import SlotTarget
from dflash_cache.target.load import stop_token_ids
from gpu.common import CUDA, GPU, decode

pytestmark = GPU


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
    from dflash_cache.bench.shapes import shape_config

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
    (its keys cut in pieces of `AttentionTiles.split`, the verify step's queries on both sides of the
    cut at 1024); Qwen3-8B's widths (two layers), too wide for the kernel, through cuBLAS and
    inductor's norms with each row's tokens padded (`layer_products.PaddedProducts`)."""
    from dflash_cache.generate import layer_products
    from dflash_cache.kernels.tiles import DEFAULT_ATTENTION_TILES

    split = DEFAULT_ATTENTION_TILES.split
    assert 1024 % split == 0 and split >= 256
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
    kind = layer_products.KernelProducts if shape == "smollm2-135m" else layer_products.PaddedProducts
    assert type(layers._products(SlotStep(positions, seen=positions[:, -1] + 1), "fixed")) is kind
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
