"""The DSpark family on its own terms: the chunked CE + L1 loss against a full-logits computation,
the block rules, decoding against the training-time logits, the useful-FLOPs count against the
products a step runs, the global loss denominator across two gloo ranks, and `dflash train
--drafter dspark` end to end (validation, resume, export, refusals). The references' own code is
checked in test_dspark_reference.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, TINY_TARGET, jsonl_rows
from torch.utils.flop_counter import FlopCounterMode

from dflash_cache import drafters
from dflash_cache.core.groups import process_group
from dflash_cache.core.launch import launch
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dspark import family as dspark
from dflash_cache.drafters.dspark.config import DSparkConfig
from dflash_cache.drafters.dspark.model import DSparkDrafter
from dflash_cache.drafters.dspark.objective import DEN_EPS, make_dspark_blocks
from dflash_cache.drafters.losses import chunked_tv_loss
from dflash_cache.train.checkpoint import Checkpointer
from dflash_cache.train.config import TrainConfig, TrainError
from dflash_cache.train.stage import export as export_run
from dflash_cache.train.stage import run as train

H, V, B = 32, 97, 5
GEOMETRY = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": V,
            "max_position_embeddings": 512}  # fmt: skip


def small_cfg(head: str = "vanilla", **kw) -> DSparkConfig:
    base = DrafterConfig.from_target(GEOMETRY, target_layer_ids=[1, 3, 5], mask_token_id=V - 1, num_draft_layers=2,
                                     block_size=B)  # fmt: skip
    return DSparkConfig(**dataclasses.asdict(base), markov_rank=8, markov_head_type=head, **kw)


def small_batch(lengths=(21, 14, 9), seed=0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    mask = torch.ones(n, dtype=torch.bool)
    mask[:3] = False
    mask[10] = False
    return SimpleNamespace(host=(torch.randint(0, V - 1, (n,), generator=g), mask, offsets),
                           context=torch.randn(n, 3 * H, generator=g), final=torch.randn(n, H, generator=g),
                           num_tokens=n)  # fmt: skip


@pytest.mark.parametrize("with_bias", [True, False])
def test_chunked_tv_loss_equals_full_logits(with_bias):
    """CE + L1 to the target's softmax, its per-row outputs and its gradients wrt the hidden states,
    the low-rank bias and its projection, against plain autograd over full logits, at chunk sizes
    that do and do not divide the rows."""
    g = torch.Generator().manual_seed(0)
    n, r = 37, 6
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    bias = torch.randn(n, r, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    w2 = torch.randn(V, r, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    target = torch.randn(n, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (n,), generator=g)
    a, b = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    a[::5] = 0  # unweighted rows
    logits = hidden @ weight.T + (bias @ w2.T if with_bias else 0)
    p, q = torch.softmax(logits.float(), -1).double(), torch.softmax((target @ weight.T).float(), -1).double()
    l1 = (p - q).abs().sum(-1)
    ce = F.cross_entropy(logits.float(), labels, reduction="none").double()
    want = (a * ce + b * l1).sum()
    grads = torch.autograd.grad(want, [t for t in (hidden, bias, w2) if t is not None])
    for chunk in (5, 37, 100):
        total, got_ce, got_l1, hits, accept = chunked_tv_loss(hidden, weight, labels, a, b, bias=bias, bias_weight=w2,
                                                              target=target, chunk_size=chunk)  # fmt: skip
        torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_ce, ce, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_l1, l1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(accept, (1 - l1 / 2).clamp(0, 1), rtol=1e-5, atol=1e-6)
        assert torch.equal(hits, logits.argmax(-1) == labels)
        got = torch.autograd.grad(total, [t for t in (hidden, bias, w2) if t is not None])
        for x, y in zip(got, grads, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_blocks_follow_the_reference_rules():
    """Anchors p < len-1 with p and p+1 supervised; slot k's label is the token at p+k+1, its
    previous token the one at p+k; weights exp(-k/4) on the contiguous supervised prefix inside the
    sequence, 0 after it; at most max_anchors per sequence."""
    batch = small_batch()
    ids, mask, offsets = batch.host
    for max_anchors in (3, 100):
        db = make_dspark_blocks(ids, mask, offsets, block_size=B, mask_token_id=V - 1, max_anchors=max_anchors,
                                generator=torch.Generator().manual_seed(1))  # fmt: skip
        blocks = db.blocks
        assert blocks.first_slot == 0 and torch.equal(blocks.input_ids[:, 1:], torch.full_like(blocks.input_ids[:, 1:],
                                                                                               V - 1))
        seqs, anchors = blocks.layout.block_seq.tolist(), blocks.layout.block_anchor.tolist()
        for s in range(3):
            start, end = int(offsets[s]), int(offsets[s + 1])
            mine = [a for q, a in zip(seqs, anchors, strict=True) if q == s]
            valid = [p for p in range(end - start - 1) if mask[start + p] and mask[start + p + 1]]
            assert set(mine) <= set(valid) and len(mine) == min(max_anchors, len(valid)) and mine == sorted(mine)
        for j, (s, a) in enumerate(zip(seqs, anchors, strict=True)):
            start, end = int(offsets[s]), int(offsets[s + 1])
            assert blocks.input_ids[j, 0] == ids[start + a] == db.prev_ids[j, 0]
            run = True
            for k in range(B):
                t = start + a + k + 1
                run = run and t < end and bool(mask[t])
                assert blocks.weights[j, k].item() == pytest.approx(float(torch.exp(torch.tensor(-k / 4.0))) if run
                                                                    else 0.0)  # fmt: skip
                if run:
                    assert blocks.labels[j, k] == ids[t] and db.prev_ids[j, k] == ids[t - 1] and db.rows[j, k] == t - 1


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_draft_runs_the_markov_head_on_the_tokens_it_drafts(head):
    """Decoding's logits at slot k are the training-time (teacher-forced) logits of the same block
    whose previous tokens are the ones drafted: the same head, fed its own drafts; B drafts."""
    torch.manual_seed(0)
    cfg = small_cfg(head)
    model = DSparkDrafter(cfg).eval()
    with torch.no_grad():
        model.markov_head.markov_w1.weight.mul_(100)  # a bias that changes the argmax
        model.markov_head.markov_w2.weight.mul_(100)
    weight = torch.randn(V, H) * 0.3
    ctx = torch.randn(11, 3 * H)
    layout = BlockLayout.build(torch.tensor([0, 11]), torch.zeros(1, dtype=torch.long), torch.tensor([11]), B)
    block = dspark.block_input(torch.tensor([7]), B, cfg.mask_token_id)
    assert block.tolist() == [[7] + [cfg.mask_token_id] * (B - 1)]
    seen = []

    def choose(logits):
        seen.append(logits)
        return logits.argmax(-1), torch.softmax(logits, -1)

    with torch.no_grad():
        hidden = model(torch.randn(V, H)[block[0]], ctx, layout)
        drafts, probs = dspark.draft(model, hidden[None], block, weight, choose)
        assert drafts.shape == (1, B) and probs.shape == (1, B, V)
        prev = torch.cat([block[:, :1], drafts[:, :-1]], dim=1)
        forced = hidden[None] @ weight.T + model.markov_head.markov_w2(model.markov_head.block(prev, hidden[None]))
    torch.testing.assert_close(torch.stack(seen, 1), forced)
    base = (hidden @ weight.T).argmax(-1)
    assert not torch.equal(drafts[0], base)  # the Markov head decided some drafts
    dflash = drafters.family("dflash")
    d_drafts, d_probs = dflash.draft(model, hidden[None], block, weight, lambda x: (x.argmax(-1), None))
    assert d_drafts.shape == (1, B - 1) and d_probs is None and torch.equal(d_drafts[0], base[1:])


def test_useful_flops_match_the_matrix_products_of_a_step():
    """Every linear product of a DSpark step (FlopCounterMode), against the count: the backbone's
    as for DFlash, the LM head on the drafted and on the target's states, the Markov bias and the
    confidence head. Attention (batched products) and the input gradient of the context's k/v
    projections are left out of both, as test_metrics does for DFlash."""
    cfg = small_cfg()
    torch.manual_seed(0)
    model = DSparkDrafter(cfg)
    batch = small_batch()
    embed, head = torch.randn(V, H), torch.randn(V, H)
    tcfg = TrainConfig(cache=Path("."), out=Path("."), drafter="dspark", max_anchors=512)
    with FlopCounterMode(display=False) as counter:
        out = dspark.objective(model, embed, head, batch, cfg, tcfg, torch.Generator().manual_seed(0))
        out.loss.backward()
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if "bmm" not in str(op))
    flops = dspark.DSparkFlops(model)
    layout = out.blocks.layout
    nb, anchors, scored = layout.num_blocks, int(layout.block_anchor.sum()), out.scored
    norms = sum(p.numel() for name, p in model.layers.named_parameters() if "norm" in name)
    kv = sum(a.self_attn.k_proj.weight.numel() + a.self_attn.v_proj.weight.numel() for a in model.layers)
    expected = flops(nb, batch.num_tokens, anchors, scored) - flops.attn * (anchors + nb * B) - 6 * norms * nb * B
    # the confidence head runs on every slot (the count takes the scored ones), and its input grad too
    conf = model.confidence_head.proj.weight.numel()
    assert matmuls == expected + 2 * kv * batch.num_tokens + 6 * conf * (nb * B - scored)


def _ddp_objective(w, out_dir):
    """Rank r's DSpark step on its own batch under DDP: the gradient that lands on every rank."""
    with process_group(w):
        torch.manual_seed(0)
        model = DSparkDrafter(small_cfg())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        embed, head = torch.randn(V, H), torch.randn(V, H)
        tcfg = TrainConfig(cache=Path("."), out=Path("."), drafter="dspark")
        batch = small_batch(seed=w.rank, lengths=(21, 14, 9) if w.rank == 0 else (30,))
        out = dspark.objective(ddp, embed, head, batch, small_cfg(), tcfg, torch.Generator().manual_seed(w.rank),
                               reduce=True)  # fmt: skip
        out.loss.backward()
        torch.save({k: p.grad for k, p in model.named_parameters()}, Path(out_dir) / f"rank{w.rank}.pt")
        del ddp


