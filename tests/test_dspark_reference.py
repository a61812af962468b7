"""The DSpark family against the references' own code, on the same weights and the same batch:
DeepSpec (deepseek-ai/DeepSpec, the paper's code) and SpecForge 0.2.0's `dspark`.

Both are imported at run time and never vendored: SpecForge from its pip package (`pip install
--no-deps specforge==0.2.0`), DeepSpec from a checkout named by DEEPSPEC_SRC (it has no package).
A test whose reference cannot be imported is skipped; `.ci/run` installs both.

Checked within float32 rounding: the block logits (backbone, LM head and Markov bias), the
labels and the trained-slot mask, every loss term (CE, L1, confidence BCE) and the probabilistic
tau, the total loss, every parameter's gradient, the head types (vanilla, gated, rnn), and the
DeepSpec evaluator's greedy speculative decode against the family's `draft`, step by step."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import pypi_package
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_cache import drafters
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dspark import family as dspark
from dflash_cache.drafters.dspark.config import DSparkConfig
from dflash_cache.drafters.dspark.model import DSparkDrafter
from dflash_cache.drafters.dspark.objective import make_dspark_blocks
from dflash_cache.train.config import TrainConfig

H, V, K, B, R = 32, 101, 3, 5, 8
TARGET = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 8, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "vocab_size": V, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu"}  # fmt: skip
LAYERS, MASK_ID, LENGTHS, ANCHORS = [1, 3, 5], V - 1, [23, 17], 9
TOL = {"rtol": 2e-5, "atol": 2e-5}


def deepspec():
    """DeepSpec's modules (from DEEPSPEC_SRC), or a skip."""
    src = os.environ.get("DEEPSPEC_SRC")
    if src and src not in sys.path:
        sys.path.insert(0, src)
    try:
        import deepspec.eval.dspark.evaluator as evaluator
        import deepspec.modeling.dspark.loss as loss
        import deepspec.modeling.dspark.qwen3.modeling as modeling
        from deepspec.utils import metrics
    except ImportError as e:
        pytest.skip(f"DeepSpec is not importable ({e}); set DEEPSPEC_SRC to a checkout of deepseek-ai/DeepSpec")
    return SimpleNamespace(modeling=modeling, loss=loss, metrics=metrics, evaluator=evaluator)


def specforge():
    pypi_package("specforge", "0.2.0")
    try:
        from specforge.algorithms.common import dflash_family_model
        from specforge.modeling.draft.dspark import DSparkDraftModel
    except ImportError as e:
        pytest.fail(f"SpecForge 0.2.0 does not import ({e})")
    return SimpleNamespace(model=dflash_family_model, draft=DSparkDraftModel)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A gloo group of one rank: the references reduce their loss denominators over it."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def dcfg_for(head: str = "vanilla", **overrides) -> DSparkConfig:
    from dflash_cache.drafters.dflash.config import DrafterConfig

    base = DrafterConfig.from_target(TARGET, target_layer_ids=LAYERS, mask_token_id=MASK_ID, num_draft_layers=2,
                                     block_size=B)  # fmt: skip
    import dataclasses

    return DSparkConfig(**dataclasses.asdict(base), markov_rank=R, markov_head_type=head, **overrides)


def batch_for(seed: int = 0) -> SimpleNamespace:
    """Two packed sequences: the prompt unsupervised, and a hole in the first one's supervision so
    that blocks stop their trained prefix inside the sequence too."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    ids = torch.randint(0, V - 1, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:4] = False
    mask[12:14] = False
    mask[LENGTHS[0] : LENGTHS[0] + 3] = False
    return SimpleNamespace(host=(ids, mask, torch.tensor([0, LENGTHS[0], n])), input_ids=ids, num_tokens=n,
                           context=torch.randn(n, K * H, generator=g), final=torch.randn(n, H, generator=g) * 2)


def frozen(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.5


def ours(dcfg: DSparkConfig, seed: int = 2) -> DSparkDrafter:
    torch.manual_seed(seed)
    model = DSparkDrafter(dcfg)
    with torch.no_grad():  # norms away from 1 and a larger Markov bias, so that every weight matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "markov" in name:
                p.mul_(8)
    return model


def padded(batch: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
    """Packed rows [n, ...] -> [2, S, ...], zero padded on the right."""
    S = max(LENGTHS)
    out = x.new_zeros((len(LENGTHS), S, *x.shape[1:]))
    start = 0
    for s, ln in enumerate(LENGTHS):
        out[s, :ln] = x[start : start + ln]
        start += ln
    return out


def anchors_of(layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Our blocks' anchors as the references lay them out: [sequences, most blocks], with a keep mask."""
    seq, anchor = layout.block_seq, layout.block_anchor
    n = max(int((seq == s).sum()) for s in range(len(LENGTHS)))
    anchors = torch.zeros(len(LENGTHS), n, dtype=torch.long)
    keep = torch.zeros(len(LENGTHS), n, dtype=torch.bool)
    for s in range(len(LENGTHS)):
        a = anchor[seq == s]
        anchors[s, : len(a)], keep[s, : len(a)] = a, True
    return anchors, keep


