"""The slot target's own decoder forward (generate/decoder.py) against transformers' forward of the
same model: logits at every prefilled and stepped position, and the tapped layers against
`output_hidden_states`, for each model type it serves (Llama with and without biases, Qwen2's q/k/v
biases, Qwen3's q/k norms, Mistral). Its fused projections are views of the model's own weights:
the model's forward is unchanged by them, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_cache.generate.slots import SlotStep
from dflash_cache.generate.targets import SlotTarget

BASE = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 6,
        "num_key_value_heads": 2, "vocab_size": 211, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False}  # fmt: skip
MODELS = {
    "llama": {"model_type": "llama"},
    "llama-biases": {"model_type": "llama", "attention_bias": True, "mlp_bias": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "mistral": {"model_type": "mistral", "sliding_window": None},
}
LAYERS = [0, 2, 1]  # in any order; not the last layer, whose output_hidden_states entry is after the final norm


def model_of(name: str, seed: int = 0):
    config = AutoConfig.for_model(**{**BASE, **MODELS[name]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    for p in model.parameters():  # biases and norms away from their initial zeros and ones
        p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_slot_forward_is_the_models_forward(name):
    model = model_of(name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BASE["vocab_size"], (2, 19), generator=g)
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True)
    target = SlotTarget(model, slots=3, length=64, layer_ids=LAYERS)
    with torch.inference_mode():
        again = model(ids).logits
    torch.testing.assert_close(again, ref.logits, rtol=0, atol=0)  # the fused weights are the model's own

    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv = attn._dflash_qkv[0]
    assert attn.k_proj.weight.data_ptr() == qkv.data_ptr() + attn.q_proj.weight.numel() * qkv.element_size()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp._dflash_gate_up[0].untyped_storage().data_ptr()

    # rows 2 and 0 take 11 and 7 prompt tokens, then steps of 3, 1 and 4 tokens each
    cut = {2: 11, 0: 7}
    logits, states = target.prefill([2, 0], [tuple(ids[0, :11].tolist()), tuple(ids[1, :7].tolist())])
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(logits, torch.stack([ref.logits[0, 10], ref.logits[1, 6]]), **tol)
    taps = torch.cat([ref.hidden_states[lid + 1] for lid in LAYERS], -1)
    torch.testing.assert_close(states[0, :11], taps[0, :11], **tol)
    torch.testing.assert_close(states[1, :7], taps[1, :7], **tol)
    for width in (3, 1, 4):
        positions = torch.zeros(3, width, dtype=torch.long)
        step_ids = torch.zeros(3, width, dtype=torch.long)
        for row, src in ((2, 0), (0, 1)):
            positions[row] = torch.arange(cut[row], cut[row] + width)
            step_ids[row] = ids[src, cut[row] : cut[row] + width]
        logits, states = target.step(step_ids, positions)
        for row, src in ((2, 0), (0, 1)):
            span = slice(cut[row], cut[row] + width)
            torch.testing.assert_close(logits[row], ref.logits[src, span], **tol)
            torch.testing.assert_close(states[row], taps[src, span], **tol)
            cut[row] += width


def test_a_compiler_failure_falls_back_to_the_eager_layers_with_a_warning():
    """Where torch.compile fails (injected here: compiled pieces that raise, for a prefill's shapes
    and a step's), the prefill and the step run the eager layers, each kind says so once, and they
    give the same logits as a target that never compiled."""
    model = model_of("qwen3")
    plain, broken = SlotTarget(model, 1, 32), SlotTarget(model, 1, 32)

    def fails(*args, **kwargs):
        raise RuntimeError("the compiler says no")

    layers = broken.decoder.layers
    layers.compiled = {kind: dict.fromkeys(layers.eager, fails) for kind in ("fixed", "dynamic")}
    want, _ = plain.prefill([0], [tuple(range(5, 12))])
    with pytest.warns(UserWarning, match=r"decoder layers \(dynamic shapes\) failed") as seen:
        first, _ = broken.prefill([0], [tuple(range(5, 12))])
    assert len(seen) == 1 and layers.compiled["dynamic"] is layers.eager
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    ids, positions = torch.tensor([[3, 4]]), torch.tensor([[7, 8]])
    with pytest.warns(UserWarning, match=r"decoder layers \(fixed shapes\) failed") as seen:
        logits, _ = broken.step(ids, positions)
        again, _ = broken.step(ids, positions)
    assert len(seen) == 1 and layers.compiled["fixed"] is layers.eager
    want, _ = plain.step(ids, positions)
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_a_step_of_fewer_rows_than_slots_reads_only_its_own():
    """A step of one row in a cache of three slots (batch row i is slot i) gives the logits of the
    same row in a cache of one slot: the other slots' keys are not read."""
    model = model_of("llama")
    prompt = tuple(range(5, 17))
    ids, positions = torch.tensor([[7, 8, 9]]), torch.arange(12, 15)[None]
    got = []
    for slots in (3, 1):
        target = SlotTarget(model, slots=slots, length=64)
        if slots == 3:  # other rows' keys in the slots beside
            target.prefill([1, 2], [tuple(range(40, 60)), tuple(range(60, 90))])
        target.prefill([0], [prompt])
        got.append(target.step(ids, positions)[0])
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


def test_a_half_precision_step_the_kernel_does_not_serve_pads_its_tokens():
    """A bf16 target whose widths the product kernel does not take (here: no kernel on the CPU)
    runs a few-row step as `PaddedProducts`, each row's tokens padded to `KernelSettings.padded_tokens`:
    its logits and tapped states are the tensor ops' unpadded ones, and a verify step's are the
    one-token steps' bit for bit (the property the padding exists for on a GPU, where
    tests/gpu/test_decode.py checks it on Qwen3-8B's widths)."""
    from dflash_cache.generate import layer_products
    from dflash_cache.kernels.settings import KernelSettings

    model = model_of("qwen3").bfloat16()
    prompt, ids, positions = tuple(range(5, 17)), torch.tensor([[7, 8, 9, 10, 11]]), torch.arange(12, 17)[None]

    def run(width: int = 5, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = KernelSettings() if padded else KernelSettings(padded_tokens=0)  # unpadded: the tensor ops
        target = SlotTarget(model, 1, 64, LAYERS, kernels=kernels)
        target.prefill([0], [prompt])
        steps = [target.step(ids[:, k : k + width], positions[:, k : k + width]) for k in range(0, 5, width)]
        return torch.cat([s[0] for s in steps], 1), torch.cat([s[1] for s in steps], 1)

    step = SlotStep(positions, seen=positions[:, -1] + 1)
    assert type(SlotTarget(model, 1, 64).decoder.layers._products(step, "fixed")) is layer_products.PaddedProducts
    assert SlotTarget(model, 1, 64, kernels=KernelSettings(padded_tokens=0)).decoder.layers._products(
        step, "fixed") is layer_products.TENSOR_OPS
    block = run()
    for got, want in zip(block, run(padded=False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(block, run(width=1), strict=True):
        assert torch.equal(got, want)
