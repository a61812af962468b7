"""The product kernel (kernels/products.py), run on the CPU by Triton's interpreter: each kind
of product against the tensor ops it replaces (`layer_products.Products`, in float64), each token's bits
the same in a step of any size, and a whole decoder step through the kernels: its logits against
the step through the tensor ops, and a verify step's logits against one-token steps', bit for bit.
The GPU suite runs the same compiled (tests/gpu/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_cache.generate.layer_products import TENSOR_OPS, KernelProducts, Products
from dflash_cache.generate.slots import SlotStep
from dflash_cache.generate.targets import SlotTarget
from dflash_cache.kernels.settings import KernelSettings

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # conftest: the kernels on the CPU

K, N = 80, 40  # neither a power of two nor a multiple of the kernel's 16 columns


def operands(rows: int, bias: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, K, generator=g).bfloat16(),
            "w": (torch.randn(2 * N, K, generator=g) * K**-0.5).bfloat16(),
            "bias": torch.randn(2 * N, generator=g).bfloat16() if bias else None,
            "norm": (1 + 0.2 * torch.randn(K, generator=g)).bfloat16(),
            "res": torch.randn(rows, 2 * N, generator=g).bfloat16()}  # fmt: skip


def run(how: Products, kind: str, o: dict) -> torch.Tensor:
    if kind == "normed":
        return how.normed(o["x"], o["norm"], 1e-5, o["w"], o["bias"])
    if kind == "gated":
        return how.gated(o["x"], o["norm"], 1e-5, o["w"], o["bias"], F.silu)
    return how.residual(o["res"], o["x"], o["w"], o["bias"])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["normed", "gated", "residual"])
def test_each_product_equals_its_tensor_ops(kind, bias):
    """17 rows (a tile of 16 and one more) of each kind, with and without a bias, against the same
    tensor ops in float64 on the same half-precision operands. The bound is bfloat16's rounding of
    the kernel's intermediates as the interpreter does it: toward zero, where a GPU rounds to nearest
    (tests/gpu/test_kernels.py holds the compiled kernel to torch's own half-precision ops)."""
    o = operands(17, bias)
    got = run(KernelProducts(), kind, o)
    want = run(TENSOR_OPS, kind, {k: v.double() if v is not None else None for k, v in o.items()})
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert float((got.double() - want).norm() / want.norm()) < 3e-2


@pytest.mark.parametrize("kind", ["normed", "gated", "residual"])
def test_a_token_gets_the_same_bits_in_a_step_of_any_size(kind):
    """Each of 17 rows alone, and rows 3-10 as a step of 8 (each at another place in its tile), give
    the bits the 17-row step gives them."""
    o = operands(17, bias=True)
    whole = run(KernelProducts(), kind, o)
    for rows in [slice(i, i + 1) for i in range(17)] + [slice(3, 11)]:
        part = {k: v[rows] if v is not None and v.shape[0] == 17 else v for k, v in o.items()}
        assert torch.equal(run(KernelProducts(), kind, part), whole[rows]), (kind, rows)


def test_the_qkv_product_rotates_its_keys_and_writes_them_into_the_cache():
    """The q/k/v product with RoPE in its epilogue (`KernelProducts.qkv` without q/k norms), two rows
    in slots 2 and 0 of a cache of three, 3 tokens each: its queries and the keys and values it wrote
    against the tensor ops' (float64 on the same operands); a cache entry nobody wrote stays zero;
    and each token's query and cache entries have the same bits when it is stepped alone."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, H = 4, 2, 16, 48
    w = (torch.randn((heads + 2 * kv_heads) * d, H, generator=g) * H**-0.5).bfloat16()
    bias = torch.randn((heads + 2 * kv_heads) * d, generator=g).bfloat16()
    norm = (1 + 0.2 * torch.randn(H, generator=g)).bfloat16()
    x = torch.randn(2, 3, H, generator=g).bfloat16()
    angles = torch.randn(2, 3, d // 2, generator=g)
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    slot, positions = torch.tensor([[2], [0]]), torch.tensor([[5, 6, 7], [0, 1, 2]])

    def run(how, rows, cast=lambda t: t):
        caches = [torch.zeros(3, 16, kv_heads, d, dtype=cast(x).dtype) for _ in "kv"]
        q, _, _ = how.qkv(cast(x[rows]), cast(norm), 1e-5, cast(w), cast(bias), None, None, cast(cos[rows]),
                          cast(sin[rows]), (*caches, slot[rows], positions[rows]), heads, kv_heads)  # fmt: skip
        return q, caches

    q, (kc, vc) = run(KernelProducts(), slice(None))
    want_q, (want_k, want_v) = run(TENSOR_OPS, slice(None), lambda t: t.double())
    for got, want in ((q, want_q), (kc, want_k), (vc, want_v)):
        assert float((got.double() - want).norm() / want.norm()) < 3e-2
    assert not kc[1].any() and not vc[1].any() and not kc[2, :5].any()
    for t in range(3):
        alone = {k: v[:, t : t + 1] for k, v in {"x": x, "cos": cos, "sin": sin, "positions": positions}.items()}
        caches = [torch.zeros_like(kc) for _ in "kv"]
        q1, _, _ = KernelProducts().qkv(alone["x"], norm, 1e-5, w, bias, None, None, alone["cos"], alone["sin"],
                                        (*caches, slot, alone["positions"]), heads, kv_heads)  # fmt: skip
        assert torch.equal(q1[:, 0], q[:, t])
        for row in range(2):
            at = (slot[row, 0], positions[row, t])
            assert torch.equal(caches[0][at], kc[at]) and torch.equal(caches[1][at], vc[at])


def small_model(model_type: str):
    config = AutoConfig.for_model(model_type=model_type, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=2, vocab_size=211, head_dim=16,
                                  max_position_embeddings=256, attention_bias=model_type == "llama")  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    for p in model.parameters():  # biases and norms away from their initial zeros and ones
        p.add_(torch.randn_like(p) * 0.02)
    return model.bfloat16()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_decoder_step_through_the_kernels(model_type):
    """A slot target's steps (Llama with q/k/v and o biases, Qwen3 with q/k norms) run their products
    through the kernel: their logits match the same steps through the tensor ops, and a verify step
    of 5 tokens gives each token's logits bit for bit as 5 one-token steps do."""
    model = small_model(model_type)
    prompt = tuple(range(5, 24))
    ids, positions = torch.tensor([[7, 8, 9, 10, 11]]), torch.arange(19, 24)[None]
    kernels = SlotTarget(model, 1, 64)
    assert type(kernels.decoder.layers._products(SlotStep(positions), "fixed")) is KernelProducts
    kernels.prefill([0], [prompt])
    verify, _ = kernels.step(ids, positions)
    singles = torch.cat([kernels.step(ids[:, i : i + 1], positions[:, i : i + 1])[0] for i in range(5)], 1)
    assert torch.equal(verify, singles)

    plain = SlotTarget(model, 1, 64, kernels=KernelSettings(kernel_rows=0))  # the same steps through the tensor ops
    plain.prefill([0], [prompt])
    want, _ = plain.step(ids, positions)
    assert float((verify.float() - want.float()).norm() / want.float().norm()) < 2e-2
    assert (verify.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
