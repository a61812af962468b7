"""DFlash drafter: forward under the block rule vs a per-block reference, export round trip,
serving config, geometry from a target config."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_grads
from safetensors import safe_open
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from dflash_cache.cache.spec import default_layer_ids
from dflash_cache.drafters import attention
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.family import load_serving, save_serving
from dflash_cache.drafters.dflash.model import DFlashDrafter

B = 4
LENGTHS = [13, 3, 29, 7]  # the 3-token sequence is shorter than a block: it gets no blocks
# (sequence, anchor): anchor 0 (empty context), last valid anchor (len - B), repeats per sequence
BLOCKS = [(0, 0), (0, 5), (0, 9), (2, 1), (2, 11), (2, 12), (2, 25), (3, 3)]


def tiny_config(heads: int = 4, kv_heads: int = 2, **kw) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        intermediate_size=48,
        vocab_size=50,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        target_layer_ids=[0, 2, 5],
        num_target_layers=6,
        mask_token_id=49,
        num_hidden_layers=2,
        block_size=B,
    )
    base.update(kw)
    return DrafterConfig(**base)


def random_model(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so that their weights matter
            p.add_(torch.randn_like(p) * 0.3)
    return model


def packed_batch(cfg: DrafterConfig, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + LENGTHS).cumsum(0)
    k_h = cfg.num_context_layers * cfg.hidden_size
    context = torch.randn(int(offsets[-1]), k_h, generator=g, dtype=torch.float64)
    embeds = torch.randn(len(BLOCKS) * B, cfg.hidden_size, generator=g, dtype=torch.float64)
    seq = torch.tensor([s for s, _ in BLOCKS])
    anchor = torch.tensor([a for _, a in BLOCKS])
    return embeds, context, BlockLayout.build(offsets, seq, anchor, B), offsets


# ----------------------------------------------------------------------------- reference


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    # transformers computes the inverse frequencies in float32; mirror that, then go float64
    inv = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))).double()
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_forward(model, cfg, embeds, context, offsets):
    """Each block alone: its B tokens against its own sequence's context rows [0, anchor)."""
    p = dict(model.named_parameters())
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    outs = []
    for j, (s, a) in enumerate(BLOCKS):
        raw = context[offsets[s] : offsets[s] + a]
        ctx = rms(raw @ p["fc.weight"].T, p["hidden_norm.weight"])
        x = embeds[j * B : (j + 1) * B]
        pos_b = a + torch.arange(B)
        pos_kv = torch.cat([torch.arange(a), pos_b])
        for i in range(cfg.num_hidden_layers):
            w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
            h = rms(x, w["input_layernorm.weight"])
            q = rms((h @ w["self_attn.q_proj.weight"].T).view(B, hq, d), w["self_attn.q_norm.weight"])
            q = rope(q, pos_b, cfg.rope_theta)
            kv_in = torch.cat([ctx, h])
            k = (kv_in @ w["self_attn.k_proj.weight"].T).view(-1, hkv, d)
            k = rope(rms(k, w["self_attn.k_norm.weight"]), pos_kv, cfg.rope_theta)
            v = (kv_in @ w["self_attn.v_proj.weight"].T).view(-1, hkv, d)
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d**0.5, dim=-1)
            o = torch.einsum("hqk,khd->qhd", att, v).reshape(B, hq * d)
            x = x + o @ w["self_attn.o_proj.weight"].T
            h = rms(x, w["post_attention_layernorm.weight"])
            mlp = F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
            x = x + mlp @ w["mlp.down_proj.weight"].T
        outs.append(rms(x, p["norm.weight"]))
    return torch.cat(outs)


# ----------------------------------------------------------------------------- tests


# chunk_elems 40 cuts every sequence into several SDPA pieces
@pytest.mark.parametrize("heads,kv_heads,chunk_elems", [(4, 2, 1 << 23), (4, 2, 40), (4, 1, 1 << 23), (2, 2, 1 << 23)])
def test_forward_matches_per_block_reference(heads, kv_heads, chunk_elems, monkeypatch):
    monkeypatch.setattr(attention, "SDPA_CHUNK_ELEMS", chunk_elems)
    cfg = tiny_config(heads, kv_heads)
    model = random_model(cfg)
    embeds, context, layout, offsets = packed_batch(cfg)
    if chunk_elems == 40:
        assert len(layout.sdpa_plan()) > 4
    out = model(embeds, context, layout)
    ref = reference_forward(model, cfg, embeds, context, offsets)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), list(model.parameters()))
    ref_grads = torch.autograd.grad((ref * probe).sum(), list(model.parameters()))
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-10)


