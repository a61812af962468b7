"""Sliding-window draft layers against independent computations: the training attention (the exact
SDPA path and flex attention, run eagerly on the CPU) against a dense mask of the rule written out
pair by pair; the flex tiles a sliding layer visits against the same rule, and their number bounded
by the window; the settings' checks; the serving config's fields and their round trip, both
families; the drafter served through z-lab's reference code and through generate's BlockProposer
against the training forward, over contexts longer than the window; and `dflash train
--sliding-window` from the command line.

The rule (z-lab's reference, `dflash` 0.1.0 `_attention_mask`, with `is_causal` false): in a sliding
layer of window W the block token at position q = anchor + k sees the context positions j < anchor
with q - j < W, and the block tokens at positions j with |q - j| < W."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, packed_rows, reference_dflash
from test_serving_export import one_block
from transformers import DynamicCache, Qwen3Config

from dflash_cache import drafters
from dflash_cache.drafters import attention
from dflash_cache.drafters.attention import TILE, BlockLayout, block_attention
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.drafters.dspark.config import DSparkConfig
from dflash_cache.drafters.dspark.model import DSparkDrafter
from dflash_cache.drafters.settings import DEFAULT_WINDOW, DrafterSettings

B = 4
S, F = "sliding_attention", "full_attention"


def packed_layout(lengths: list[int], per_seq: int, seed: int = 0, block_size: int = B) -> BlockLayout:
    """Sequences packed together, each with up to `per_seq` sorted random anchors (anchor 0 allowed)."""
    g = torch.Generator().manual_seed(seed)
    seq, anchor = [], []
    for s, n in enumerate(lengths):
        if n >= block_size:
            a = torch.randperm(n - block_size + 1, generator=g)[:per_seq].sort().values
            seq += [s] * len(a)
            anchor += a.tolist()
    return BlockLayout.build(torch.tensor([0, *lengths]).cumsum(0), torch.tensor(seq), torch.tensor(anchor), block_size)


def rule_mask(layout: BlockLayout, window: int | None) -> torch.Tensor:
    """[queries, context + block keys]: the attention rule pair by pair, from each key's and query's
    sequence, block and position alone."""
    nb, B_, nc = layout.num_blocks, layout.block_size, layout.num_context
    q_seq = layout.block_seq.repeat_interleave(B_)
    q_anchor = layout.block_anchor.repeat_interleave(B_)
    q_pos = q_anchor + torch.arange(B_).repeat(nb)
    q_blk = torch.arange(nb * B_) // B_
    k_seq = torch.cat([layout.ctx_seq, q_seq])
    k_pos = torch.cat([layout.ctx_pos, q_pos])
    k_blk = torch.cat([torch.full((nc,), -1), q_blk])
    context = (k_blk[None] < 0) & (k_seq[None] == q_seq[:, None]) & (k_pos[None] < q_anchor[:, None])
    visible = context | (k_blk[None] == q_blk[:, None])
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None]).abs() < window
    return visible


def dense_attention(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of every query over [context ; block keys] under `mask`, GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask[None], float("-inf")).softmax(-1), v)


def random_qkv(layout: BlockLayout, heads: int = 4, kv_heads: int = 2, d: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    nq, nc = layout.num_blocks * layout.block_size, layout.num_context
    shapes = [(nq, heads, d), (nc + nq, kv_heads, d), (nc + nq, kv_heads, d)]  # q; keys, values of [context ; blocks]
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


# ----------------------------------------------------------------------------- training attention


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("window", [None, 1, 3, B + 1, 17, 64])
def test_window_attention_is_the_rule(impl, window, monkeypatch):
    """Both training paths (flex attention eagerly on the CPU, its queries packed by key head) give
    the dense rule's attention and gradients, over packed sequences longer than the window, with
    many anchors each and GQA; windows below the block size mask block keys too. Full attention
    there is something else."""
    monkeypatch.setattr(attention, "_flex_compiled", None)  # eager flex on the CPU
    layout = packed_layout([300, 40, 9, 130], per_seq=12)
    tensors = random_qkv(layout)
    inputs = tensors if impl == "sdpa" else [t.detach() for t in tensors]  # flex has no backward on a CPU
    out = block_attention(*inputs, layout, impl=impl, window=window)
    want = dense_attention(*tensors, rule_mask(layout, window))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    if window is not None:
        full = dense_attention(*tensors, rule_mask(layout, None))
        assert (out - full).abs().max() > 1e-3
    if impl == "sdpa":
        probe = torch.randn_like(out)
        grads = torch.autograd.grad((out * probe).sum(), tensors)
        want_grads = torch.autograd.grad((want * probe).sum(), tensors)
        for g, wg in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, wg, rtol=1e-9, atol=1e-10)


def tile_mask(layout: BlockLayout, window: int | None, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(what flex attention lets through, the full tiles) as [query rows, keys] masks, from the
    BlockMask a sliding layer builds for queries packed `groups` rows a token: the visited tiles'
    pairs where its mask_mod allows them, and every pair of a full tile (where mask_mod never runs)."""
    mask = layout.flex_block_mask(window, groups)
    nq, nk = layout.num_blocks * layout.block_size, layout.num_context + layout.num_blocks * layout.block_size
    counts, indices, full_counts, full_indices = layout.kv_tiles(window, groups)

    def tiles(counts, indices):
        out = torch.zeros(len(counts), -(-nk // TILE), dtype=torch.bool)
        for t, (c, row) in enumerate(zip(counts.tolist(), indices.tolist(), strict=True)):
            out[t, row[:c]] = True
        return out.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[: nq * groups, :nk]

    q, k = torch.arange(nq * groups)[:, None], torch.arange(nk)[None]
    partial = tiles(counts, indices) & mask.mask_mod(0, 0, q, k)
    full = tiles(full_counts, full_indices)
    assert not (partial & full).any()
    return partial | full, full


@pytest.mark.parametrize("window", [None, 2, 7, 150, 700])
@pytest.mark.parametrize("groups", [1, 4, 11])
def test_flex_tiles_visit_the_window_alone(window, groups):
    """The key tiles a query tile visits, with mask_mod inside them and full tiles taken whole, let
    through exactly the rule's pairs, for queries packed by key head too (`groups` rows a token: 16 x 11
    rows span up to three tiles a block);
    with a window, a tile visits at most its blocks' windows (O(W) tiles a block, however far apart
    their anchors and however long the context)."""
    layouts = [packed_layout([3000, 200, 1500], per_seq=40, seed=2), packed_layout([5000], per_seq=3, seed=4),
               packed_layout([700, 9, 300], per_seq=20, seed=6, block_size=16)]  # fmt: skip
    if groups == 1:  # many blocks a tile (the dense masks of its packed rows would not fit in memory)
        layouts.append(packed_layout([900, 12, 900], per_seq=300, seed=5, block_size=16))
    for layout in layouts:
        allowed, full = tile_mask(layout, window, groups)
        rule = rule_mask(layout, window)[packed_rows(layout.block_size, layout.num_blocks, groups)]
        assert torch.equal(allowed, rule)
        assert not (full & ~rule).any()
        if window is None:
            continue
        counts, indices, full_counts, _ = layout.kv_tiles(window, groups)
        rows = layout.block_size * groups
        blocks = torch.bincount(torch.arange(layout.num_blocks) * rows // TILE, minlength=len(counts))
        own = 2 + layout.block_size // TILE
        assert ((counts + full_counts) <= (blocks + 1) * (window // TILE + 2) + own).all()


def test_sdpa_pieces_stay_within_the_window():
    """The exact path's pieces of a sliding layer score at most twice the window of context (and the
    whole prefix without one)."""
    layout = packed_layout([5000, 300], per_seq=30, seed=3)
    for window in (8, 100):
        plan = layout.sdpa_plan(window)
        assert all(hi - lo <= 2 * window for _, _, _, lo, hi in plan)
        assert [p[:2] for p in plan] == sorted(p[:2] for p in plan)
        assert sum(q1 - q0 for q0, q1, *_ in plan) == layout.num_blocks * B
    assert any(lo == 0 and hi > 1000 for *_, lo, hi in layout.sdpa_plan(None))


# ----------------------------------------------------------------------------- settings and configs


def test_settings_give_each_layer_its_type():
    """Every layer slides at DEFAULT_WINDOW unless told; --sliding-window full keeps them all full;
    --full-attention-layers keeps the named ones full; settings that make no sense are refused
    naming the flag."""
    assert DrafterSettings().layer_types() == [S] * 5 and DrafterSettings().window() == DEFAULT_WINDOW == 2048
    assert DrafterSettings(sliding_window="full").layer_types() is None
    assert DrafterSettings(sliding_window="full").window() is None
    assert DrafterSettings(sliding_window=8).layer_types() == [S] * 5
    assert DrafterSettings(sliding_window=8, full_attention_layers=[4]).layer_types() == [S, S, S, S, F]
    assert DrafterSettings(sliding_window=8, draft_layers=2, full_attention_layers=[0]).layer_types() == [F, S]
    assert DrafterSettings(full_attention_layers=[1]).layer_types() == [S, F, S, S, S]
    for bad, match in ((dict(sliding_window="full", full_attention_layers=[1]), "every layer already attends"),
                       (dict(sliding_window=8, full_attention_layers=[5]), "out of range for 5 draft layers"),
                       (dict(sliding_window=8, full_attention_layers=[0, 1, 2, 3, 4]), "use --sliding-window full"),
                       (dict(sliding_window=0), "expected an integer >= 1 or full")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            DrafterSettings(**bad).layer_types()


GEOMETRY = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "intermediate_size": 48, "vocab_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "num_hidden_layers": 6}  # fmt: skip


def windowed(cls=DrafterConfig, window: int | None = 5, types: list[str] | None = (S, F), geometry: dict = GEOMETRY,
             block_size: int = B) -> DrafterConfig:  # fmt: skip
    """A two-layer drafter's config of `types` at `window` (None, None: full attention)."""
    return cls.from_target(geometry, target_layer_ids=[1, 3, 4], mask_token_id=geometry["vocab_size"] - 1,
                           num_draft_layers=len(types or [0, 0]), block_size=block_size, sliding_window=window,
                           layer_types=None if types is None else list(types))  # fmt: skip


@pytest.mark.parametrize("cls", [DrafterConfig, DSparkConfig])
def test_serving_config_round_trip(cls):
    """The export's layer_types, sliding_window, use_sliding_window, max_window_layers and is_causal,
    as transformers' Qwen3Config and z-lab's reference read them, and back; without a window the
    fields are what they always were."""
    cfg = windowed(cls, 5, [F, S])
    d = cfg.to_serving_config()
    assert (d["layer_types"], d["sliding_window"], d["use_sliding_window"]) == ([F, S], 5, True)
    assert d["max_window_layers"] == 1 and d["is_causal"] is False
    qwen = Qwen3Config(**{k: v for k, v in d.items() if k not in ("architectures", "auto_map")})
    assert (qwen.layer_types, qwen.sliding_window, qwen.is_causal) == ([F, S], 5, False)
    back = cls.from_serving_config(json.loads(json.dumps(d)))
    assert back == cfg and back.windows == [None, 5]
    plain = windowed(cls, None, None).to_serving_config()
    assert (plain["layer_types"], plain["sliding_window"], plain["use_sliding_window"]) == ([F, F], None, False)
    assert plain["max_window_layers"] == 2 and "is_causal" not in plain
    assert cls.from_serving_config(plain).windows == [None, None]
    # transformers' reading of a config without layer_types: the layers at and past max_window_layers slide
    implied = {k: v for k, v in d.items() if k != "layer_types"}
    assert cls.from_serving_config(implied).layer_types == [F, S]
    with pytest.raises(ValueError, match="is_causal"):  # the reference would run these layers causally
        cls.from_serving_config({k: v for k, v in d.items() if k != "is_causal"})
    with pytest.raises(ValueError, match="sliding_window"):
        cls.from_serving_config({**d, "use_sliding_window": False})


# ----------------------------------------------------------------------------- served == trained


def random_drafter(cfg: DrafterConfig, cls: type = DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """A random drafter with bf16-representable weights (its export is then lossless) and norms away
    from 1, so that every weight matters."""
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.bfloat16().float())
    return model.eval()


def same_weights(model: DFlashDrafter, cfg: DrafterConfig) -> DFlashDrafter:
    """A drafter of config `cfg` holding `model`'s weights."""
    other = type(model)(cfg).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name,types", [("dflash", [S, F]), ("dspark", [F, S]), ("dflash", [S, S])])
def test_the_reference_code_serves_what_was_trained(tmp_path, name, types):
    """z-lab's DFlashDraftModel (dflash 0.1.0) loads a windowed export (a DSpark export's backbone
    too) and gives the training forward's hidden states for a block after a context longer than the
    window: in one call, and with its KV cache over two calls (the first block's keys cropped off,
    as its decoding does). The same weights with full attention give other states."""
    reference = reference_dflash()
    family = drafters.family(name)
    cfg = windowed(DSparkConfig if name == "dspark" else DrafterConfig, 5, types)
    model = random_drafter(cfg, DSparkDrafter if name == "dspark" else DFlashDrafter)
    family.save_serving(model, cfg, tmp_path / "export")
    theirs = reference.DFlashDraftModel.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert [layer.self_attn.sliding_window for layer in theirs.layers] == cfg.windows
    assert not any(layer.self_attn.is_causal for layer in theirs.layers)
    g = torch.Generator().manual_seed(7)
    c1, c2 = 11, 19
    ctx = torch.randn(c2, cfg.fc_inputs, generator=g)
    first, second = (torch.randn(B, cfg.hidden_size, generator=g) for _ in range(2))
    tol = {"rtol": 1e-5, "atol": 1e-5}
    with torch.no_grad():
        whole = theirs(position_ids=torch.arange(c2 + B)[None], noise_embedding=second[None], target_hidden=ctx[None])
        cache = DynamicCache()
        got1 = theirs(position_ids=torch.arange(c1 + B)[None], noise_embedding=first[None],
                      target_hidden=ctx[None, :c1], past_key_values=cache, use_cache=True)  # fmt: skip
        cache.crop(-B)  # the first block's keys off, its context's kept
        got2 = theirs(position_ids=torch.arange(c1, c2 + B)[None], noise_embedding=second[None],
                      target_hidden=ctx[None, c1:], past_key_values=cache, use_cache=True)  # fmt: skip
    want = one_block(model, ctx, second)
    torch.testing.assert_close(whole[0], want, **tol)
    torch.testing.assert_close(got1[0], one_block(model, ctx[:c1], first), **tol)
    torch.testing.assert_close(got2[0], want, **tol)
    full = one_block(same_weights(model, dataclasses.replace(cfg, sliding_window=None, layer_types=None)), ctx,
                         second)  # fmt: skip
    assert (full - want).abs().max() > 1e-3


class Recorder:
    """A greedy `choose` that keeps every logits row it is given (each draft position's, in order)."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.logits.append(logits.clone())
        return logits.argmax(-1), None

    def all(self) -> torch.Tensor:
        return torch.stack(self.logits, 1)


@pytest.mark.parametrize("name,types", [("dflash", [S, F]), ("dspark", [S, S])])
def test_block_proposer_serves_what_was_trained(name, types):
    """generate's BlockProposer (each row's context keys and values in its slots, stale entries past
    the block included) gives, for both families, the logits the family's `draft` makes of the
    training forward over the block's whole context, at anchors well past the window; with full
    attention the same weights give other logits."""
    from dflash_cache.generate import BlockProposer

    family = drafters.family(name)
    cfg = windowed(DSparkConfig if name == "dspark" else DrafterConfig, 6, types)
    model = random_drafter(cfg, DSparkDrafter if name == "dspark" else DFlashDrafter)
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(64, cfg.hidden_size, generator=g), torch.randn(64, cfg.hidden_size, generator=g)
    ctx = torch.randn(60, cfg.fc_inputs, generator=g)
    anchors, last = [37, 22], torch.tensor([17, 4])

    def served(model: DFlashDrafter) -> torch.Tensor:
        proposer = BlockProposer(model, embed=embed, head=head, slots=2, length=64, family=family)
        for row, a in enumerate(anchors):
            stale = ctx[: a + B + 3].clone()
            stale[a:] = torch.randn_like(stale[a:])  # what rejected drafts leave behind
            proposer.add_context(stale[None], torch.arange(a + B + 3)[None], torch.tensor([row]))
        recorder = Recorder()
        proposer.propose(last, torch.tensor(anchors), recorder)
        return recorder.all()

    want = []
    for a, t in zip(anchors, last.tolist(), strict=True):
        block = family.block_input(torch.tensor([t]), cfg.block_size, cfg.mask_token_id)
        hidden = one_block(model, ctx[:a], embed[block[0]])
        recorder = Recorder()
        with torch.no_grad():
            family.draft(model, hidden[None], block, head, recorder)
        want.append(recorder.all()[0])
    got = served(model)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    full = served(same_weights(model, dataclasses.replace(cfg, sliding_window=None, layer_types=None)))
    assert (full - got).abs().max() > 1e-3


# ----------------------------------------------------------------------------- the command line


def test_train_with_a_window_from_the_command_line(tiny_cache, tmp_path):
    """`dflash train --sliding-window 8 --full-attention-layers 1` trains and exports a drafter whose
    config says so, records both settings in the run's identity, and loads back with those windows;
    settings that make no sense are one `error:` line naming the flag."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "cli.main", "train", "--cache", str(tiny_cache), "--epochs", "1", "--max-steps", "2",
            "--token-budget", "1024", "--max-anchors", "8", "--draft-layers", "2"]  # fmt: skip
    out = tmp_path / "run"
    res = subprocess.run([*base, "--out", str(out), "--sliding-window", "8", "--full-attention-layers", "1"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    line = "drafter: dflash, 2 layers, layer 0 slides in a window of 8 tokens, layer 1 attends to the whole context"
    assert line in res.stderr
    config = json.loads((out / "export" / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"], config["use_sliding_window"]) == ([S, F], 8, True)
    assert config["is_causal"] is False
    identity = json.loads((out / "train.json").read_text())["identity"]
    assert (identity["sliding_window"], identity["full_attention_layers"]) == (8, [1])
    _, cfg = drafters.load_serving(out / "export")[:2]
    assert cfg.windows == [8, None]
    for flags, flag in ((["--sliding-window", "8", "--full-attention-layers", "2"], "--full-attention-layers"),
                        (["--sliding-window", "full", "--full-attention-layers", "0"], "--sliding-window full"),
                        (["--sliding-window", "0"], "--sliding-window")):  # fmt: skip
        res = subprocess.run([*base, "--out", str(tmp_path / "bad"), *flags], env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
        lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
        assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], lines


def test_train_slides_by_default_and_older_runs_resume_full(tiny_cache, tmp_path):
    """With no --sliding-window a new run slides every layer at DEFAULT_WINDOW; a run begun with full
    attention (`--sliding-window full`, as older versions' runs record it too: no window
    in its identity) resumes with full attention when rerun without the flag, `--config RUN` of a
    record that says no window trains with full attention too, and a rerun that asks for another
    window is refused naming it."""
    from dflash_cache.core.settings import resolve
    from dflash_cache.train.config import TrainConfig, TrainError
    from dflash_cache.train.stage import run as train

    def settings(out: Path, steps: int = 1, **more) -> TrainConfig:
        return TrainConfig(cache=tiny_cache, out=out, epochs=1, max_steps=steps, token_budget=1024, max_anchors=8,
                           draft_layers=2, save_every=1, **more)  # fmt: skip

    train(settings(tmp_path / "new"))
    config = json.loads((tmp_path / "new" / "export" / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == ([S, S], DEFAULT_WINDOW)
    assert json.loads((tmp_path / "new" / "train.json").read_text())["identity"]["sliding_window"] == DEFAULT_WINDOW

    old = tmp_path / "full"
    train(settings(old, sliding_window="full"))
    record = json.loads((old / "train.json").read_text())
    first = (old / "checkpoints" / "step_00000001.pt").stat().st_mtime_ns
    assert "sliding_window" not in record["identity"] and record["config"]["sliding_window"] == "full"
    train(settings(old, steps=2))  # the rerun without the flag resumes the run as it began: one more step
    assert (old / "checkpoints" / "step_00000001.pt").stat().st_mtime_ns == first
    assert (old / "checkpoints" / "step_00000002.pt").exists()
    assert json.loads((old / "train.json").read_text()) == record
    config = json.loads((old / "export" / "config.json").read_text())
    assert config["sliding_window"] is None and config.get("layer_types") in (None, [F, F])

    record["config"]["sliding_window"] = None  # as older versions wrote it: unset
    (old / "train.json").write_text(json.dumps(record))
    again = resolve(TrainConfig, files=[old], flags={"out": str(tmp_path / "again")})
    assert again.sliding_window == "full"  # its settings again, full attention included
    train(again)
    assert "sliding_window" not in json.loads((tmp_path / "again" / "train.json").read_text())["identity"]
    with pytest.raises(TrainError, match=r"sliding_window \(None vs 8\)"):
        train(settings(old, steps=3, sliding_window=8))


def test_useful_flops_count_the_window():
    """MFU's attention term counts a sliding layer's context keys as min(anchor, W - 1), averaged
    over the layers; with full attention everywhere, the sum of the anchors as before."""
    from dflash_cache.drafters.dflash.family import StepFlops

    layout = packed_layout([300, 40], per_seq=10)
    anchors = layout.block_anchor
    flops = StepFlops(DFlashDrafter(windowed(DrafterConfig, 5, [S, F])))
    assert float(flops.context_keys(layout)) == (anchors.clamp(max=4).sum() + anchors.sum()).item() / 2
    assert torch.equal(StepFlops(DFlashDrafter(windowed(DrafterConfig, None, None))).context_keys(layout),
                       anchors.sum())  # fmt: skip
