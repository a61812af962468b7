"""The fused decoder kernels (generate/fused.py) and the slot attention kernels (slot_kernel.py),
run on the CPU by Triton's interpreter, against independent computations: transformers' own
forward of each model type the slot target serves, the masked attention path, and the same
tokens computed one a step. The GPU suite checks the same kernels compiled, bit for bit between
decode and verify steps (tests/test_gpu.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_decoder import MODELS, model_of

from dflash_cache.generate import fused, slot_kernel
from dflash_cache.generate.slots import SlotStep, _masked, _rows_of
from dflash_cache.generate.targets import SlotTarget

triton = pytest.importorskip("triton", reason="the kernels need Triton (pip install triton); its interpreter runs them")

# Heads of 32 (the kernels hold a head's two rotary halves, 16 wide at least).
FUSABLE = {"hidden_size": 64, "intermediate_size": 80, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32}  # fmt: skip


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Triton's interpreter for this test's kernels (conftest loads Triton for it). Its dot product
    is replaced by one that, like a GPU's matrix instructions, computes each output row from its own
    input row alone (numpy's matrix product may sum a row in another order by its place in the
    tile), and that widens bfloat16 operands to float32 first (exact), where the interpreter's own
    reads their raw 16-bit patterns (Triton 3.9)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs these kernels compiled (tests/test_gpu.py)")
    from triton.runtime import interpreter as interp

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (x.data if x.data.dtype != np.uint16 else (x.data.astype(np.uint32) << 16).view(np.float32)
                for x in (a, b))  # fmt: skip
        rows = np.stack([np.matmul(row[None], b, dtype=d.data.dtype)[0] for row in a])
        return interp.TensorHandle(rows + d.data, d.dtype.scalar)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", dot)


def fusable(name: str, dtype: torch.dtype = torch.float32):
    model = model_of(name, geometry=FUSABLE)
    return model.to(dtype)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_steps_are_the_models_forward(name):
    """Steps of 3, 1 and 4 tokens into rows 2 and 0 of three, through the fused kernels: the
    logits and tapped layers of transformers' forward over the whole sequence (float32), for
    Llama with and without biases, Qwen2's q/k/v biases, Qwen3's q/k norms and Mistral."""
    model = fusable(name)
    layers = [0, 2, 1]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=g)
    with torch.inference_mode():
        ref = model(ids, output_hidden_states=True)
    taps = torch.cat([ref.hidden_states[lid + 1] for lid in layers], -1)
    target = SlotTarget(model, slots=3, length=64, layer_ids=layers)
    cut = {2: 11, 0: 7}
    target.prefill([2, 0], [tuple(ids[0, :11].tolist()), tuple(ids[1, :7].tolist())])
    for width in (3, 1, 4):
        positions = torch.zeros(3, width, dtype=torch.long)
        step_ids = torch.zeros(3, width, dtype=torch.long)
        for row, src in ((2, 0), (0, 1)):
            positions[row] = torch.arange(cut[row], cut[row] + width)
            step_ids[row] = ids[src, cut[row] : cut[row] + width]
        logits, states = target.step(step_ids, positions)
        for row, src in ((2, 0), (0, 1)):
            span = slice(cut[row], cut[row] + width)
            torch.testing.assert_close(logits[row], ref.logits[src, span], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(states[row], taps[src, span], rtol=1e-4, atol=1e-4)
            cut[row] += width
    assert target.decoder.layers.fused is True


def test_a_token_comes_out_the_same_in_any_step():
    """bf16, the Triton attention too: a verify step's logits at each of its 5 tokens are, bit for
    bit, those of 5 one-token steps, and a row's are the same beside another row or alone."""
    model = fusable("qwen3", torch.bfloat16)
    prompt = tuple(range(3, 40))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=g)
    positions = (len(prompt) + torch.arange(5)).expand(2, -1)

    def fresh() -> SlotTarget:
        t = SlotTarget(model, slots=2, length=64)
        t.prefill([0, 1], [prompt, prompt])
        return t

    block, _ = fresh().step(ids, positions)
    t = fresh()
    single = torch.cat([t.step(ids[:, k : k + 1], positions[:, k : k + 1])[0] for k in range(5)], 1)
    assert t.decoder.layers.fused is True
    assert torch.equal(block, single)
    alone = SlotTarget(model, slots=1, length=64)
    alone.prefill([0], [prompt])
    assert torch.equal(alone.step(ids[1:], positions[1:])[0], block[1:])