def blockwise(x: torch.Tensor, layout: BlockLayout, keep: torch.Tensor) -> torch.Tensor:
    """The references' [sequences, blocks, ...] rows of our blocks, in our order."""
    rows = [x[s, : int(keep[s].sum())] for s in range(len(LENGTHS))]
    return torch.cat(rows)


def our_run(model, dcfg, batch, embed, head, chunk=7):
    """Our objective (training mode, one rank), its full-vocabulary block logits (for the check)
    and the blocks it drew."""
    cfg = TrainConfig(cache=Path("."), out=Path("."), drafter="dspark", max_anchors=ANCHORS, loss_chunk=chunk)
    out = dspark.objective(model, embed, head, batch, dcfg, cfg, torch.Generator().manual_seed(5), reduce=True)
    db = make_dspark_blocks(*batch.host, block_size=B, mask_token_id=MASK_ID, max_anchors=ANCHORS,
                            generator=torch.Generator().manual_seed(5))  # the same draw as the objective's  # fmt: skip
    with torch.no_grad():
        hidden, z, _ = model(F.embedding(db.blocks.input_ids.flatten(), embed), batch.context, db.blocks.layout,
                             prev_ids=db.prev_ids)  # fmt: skip
        logits = hidden @ head.T
        if z is not None:
            logits = logits + model.markov_head.markov_w2(z)
    return out, logits.view(-1, B, V), db


def deepspec_model(ds, dcfg: DSparkConfig, model: DSparkDrafter, embed, head, attn: str):
    config = Qwen3Config(**{k: v for k, v in TARGET.items() if k != "model_type"})
    config.num_target_layers, config.num_hidden_layers, config.block_size = 8, 2, B
    config.layer_types = ["full_attention"] * 2
    config.target_layer_ids, config.mask_token_id, config.num_anchors = LAYERS, MASK_ID, ANCHORS
    config.markov_rank, config.markov_head_type = dcfg.markov_rank, dcfg.markov_head_type
    config.enable_confidence_head, config.confidence_head_with_markov = True, dcfg.confidence_head_with_markov
    config._attn_implementation = attn
    ref = ds.modeling.Qwen3DSparkModel(config).float()
    state = {**model.state_dict(), "embed_tokens.weight": embed, "lm_head.weight": head}
    assert set(state) == set(ref.state_dict()), "the weight names are DeepSpec's"
    ref.load_state_dict(state, strict=True)
    return ref


def _dense_flex(monkeypatch):
    """The reference trains with flex attention, which has no backward on a CPU. Its BlockMask
    carries the reference's own mask rule (`mask_mod`): evaluated on every (query, key) pair, it
    gives the same attention through SDPA, with gradients."""
    from transformers.integrations import flex_attention as hf_flex

    def attend(q, k, v, training=False, *, block_mask, scale=None, enable_gqa=False, **_):
        b, _, nq, _ = q.shape
        qi, ki = torch.arange(nq)[:, None], torch.arange(k.shape[2])[None, :]
        mask = torch.stack([block_mask.mask_mod(torch.tensor(i), torch.tensor(0), qi, ki) for i in range(b)])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", attend)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_training_forward_loss_and_gradients_equal_deepspec(head_type, one_rank_group, monkeypatch):
    ds = deepspec()
    _dense_flex(monkeypatch)
    dcfg = dcfg_for(head_type)
    batch, (embed, head) = batch_for(), frozen()
    model = ours(dcfg)
    out, logits, db = our_run(model, dcfg, batch, embed, head)
    ref = deepspec_model(ds, dcfg, model, embed, head, "flex_attention")
    anchors, keep = anchors_of(db.blocks.layout)
    monkeypatch.setattr(ds.modeling, "sample_anchor_positions", lambda **kw: (anchors, keep))
    ds.metrics._metrics.clear()
    r = ref(input_ids=padded(batch, batch.input_ids), target_hidden_states=padded(batch, batch.context),
            loss_mask=padded(batch, batch.host[1].float()), target_last_hidden_states=padded(batch, batch.final))
    # the layout: the same labels, the same trained slots (the cumprod prefix), the same logits
    trained = db.blocks.weights > 0
    assert torch.equal(blockwise(r.eval_mask, db.blocks.layout, keep), trained)
    assert torch.equal(blockwise(r.target_ids, db.blocks.layout, keep)[trained], db.blocks.labels[trained])
    assert (db.blocks.weights > 0).sum() > 20 and not (db.blocks.weights > 0).all()
    # (an untrained slot past a sequence's end has another previous token there: the padding's)
    torch.testing.assert_close(blockwise(r.draft_logits, db.blocks.layout, keep)[trained], logits[trained], **TOL)
    # every loss term, and the total
    loss = ds.loss.compute_dspark_loss(outputs=r, loss_decay_gamma=dspark.GAMMA, ce_loss_alpha=dcfg.ce_alpha,
                                       l1_loss_alpha=dcfg.l1_alpha, confidence_head_alpha=dcfg.confidence_alpha)
    terms = {name: entry["num"][0] / entry["den"][0] for name, entry in ds.metrics._metrics.items()
             if entry["kind"] == "ratio" and entry["num"]}  # fmt: skip
    for ours_name, ref_name in (("ce", "train/ce_loss"), ("l1", "train/l1_loss"),
                                ("confidence", "train/confidence_loss"), ("tau_prob", "train/tau_probabilistic")):
        num, den = out.terms[ours_name]
        torch.testing.assert_close((num / den).float(), terms[ref_name].float(), **TOL)
    torch.testing.assert_close(out.loss, loss, **TOL)
    # the gradients of every trained weight
    out.loss.backward()
    loss.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is not None for p in model.parameters())