def test_context_changes_only_reach_later_anchors():
    """Perturbing context row t of a sequence moves exactly its blocks with anchor > t."""
    cfg = tiny_config()
    model = random_model(cfg)
    embeds, context, layout, offsets = packed_batch(cfg)
    base = model(embeds, context, layout).view(len(BLOCKS), B, -1)
    s, t = 2, 11
    bumped = context.clone()
    bumped[offsets[s] + t] += 1.0
    moved = (model(embeds, bumped, layout).view(len(BLOCKS), B, -1) - base).abs().amax((1, 2))
    expect = torch.tensor([seq == s and a > t for seq, a in BLOCKS])
    assert torch.equal(moved > 1e-12, expect)


def test_gradient_checkpointing_same_result():
    cfg = tiny_config()
    model = random_model(cfg)
    embeds, context, layout, _ = packed_batch(cfg)
    out = model(embeds, context, layout)
    g = torch.autograd.grad(out.square().sum(), model.fc.weight)[0]
    model.gradient_checkpointing = True
    out_ckpt = model(embeds, context, layout)
    g_ckpt = torch.autograd.grad(out_ckpt.square().sum(), model.fc.weight)[0]
    torch.testing.assert_close(out_ckpt, out, rtol=0, atol=0)
    torch.testing.assert_close(g_ckpt, g, rtol=1e-12, atol=1e-12)