@pytest.mark.slow  # two gloo ranks
def test_ddp_sums_the_loss_denominator_over_the_ranks(tmp_path):
    """Two gloo ranks with batches of different weight: the reduced gradient is the gradient of
    the loss of both batches pooled (sum of the weighted terms over the sum of the weights), as
    the reference's, not the mean of the two ranks' own means."""
    launch(_ddp_objective, (tmp_path,), procs=2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    torch.manual_seed(0)
    model = DSparkDrafter(small_cfg())
    embed, head = torch.randn(V, H), torch.randn(V, H)
    tcfg = TrainConfig(cache=Path("."), out=Path("."), drafter="dspark")
    outs = [dspark.objective(model, embed, head, small_batch(seed=r, lengths=(21, 14, 9) if r == 0 else (30,)),
                             small_cfg(), tcfg, torch.Generator().manual_seed(r)) for r in (0, 1)]  # fmt: skip
    dens = [float(o.terms["ce"][1]) for o in outs]
    assert abs(dens[0] - dens[1]) > 1  # the two ranks weigh differently
    pooled = sum(o.loss * (d + DEN_EPS) for o, d in zip(outs, dens, strict=True)) / (sum(dens) + DEN_EPS)
    pooled.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[0][name], got[1][name])
        torch.testing.assert_close(got[0][name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- the train stage


def _cfg(cache, out, **kw) -> TrainConfig:
    return TrainConfig(cache=cache, out=out, **{"drafter": "dspark", "epochs": 1, "token_budget": 1024,
                                                "max_anchors": 16, "draft_layers": 1, "markov_rank": 16,
                                                "log_every": 1, "save_every": 4, "val_fraction": 0.2, **kw})


def test_train_validates_resumes_and_exports(final_cache, tmp_path):
    """A run logs every loss term, validates (DSpark's terms and acceptance), resumes to bitwise the
    weights of an uninterrupted run, and exports DeepSpec's layout, which the family loads back."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(_cfg(final_cache, whole, max_steps=8))
    train(_cfg(final_cache, parts, max_steps=4))
    train(_cfg(final_cache, parts, max_steps=8))  # resumes at step 4
    a, b = Checkpointer(whole).load(), Checkpointer(parts).load()
    assert a["step"] == b["step"] == 8 and a["model"].keys() == b["model"].keys()
    assert any(k.startswith("markov_head.") for k in a["model"]) and "confidence_head.proj.bias" in a["model"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    lines = jsonl_rows(whole / "metrics.jsonl")
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 9))
    assert all({"ce", "l1", "confidence", "tau_prob"} <= m.keys() and len(m["slot_acc"]) == 7 for m in steps)
    val = [m for m in lines if "val_loss" in m]
    assert val and {"val_ce", "val_l1", "val_confidence", "val_tau_prob", "val_accept_len"} <= val[-1].keys()
    assert 1.0 <= val[-1]["val_accept_len"] <= 8 and len(val[-1]["val_slot_acc"]) == 7
    record = json.loads((whole / "train.json").read_text())
    assert record["config"]["drafter"] == "dspark" and record["identity"]["drafter"] == "dspark"
    assert record["identity"]["block_size"] == 7 and record["drafter"]["architectures"] == ["Qwen3DSparkModel"]
    export = whole / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert {k: config[k] for k in ("block_size", "markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov")} == {
        "block_size": 7, "markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True}  # fmt: skip
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "dflash.py", "dspark.py", "model.safetensors"]
    model, cfg, family = drafters.load_serving(export)
    assert family.name == "dspark" and cfg.markov_rank == 16 and type(model) is DSparkDrafter
    # dflash eval decodes it as any family: the target's greedy output, steps of up to B + 1 tokens
    from dflash_cache.eval.config import EvalConfig
    from dflash_cache.eval.decode import evaluate

    r = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=export, data=str(ROOT / "data" / "prompts.jsonl"),
                            limit=3, max_new_tokens=16))  # fmt: skip
    assert r.settings["drafter_family"] == "dspark" and all(s["same_as_target"] for s in r.samples)
    assert len(r.histogram) == 8 and sum(r.histogram) == r.steps
    assert r.settings["block_size"] == 7 and r.lookup["block_size"] == 8  # prompt lookup drafts 7 a step too
    # a changed DSpark setting is another run
    with pytest.raises(TrainError, match="markov_rank"):
        train(_cfg(final_cache, whole, max_steps=8, markov_rank=8))


def test_export_loads_through_remote_code_and_decodes_losslessly(final_cache, tmp_path):
    """The export loads with AutoModel.from_pretrained(trust_remote_code=True) in a process that never
    imports dflash_cache, holds the trained weights, and its spec_generate reproduces the target's
    own greedy decoding."""
    run_dir = tmp_path / "run"
    train(_cfg(final_cache, run_dir, max_steps=3, val_fraction=0.0, markov_head="rnn"))
    export = export_run(run_dir, tmp_path / "again")  # `dflash export`: the cache is still there
    script = r"""
import json, sys, torch
from transformers import AutoModel, AutoModelForCausalLM
draft = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
assert type(draft).__name__ == "Qwen3DSparkModel", type(draft)
target = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).eval()
prompt = torch.tensor([[5, 17, 99, 4, 230, 31, 8, 77, 12]])
out = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=24, stop_token_ids=[], temperature=0.0)
ref = target.generate(prompt, max_new_tokens=24, do_sample=False)
assert not any(m.startswith("dflash_cache") for m in sys.modules)
print(json.dumps({"same": out[0].tolist() == ref[0].tolist(), "keys": sorted(draft.state_dict())}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_MODULES_CACHE": str(tmp_path / "m")}
    res = subprocess.run([sys.executable, "-c", script, str(export), str(TINY_TARGET)], capture_output=True,
                         text=True, cwd=tmp_path, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["same"]
    assert {"markov_head.joint_proj.weight", "embed_tokens.weight", "lm_head.weight"} <= set(got["keys"])
    model, _, _ = drafters.load_serving(export)
    trained = Checkpointer(run_dir).load()["model"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k].bfloat16()), k


@pytest.mark.slow  # a CLI train refused, then a DFlash run
def test_refusals(final_cache, tmp_path, tiny_cache):
    """DSpark on a cache without the final hidden state, an unknown family, and a confidence head
    on the Markov features without a Markov head: one line each, naming what to change."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "cli.main", "train", "--cache", str(tiny_cache), "--out", str(tmp_path / "r")]
    res = subprocess.run([*base, "--drafter", "dspark"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "--final-hidden" in res.stdout + res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    with pytest.raises(TrainError, match="unknown drafter family 'eagle9'; known: dflash, dspark"):
        train(_cfg(final_cache, tmp_path / "x", drafter="eagle9"))
    with pytest.raises(TrainError, match="confidence_head_with_markov"):
        train(_cfg(final_cache, tmp_path / "x", markov_rank=0))
    # DFlash trains on the same cache as before, without reading the final state
    train(TrainConfig(cache=final_cache, out=tmp_path / "dflash", epochs=1, max_steps=2, draft_layers=1,
                      token_budget=1024, max_anchors=8))  # fmt: skip
    assert json.loads((tmp_path / "dflash" / "export" / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"]


def test_block_proposer_drafts_as_the_training_forward_does():
    """generate's BlockProposer (each row's context keys and values written into its slots, the
    block attending to them) drafts, for both families, what the family's `draft` makes of the
    model's training forward over one block whose context is every position before it; DFlash
    drafts B - 1 tokens a block, DSpark B."""
    from dflash_cache.drafters.dflash.model import DFlashDrafter
    from dflash_cache.generate import BlockProposer
    from dflash_cache.generate.requests import Chooser

    torch.manual_seed(0)
    dcfg = DrafterConfig.from_target(GEOMETRY, target_layer_ids=[1, 3, 5], mask_token_id=V - 1, num_draft_layers=2,
                                     block_size=6)  # fmt: skip
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    ctx = torch.randn(20, 3 * H)
    anchors, last = [13, 7], torch.tensor([17, 4])
    for name, model, cfg in (("dflash", DFlashDrafter(dcfg).eval(), dcfg), ("dspark", DSparkDrafter(small_cfg()).eval(),
                                                                            small_cfg())):  # fmt: skip
        family = drafters.family(name)
        want = []
        with torch.no_grad():
            for a, t in zip(anchors, last.tolist(), strict=True):
                block = family.block_input(torch.tensor([t]), cfg.block_size, cfg.mask_token_id)
                layout = BlockLayout.build(torch.tensor([0, a]), torch.zeros(1, dtype=torch.long), torch.tensor([a]),
                                           cfg.block_size)  # fmt: skip
                hidden = model(embed(block[0]), ctx[:a], layout, attention="sdpa")
                drafts, _ = family.draft(model, hidden[None], block, head.weight, Chooser(0.0))
                want.append(drafts[0])
            proposer = BlockProposer(model, embed=embed.weight, head=head.weight, slots=2, length=32, family=family)
            for row, a in enumerate(anchors):
                proposer.add_context(ctx[None, :a], torch.arange(a)[None], torch.tensor([row]))
            got, probs = proposer.propose(last, torch.tensor(anchors), Chooser(0.0))
        assert torch.equal(got, torch.stack(want)) and probs is None
        assert got.shape[1] == (cfg.block_size - 1 if name == "dflash" else cfg.block_size)


def markov_case(device: torch.device | str, lookup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fused Markov step's tokens, the argmax of the logits it rounds as torch does, computed
    apart) on integer operands, so that every summation order gives the same float32 sums and the
    first of equal maxima decides (every logit comes twice, the second in another program's rows);
    a vocabulary and a rank that are not multiples of the kernel's blocks; base logits as a strided
    slot of a block. `lookup`: the latents are rows of a table the kernel reads through a strided
    index (the vanilla head's W1[prev])."""
    from dflash_cache.kernels.markov import markov_argmax
    from dflash_cache.kernels.tiles import DEFAULT_MARKOV_TILES

    g = torch.Generator().manual_seed(0)
    block_v, block_r = DEFAULT_MARKOV_TILES.block_v, DEFAULT_MARKOV_TILES.block_r
    rows, vocab, rank, period = 3, 3 * block_v + 17, block_r + 32, block_v + 5
    block = torch.randint(-8, 9, (rows, 4, period), generator=g).repeat(1, 1, 4)[..., :vocab].bfloat16().to(device)
    z = torch.randint(-2, 3, (rows, rank), generator=g).bfloat16().to(device)
    w2 = torch.randint(-2, 3, (period, rank), generator=g).repeat(4, 1)[:vocab].bfloat16().to(device)
    base = block[:, 2]
    logits = (base.float() + (z.float() @ w2.float().T).bfloat16().float()).bfloat16().float()
    assert all((row == row.max()).sum() > 1 for row in logits), "the case needs tied maxima"
    if not lookup:
        return markov_argmax(base, z, w2), logits.argmax(-1)
    table = torch.randint(-2, 3, (11, rank), generator=g).bfloat16().to(device)
    at = torch.tensor([[9, 0], [2, 0], [5, 0]], device=device)[:, 0]  # strided, as block_ids[:, 0] is
    table[at] = z
    return markov_argmax(base, table, w2, at), logits.argmax(-1)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("lookup", [False, True], ids=["latents", "table rows"])
def test_markov_kernel_gives_torchs_argmax_of_the_same_logits(lookup):
    """The fused Markov step under Triton's interpreter (`markov_case`); tests/test_gpu.py runs it
    compiled, where the first of equal maxima is the GPU's reduction's to get right."""
    got, want = markov_case("cpu", lookup)
    assert torch.equal(got, want)


@pytest.mark.usefixtures("triton_interpreter")
def test_a_greedy_half_precision_draft_takes_the_markov_kernel():
    """A bf16 DSpark drafter drafting greedily through the engine's chooser runs each slot's Markov
    step as the fused kernel, and drafts what the tensor ops' argmax drafts (integer Markov weights:
    the same sums in any order)."""
    from dflash_cache.generate.requests import Chooser, DraftChooser
    from dflash_cache.kernels import markov as markov_kernel

    torch.manual_seed(0)
    cfg = small_cfg("vanilla")
    model = DSparkDrafter(cfg).eval()
    with torch.no_grad():
        head = model.markov_head
        head.markov_w1.weight.copy_(torch.randint(-3, 4, head.markov_w1.weight.shape))
        head.markov_w2.weight.copy_(torch.randint(-3, 4, head.markov_w2.weight.shape))
    model = model.bfloat16()
    weight = (torch.randn(V, H) * 0.3).bfloat16()
    block = dspark.block_input(torch.tensor([7, 30]), B, cfg.mask_token_id)
    hidden = torch.randn(2, B, H).bfloat16()
    calls = []

    def spy(*args):
        calls.append(args)
        return markov_kernel.markov_argmax(*args)

    with torch.no_grad():
        want, _ = dspark.draft(model, hidden, block, weight, lambda x: (x.argmax(-1), None))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dspark, "markov_kernel", SimpleNamespace(fits=markov_kernel.fits, markov_argmax=spy))
            got, probs = dspark.draft(model, hidden, block, weight, DraftChooser(Chooser(0.0), torch.zeros(2).long()))
    assert len(calls) == B and probs is None
    assert torch.equal(got, want)