def _crop_to_length(monkeypatch):
    """DeepSpec pins transformers 5.10, where `cache.crop(n)` keeps the first n positions; 5.24
    takes only negative counts. The same semantics, for its evaluator loop."""
    from transformers.cache_utils import DynamicCache

    crop = DynamicCache.crop

    def keep(self, n):
        return crop(self, n if n < 0 else n - self.get_seq_length()) if n != self.get_seq_length() else None

    monkeypatch.setattr(DynamicCache, "crop", keep)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_greedy_decode_equals_deepspecs_evaluator(head_type, one_rank_group, monkeypatch):
    """Batch-1 greedy speculative decoding: DeepSpec's evaluator loop (its propose, verify and
    update) against the family's `block_input` + backbone + `draft`, on the same drafter weights
    and the same target: every step's drafted tokens, acceptance and the output."""
    ds = deepspec()
    _crop_to_length(monkeypatch)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TARGET.items() if k != "model_type"},
                                          tie_word_embeddings=False)).eval()  # fmt: skip
    target.config._attn_implementation = "sdpa"
    dcfg = dcfg_for(head_type)
    model = ours(dcfg).eval()
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    ref = deepspec_model(ds, dcfg, model, embed, head, "sdpa").eval()
    prompt = torch.randint(0, V - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    steps: list[tuple[list[int], list[int]]] = []  # (reference drafts, ours) per proposal

    ev = object.__new__(ds.evaluator.Qwen3DSparkEvaluator)
    ev.draft_model, ev.args = ref, SimpleNamespace(temperature=0.0, confidence_threshold=0.0)

    def propose(context, output_ids, position_ids, start, stop_token_ids=None):
        proposal = ev._propose(context=context, output_ids=output_ids, position_ids=position_ids, start=start)
        mine = our_draft(model, target, output_ids[0, : start + 1])
        steps.append((proposal.verify_input_ids[0, 1:].tolist(), mine))
        return proposal

    with torch.no_grad():
        result = ds.evaluator.generate_decoding_sample(
            target_model=target, input_ids=prompt, max_new_tokens=24, max_proposal_tokens=B, temperature=0.0,
            stop_token_ids=None, init_context=ev._init_context, propose=propose, update=ev._update)  # fmt: skip
        greedy = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert len(steps) >= 4
    for i, (theirs, mine) in enumerate(steps):
        assert theirs == mine, f"step {i}: DeepSpec drafted {theirs}, ours {mine}"
    assert torch.equal(result.output_ids[0], greedy[0, : result.output_ids.shape[1]])  # lossless
    assert max(result.acceptance_lengths) > 1  # some drafts were accepted: the comparison has teeth


def our_draft(model: DSparkDrafter, target, ids: torch.Tensor) -> list[int]:
    """The family's proposals for the position after ids[-1] (the anchor), the target's tapped states
    of every earlier position as context: block_input -> backbone on one block -> draft (greedy)."""
    p = ids.shape[0] - 1
    out = target(ids[None, :p], output_hidden_states=True)
    context = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
    block = dspark.block_input(ids[-1:], B, MASK_ID)
    layout = BlockLayout.build(torch.tensor([0, p]), torch.zeros(1, dtype=torch.long), torch.tensor([p]), B)
    embed = target.get_input_embeddings()
    hidden = model(embed(block[0]), context, layout, attention="sdpa")
    drafts, probs = dspark.draft(model, hidden[None], block, target.get_output_embeddings().weight,
                                 lambda logits: (logits.argmax(-1), None))  # fmt: skip
    assert probs is None and drafts.shape == (1, B)
    return drafts[0].tolist()


def test_training_forward_and_loss_equal_specforge(monkeypatch, tmp_path):
    """SpecForge 0.2.0's OnlineDSparkModel (its dense SDPA path): labels, trained slots, loss terms,
    total loss and gradients on the same weights and anchors."""
    sf = specforge()
    dcfg = dcfg_for()
    batch, (embed, head) = batch_for(1), frozen(4)
    model = ours(dcfg, seed=6)
    out, _, db = our_run(model, dcfg, batch, embed, head, chunk=1000)
    config = Qwen3Config(**{k: v for k, v in TARGET.items() if k != "model_type"})
    config.num_target_layers, config.num_hidden_layers, config.block_size = 8, 2, B
    config.layer_types = ["full_attention"] * 2
    config.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": LAYERS, "markov_rank": R,
                            "markov_head_type": "vanilla", "enable_confidence_head": True,
                            "confidence_head_with_markov": True, "projector_type": "dspark"}  # fmt: skip
    draft = sf.draft(config).float()
    mine = model.state_dict()
    assert set(mine) == set(draft.state_dict()), "the weight names are SpecForge's"
    draft.load_state_dict(mine, strict=True)
    draft.save_pretrained(tmp_path / "specforge")  # a SpecForge checkpoint loads as a DSpark drafter
    loaded, loaded_cfg, family = drafters.load_serving(tmp_path / "specforge")
    assert family.name == "dspark" and (loaded_cfg.markov_rank, loaded_cfg.block_size) == (R, B)
    assert loaded_cfg.enable_confidence_head and loaded_cfg.confidence_head_with_markov
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    lm_head, embed_tokens = torch.nn.Linear(H, V, bias=False), torch.nn.Embedding(V, H)
    with torch.no_grad():
        lm_head.weight.copy_(head)
        embed_tokens.weight.copy_(embed)
    ref = sf.model.OnlineDSparkModel(draft, lm_head.requires_grad_(False), embed_tokens.requires_grad_(False),
                                     mask_token_id=MASK_ID, block_size=B, attention_backend="sdpa",
                                     num_anchors=ANCHORS, loss_decay_gamma=dspark.GAMMA)  # fmt: skip
    anchors, keep = anchors_of(db.blocks.layout)
    monkeypatch.setattr(ref, "_sample_anchor_positions", lambda *a, **kw: (anchors, keep))
    loss, _, metrics = ref(input_ids=padded(batch, batch.input_ids), hidden_states=padded(batch, batch.context),
                           loss_mask=padded(batch, batch.host[1].float()),
                           target_last_hidden_states=padded(batch, batch.final))  # fmt: skip
    ratios = metrics["ratio_metrics"]
    for ours_name, ref_name in (("ce", "ce_loss"), ("l1", "l1_loss"), ("confidence", "confidence_loss"),
                                ("tau_prob", "tau_probabilistic")):  # fmt: skip
        num, den = out.terms[ours_name]
        ref_num, ref_den = ratios[ref_name]
        torch.testing.assert_close((num / den).float(), (ref_num / ref_den).float(), **TOL)
    torch.testing.assert_close(out.loss, loss, **TOL)
    out.loss.backward()
    loss.backward()
    grads = dict(draft.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_export_is_deepspecs_checkpoint_layout(tmp_path):
    """DeepSpec's own `Qwen3DSparkModel.from_pretrained` (what its eval.py loads) reads the export with
    no missing and no unexpected weight, the target's embedding and LM head included."""
    ds = deepspec()
    dcfg = dcfg_for("gated")
    model = ours(dcfg)
    embed, head = frozen()
    dspark.save_serving(model, dcfg, tmp_path / "export", frozen=(embed, head))
    ref, info = ds.modeling.Qwen3DSparkModel.from_pretrained(tmp_path / "export", dtype=torch.float32,
                                                             output_loading_info=True)  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (ref.block_size, ref.mask_token_id, list(ref.target_layer_ids)) == (B, MASK_ID, LAYERS)
    assert ref.markov_head.markov_head_type == "gated" and ref.confidence_head_with_markov
    state = ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v.bfloat16().float(), rtol=0, atol=0, msg=k)
    torch.testing.assert_close(state["lm_head.weight"], head.bfloat16().float(), rtol=0, atol=0)