def test_a_failing_kernel_falls_back_to_the_compiled_layers_with_a_warning(monkeypatch):
    """A kernel that fails (injected: it raises) or computes nonsense (injected: zeros) turns the
    fused path off with one warning; the step gives the compiled layers' logits."""
    model = fusable("qwen3")
    want_target = SlotTarget(model, 1, 32, compile=False)
    want_target.prefill([0], [tuple(range(5, 12))])
    step_ids, positions = torch.tensor([[3, 4]]), torch.tensor([[7, 8]])
    with monkeypatch.context() as m:
        m.setattr(fused, "serves", lambda x, rows: False)
        want, _ = want_target.step(step_ids, positions)

    def raises(*args, **kwargs):
        raise RuntimeError("the kernel says no")

    def zeros(x, weight, *args, swiglu=False, **kwargs):
        return x.new_zeros(x.shape[0], weight.shape[0] // (2 if swiglu else 1))

    for broken, why in ((raises, "the kernel says no"), (zeros, "disagrees")):
        target = SlotTarget(model, 1, 32)
        target.prefill([0], [tuple(range(5, 12))])
        with monkeypatch.context() as m:
            m.setattr(fused, "project", broken)
            with pytest.warns(UserWarning, match=f"fused decoder kernels are off.*{why}") as seen:
                logits, _ = target.step(step_ids, positions)
                again, _ = target.step(step_ids, positions)
        assert len([w for w in seen if "fused" in str(w.message)]) == 1 and target.decoder.layers.fused is False
        torch.testing.assert_close(logits, want, rtol=0, atol=0)
        torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_heads_narrower_than_32_keep_the_compiled_layers():
    target = SlotTarget(model_of("qwen3"), 1, 32)  # heads of 16
    assert target.decoder.layers.fused is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.prefill([0], [tuple(range(5, 12))])
        target.step(torch.tensor([[3]]), torch.tensor([[7]]))


@pytest.mark.parametrize("split", [0, 64])
def test_slot_kernel_equals_the_masked_path(monkeypatch, split):
    """Decode steps, causal verify steps and the drafter's bidirectional block, rows of other slots
    and grouped-query heads, in one piece and cut at every 64 keys: the masked SDPA path in float32."""
    monkeypatch.setattr(slot_kernel, "SPLIT", split or 10**9)
    g = torch.Generator().manual_seed(0)
    S, L, heads, kv, d = 3, 200, 6, 2, 32
    k_buf, v_buf = (torch.randn(S, L, kv, d, generator=g).bfloat16() for _ in range(2))
    for T, seen, causal in ((1, [30, 150, 200], True), (5, [30, 150, 200], True), (8, [60, 150, 130], False)):
        rows = torch.tensor([2, 0, 1])
        query = torch.randn(3, T, heads, d, generator=g).bfloat16()
        got = slot_kernel.attention(query, k_buf, v_buf, rows.int(), torch.tensor(seen).int(), causal, d**-0.5)
        positions = torch.tensor(seen)[:, None] - T + torch.arange(T)
        step = SlotStep(positions, seen=torch.tensor(seen), rows=rows, causal=causal)
        want = _masked(query.float(), *(t.float() for t in _rows_of(k_buf, v_buf, step)), step, d**-0.5)
        assert float((got.float() - want).norm() / want.norm()) < 1e-2


def test_slot_kernel_gives_a_query_the_same_bits_in_any_step(monkeypatch):
    """A query's output does not depend on the step around it: a verify step's 5 queries against 5
    decode steps, over a buffer cut in pieces of 64 keys; and a query that sees one piece gets the
    same bits whether the buffer is cut or not."""
    monkeypatch.setattr(slot_kernel, "SPLIT", 64)
    g = torch.Generator().manual_seed(3)
    heads, kv, d = 6, 2, 32
    k_buf, v_buf = (torch.randn(1, 200, kv, d, generator=g).bfloat16() for _ in range(2))
    slot = torch.tensor([0], dtype=torch.int32)

    def attend(query, seen):
        return slot_kernel.attention(query, k_buf, v_buf, slot, torch.tensor([seen], dtype=torch.int32), True, 0.2)

    query = torch.randn(1, 5, heads, d, generator=g).bfloat16()
    block = attend(query, 150)
    for t in range(5):
        assert torch.equal(attend(query[:, t : t + 1].contiguous(), 146 + t)[:, 0], block[:, t])
    one = query[:, :1].contiguous()
    cut = attend(one, 50)
    monkeypatch.setattr(slot_kernel, "SPLIT", 10**9)
    assert torch.equal(attend(one, 50), cut)