def test_export_round_trip(tmp_path):
    cfg = tiny_config(rope_theta=1e6)
    model = random_model(cfg)
    with torch.no_grad():  # bf16-representable weights: the export is then lossless
        for p in model.parameters():
            p.copy_(p.bfloat16().double())
    embeds, context, layout, _ = packed_batch(cfg)
    before = model(embeds, context, layout)

    out_dir = tmp_path / "export" / "drafter"
    save_serving(model, cfg, out_dir)
    save_serving(model, cfg, out_dir)  # overwriting an export works too
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert [p.name for p in out_dir.parent.iterdir()] == ["drafter"]  # no temp dirs left

    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    layer_keys = {k for k in keys if k.startswith("layers.")}
    assert keys - layer_keys == {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert {k.split(".", 2)[2] for k in layer_keys} == {
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    assert {k.split(".")[1] for k in layer_keys} == {"0", "1"}

    conf = json.loads((out_dir / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"]
    assert conf["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}  # the file beside it (test_serving_export)
    assert conf["model_type"] == "qwen3"
    assert conf["block_size"] == B
    assert conf["num_target_layers"] == 6
    assert conf["num_hidden_layers"] == 2
    assert conf["dflash_config"] == {"mask_token_id": 49, "target_layer_ids": [0, 2, 5]}
    assert conf["vocab_size"] == 50
    assert conf["torch_dtype"] == "bfloat16"
    assert conf["tie_word_embeddings"] is False
    assert (conf["hidden_size"], conf["intermediate_size"], conf["head_dim"]) == (32, 48, 8)
    assert (conf["num_attention_heads"], conf["num_key_value_heads"]) == (4, 2)
    assert conf["rope_theta"] == 1e6

    loaded, loaded_cfg = load_serving(out_dir)
    assert loaded_cfg == cfg
    assert next(loaded.parameters()).dtype == torch.bfloat16
    loaded, _ = load_serving(out_dir, dtype=torch.float64)
    assert torch.equal(loaded(embeds, context, layout), before)


def test_serving_config_reads_as_qwen3_config():
    cfg = tiny_config()
    hf = Qwen3Config.from_dict(cfg.to_serving_config())
    assert (hf.hidden_size, hf.head_dim, hf.num_hidden_layers) == (32, 8, 2)
    assert hf.num_key_value_heads == 2
    assert hf.dflash_config["target_layer_ids"] == [0, 2, 5]
    assert DrafterConfig.from_serving_config(hf.to_dict()) == cfg


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 36,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_from_target_qwen3_8b():
    cfg = DrafterConfig.from_target(QWEN3_8B, target_layer_ids=None, mask_token_id=151669)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (4096, 12288, 151936)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (cfg.num_target_layers, cfg.num_hidden_layers, cfg.block_size) == (36, 5, 16)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 40960
    assert cfg.mask_token_id == 151669
    serving = cfg.to_serving_config()
    assert serving["num_hidden_layers"] == 5 and serving["num_target_layers"] == 36
    assert DrafterConfig.from_serving_config(serving) == cfg


def test_from_target_geometry_variants():
    # Qwen3-0.6B: head_dim (128) is not hidden/heads (64)
    small = dict(QWEN3_8B, hidden_size=1024, num_attention_heads=16, num_hidden_layers=28)
    cfg = DrafterConfig.from_target(small, target_layer_ids=[2, 20], mask_token_id=5)
    assert cfg.head_dim == 128 and cfg.target_layer_ids == [2, 20]
    # Llama-like: no head_dim, legacy rope_scaling with "type"
    llama = {k: v for k, v in QWEN3_8B.items() if k != "head_dim"}
    llama["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    llama["rope_theta"] = 500000.0
    cfg = DrafterConfig.from_target(llama, target_layer_ids=None, mask_token_id=5, num_draft_layers=2, block_size=8)
    assert cfg.head_dim == 128 and cfg.rope_scaling["rope_type"] == "llama3"
    assert DrafterConfig.from_serving_config(cfg.to_serving_config()) == cfg
    # transformers 5 style rope_parameters
    v5 = {k: v for k, v in QWEN3_8B.items() if not k.startswith("rope")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    cfg = DrafterConfig.from_target(v5, target_layer_ids=None, mask_token_id=5)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    with pytest.raises(ValueError):
        DrafterConfig.from_target(QWEN3_8B, target_layer_ids=[1, 36], mask_token_id=5)


def test_scaled_rope_builds():
    cfg = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    model = random_model(cfg)
    plain = random_model(tiny_config())
    assert not torch.equal(model._inv_freq, plain._inv_freq)
    embeds, context, layout, _ = packed_batch(cfg)
    assert torch.isfinite(model(embeds, context, layout)).all()


def test_default_layer_ids():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28) == [1, 7, 13, 19, 25]
    assert default_layer_ids(36, 1) == [18]
    for depth in range(2, 9):  # too shallow for 5 distinct taps: the distinct ones, in range
        ids = default_layer_ids(depth)
        assert ids == sorted(set(ids)) and all(0 <= i < depth for i in ids)
    assert default_layer_ids(6) == [1, 2, 3] and default_layer_ids(8) == [1, 2, 3, 4, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_path_matches_sdpa_path(dtype):
    torch.manual_seed(0)
    dev = "cuda"
    lengths = [300, 17, 1000, 64]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    seq, anchor = [], []
    for s, n in enumerate(lengths):
        if n >= 16:
            a = torch.randperm(n - 15)[: min(40, n - 15)].sort().values
            seq += [s] * len(a)
            anchor += a.tolist()
    layout = BlockLayout.build(offsets, torch.tensor(seq), torch.tensor(anchor), 16).to(dev)
    nq, nc, hq, hkv, d = len(seq) * 16, int(offsets[-1]), 8, 2, 64

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    q, kc, vc, kb, vb = rand(nq, hq, d), rand(nc, hkv, d), rand(nc, hkv, d), rand(nq, hkv, d), rand(nq, hkv, d)
    probe = torch.randn(nq, hq, d, device=dev, dtype=dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    results = []
    for impl in ("flex", "sdpa"):
        out = attention.block_attention(q, torch.cat([kc, kb]), torch.cat([vc, vb]), layout, impl=impl)
        grads = torch.autograd.grad((out * probe).sum(), (q, kc, vc, kb, vb))
        results.append((out, grads))
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    assert_same_grads(results[0][1], results[1][1], tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_drafter_on_cuda_matches_reference():
    cfg = tiny_config(head_dim=16)
    model = random_model(cfg)
    embeds, context, layout, offsets = packed_batch(cfg)
    ref = reference_forward(model, cfg, embeds, context, offsets)
    gpu = model.float().cuda()
    out = gpu(embeds.float().cuda(), context.float().cuda(), layout.to("cuda"))
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-4, atol=1e-4)


def test_a_failed_compile_runs_eagerly_with_one_short_warning():
    """Where inductor fails (here: no working C++ compiler), a decode-step piece compiled by
    `compiled_or_eager` (prompt lookup's search) runs eagerly: the same drafts, one warning whose
    reason is the error's first line, not the pages of advice inductor appends, and no second try."""
    import warnings
    from unittest import mock

    from torch._inductor import config as inductor_config

    from dflash_cache.drafters.compile import compiled_or_eager
    from dflash_cache.generate.lookup_mix import ngram_drafts

    tokens = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 5, 6, 0, 0, 0]])
    pos = torch.tensor([8])  # committed: ... 5 6; the latest earlier "5 6" is followed by 9 5 6
    search = compiled_or_eager(ngram_drafts, "prompt lookup")
    no_compiler = mock.patch.object(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    with no_compiler, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        first = search(tokens, pos, 3, 3)
        again = search(tokens, pos, 3, 3)
    for got in (first, again):
        assert all(torch.equal(a, b) for a, b in zip(got, ngram_drafts(tokens, pos, 3, 3), strict=True))
    assert first[0].tolist() == [[9, 5, 6]] and first[1].tolist() == [2]
    [warning] = [str(x.message) for x in w if "torch.compile" in str(x.message)]
    assert warning.startswith("torch.compile of prompt lookup failed (InductorError: InvalidCxxCompiler")
    assert warning.endswith("); running it eagerly") and "\n" not in warning
