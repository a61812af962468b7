"""Hybrid targets (Qwen3.5 / Qwen3.6, Qwen3-Next): gated delta-net (linear attention) layers beside
full-attention ones, through every stage.

The fixtures (conftest's `hybrid_targets`, from family_targets.py) are the two layouts a
user has: a text-only `Qwen3_5ForCausalLM`, and the multimodal `Qwen3_5ForConditionalGeneration`
checkpoint the hub publishes (nested `text_config`, `model.language_model.*` weights, a vision
tower and an `mtp.*` head). Cached states are checked against `output_hidden_states` of the model
as its own class loads it (the multimodal one through `AutoModelForImageTextToText`), replies
against a greedy decode that recomputes the whole sequence every step.
"""

from __future__ import annotations

import json
import shutil

import family_targets as fam
import numpy as np
import pytest
import torch
from helpers import extract_config, jsonl_rows, read_cache
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from dflash_cache.bench import shapes as bench
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import read_frozen
from dflash_cache.drafters.attention import BlockLayout
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.family import load_serving
from dflash_cache.eval.config import EvalConfig
from dflash_cache.extract import stage as extract_stage
from dflash_cache.generate import Request
from dflash_cache.pipelines.config import RegenConfig
from dflash_cache.target.config import text_config
from dflash_cache.target.load import TargetError, frozen_weights, load_causal_lm, load_config, target_info
from dflash_cache.target.taps import decoder_layers, load_target
from dflash_cache.train import stage as train_stage
from dflash_cache.train.config import TrainConfig

HYBRIDS = fam.HYBRIDS
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The linear layers' torch path is many small ops, which thrash on shared cores with more threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_model(path) -> nn.Module:
    """The target as its own class loads it: the multimodal checkpoint as Qwen3_5ForConditionalGeneration."""
    multimodal = AutoConfig.from_pretrained(path).model_type == "qwen3_5"
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def hidden_states(model: nn.Module, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states


def write_rows(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -------------------------------------------------------------------------------------------------
# The fixtures are laid out like the real checkpoints and load as our code loads targets
# -------------------------------------------------------------------------------------------------


def test_layouts_are_the_hub_checkpoints(hybrid_targets):
    vl = json.loads((hybrid_targets["qwen3_5_vl"] / "config.json").read_text())
    assert vl["architectures"] == ["Qwen3_5ForConditionalGeneration"] and vl["model_type"] == "qwen3_5"
    assert vl["text_config"]["model_type"] == "qwen3_5_text" and vl["vision_config"]["out_hidden_size"] == 64
    text = json.loads((hybrid_targets["qwen3_5"] / "config.json").read_text())
    assert text["architectures"] == ["Qwen3_5ForCausalLM"] and text["model_type"] == "qwen3_5_text"
    for tc in (vl["text_config"], text):
        assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
            "full_attention"
        ]
        assert tc["rope_parameters"]["partial_rotary_factor"] == 0.25 and tc["rope_parameters"]["mrope_section"]

    def prefixes(path) -> set[str]:
        return {".".join(k.split(".")[:2]) for k in load_file(path / "model.safetensors")}

    mtp = {f"mtp.{k}" for k in ("fc", "layers", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")}
    assert prefixes(hybrid_targets["qwen3_5_vl"]) == {"lm_head.weight", "model.language_model", "model.visual", *mtp}
    assert prefixes(hybrid_targets["qwen3_5"]) == {"lm_head.weight", "model.embed_tokens", "model.layers", "model.norm"}
    vl_keys = load_file(hybrid_targets["qwen3_5_vl"] / "model.safetensors")
    assert "model.language_model.layers.0.linear_attn.A_log" in vl_keys
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in vl_keys and "mtp.fc.weight" in vl_keys


@pytest.mark.parametrize("family", HYBRIDS)
def test_loads_as_our_code_loads_targets(hybrid_targets, family):
    """AutoConfig gives the nested config, which text_config() opens; AutoModelForCausalLM loads the
    multimodal checkpoint as its text model (Qwen3_5ForCausalLM, the vision tower and mtp head
    skipped), with the same weights as the multimodal class, and every one from the checkpoint."""
    path = hybrid_targets[family]
    config = load_config(str(path))
    assert ("text_config" in config) == (family == "qwen3_5_vl")
    tc = text_config(config)
    info = target_info(str(path), None, config, torch.float32)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (8, 64, tc["vocab_size"])
    assert info.tied_embeddings is False and info.config["layer_types"] == tc["layer_types"]

    model = load_causal_lm(str(path), torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.tensor([AutoTokenizer.from_pretrained(path)("Ila the lamplighter lives in Harrow Pier.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference_model(path)(input_ids=ids).logits)
    embed, head = frozen_weights(model)
    assert head is not None and not torch.equal(embed, head)


def test_qwen3_5_template_opens_the_think_block(hybrid_targets):
    """Qwen3.5 renders turns as Qwen3 does; its generation prompt opens `<think>` unless thinking is off."""
    tok = AutoTokenizer.from_pretrained(hybrid_targets["qwen3_5_vl"])
    qwen3 = fam.build_tokenizer("qwen3")
    for row in fam.example_rows("qwen3_5"):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["response"]}]  # fmt: skip
        assert tok.apply_chat_template(messages, tokenize=False) == qwen3.apply_chat_template(messages, tokenize=False)
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    head = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True) == head + "<think>\n"
    assert tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True, enable_thinking=False) == (
        head + "<think>\n\n</think>\n\n"
    )
    # a reply generated after the opened block, once it closes it, renders back as prompt + reply
    reply = "Add the tens.\n</think>\n\n4."
    whole = tok.apply_chat_template([*ask, {"role": "assistant", "content": reply}], tokenize=False)
    assert whole == head + "<think>\n" + reply + "<|im_end|>\n"
    assert tok.mask_token is None and len(tok) < AutoConfig.from_pretrained(hybrid_targets["qwen3_5"]).vocab_size


# -------------------------------------------------------------------------------------------------
# Taps on a cut hybrid: layer id l is hidden_states[l + 1], in right-padded batches
# -------------------------------------------------------------------------------------------------


def _qwen3_next(path) -> None:
    """A tiny random Qwen3-Next (the first hybrid: gated delta-net and full attention, MoE MLPs)."""
    cfg = AutoConfig.for_model("qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


@pytest.mark.parametrize("family", [*HYBRIDS, "qwen3_next"])
def test_taps_of_the_cut_target_are_its_hidden_states(hybrid_targets, family, tmp_path):
    if family == "qwen3_next":
        _qwen3_next(tmp_path / family)
    path = hybrid_targets.get(family, tmp_path / family)
    layer_ids = [0, 2, 3, 5]  # linear and full-attention layers; layers 6 (linear) and 7 (full) are cut off
    tapped, _, _ = load_target(str(path), layer_ids, CPU)
    kept = decoder_layers(tapped.base, 6)[2]
    kinds = text_config(load_config(str(path)))["layer_types"]
    assert ["linear_attention" if hasattr(x, "linear_attn") else "full_attention" for x in kept] == kinds[:6]
    assert isinstance(tapped.base.norm, nn.Identity)

    reference = reference_model(path)
    rows = [list(range(7, 47)), list(range(100, 117))]  # right-padded to 40 tokens in one batch
    batch = torch.tensor([r + [0] * (40 - len(r)) for r in rows])
    got = tapped(batch)
    for b, row in enumerate(rows):
        want = hidden_states(reference, row)
        for k, lid in enumerate(layer_ids):
            torch.testing.assert_close(got[k][b, : len(row)], want[lid + 1][0], rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# extract -> train -> eval on both layouts; regen
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=HYBRIDS)
def pipeline(request, hybrid_targets, tmp_path_factory) -> dict:
    """A cache of the family's example rows (default layers 1-5: linear and full attention) and a
    drafter trained on it for a few steps."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = hybrid_targets[family]
    rows = fam.example_rows(family)
    data = write_rows(root / "rows.jsonl", rows)
    cache = root / "cache"
    summary = extract_stage.run(extract_config(cache, target=str(target), data=str(data), unit_mb=1, token_budget=512))
    run = root / "run"
    train_stage.run(TrainConfig(cache=cache, out=run, epochs=2, token_budget=256, max_anchors=8, draft_layers=1,
                                block_size=4, log_every=1))  # fmt: skip
    return {"family": family, "target": target, "rows": rows, "data": data, "cache": cache, "summary": summary,
            "run": run}  # fmt: skip


def test_extract_caches_the_targets_hidden_states(pipeline):
    target, cache = pipeline["target"], pipeline["cache"]
    spec = read_spec(cache)
    tok = AutoTokenizer.from_pretrained(target)
    assert pipeline["summary"]["rejected"] == 0 and spec.layers.ids == [1, 2, 3, 4, 5]
    assert spec.target.model_type == ("qwen3_5" if pipeline["family"] == "qwen3_5_vl" else "qwen3_5_text")
    assert spec.tokenizer.mask_token_id == len(tok) < spec.target.vocab_size  # the first spare row

    reference = reference_model(target)
    cached = read_cache(cache)
    assert sorted(cached) == list(range(len(pipeline["rows"])))
    H = spec.target.hidden_size
    by_length = sorted(cached, key=lambda s: len(cached[s][1]))
    n = len(by_length)
    for s in {by_length[0], by_length[n // 3], by_length[2 * n // 3], by_length[-1]}:  # shortest, longest, 2 between
        bits, ids, mask, _ = cached[s]
        row = pipeline["rows"][s]
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                           {"role": "assistant", "content": row["response"]}]  # fmt: skip
        assert ids.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=False) and mask.any()
        want = hidden_states(reference, ids.tolist())
        got = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
        for k, lid in enumerate(spec.layers.ids):
            # bf16 keeps 8 significant bits, plus float32 noise from the padded batch
            torch.testing.assert_close(got[:, k * H : (k + 1) * H], want[lid + 1][0], rtol=2**-8, atol=1e-5)
    embed, head = read_frozen(cache)
    assert torch.equal(embed, reference.get_input_embeddings().weight.detach().bfloat16())
    assert torch.equal(head, reference.get_output_embeddings().weight.detach().bfloat16())


def test_train_and_export_take_the_drafter_geometry_from_the_text_config(pipeline):
    """The drafter is Qwen3-style: the text config's width and attention geometry, full RoPE at its
    theta; the hybrid's linear-attention fields, partial rotary and RoPE sections are not its."""
    lines = jsonl_rows(pipeline["run"] / "metrics.jsonl")
    losses = [m["loss"] for m in lines if "loss" in m]
    assert len(losses) >= 4 and all(np.isfinite(losses))
    drafter, dcfg = load_serving(pipeline["run"] / "export")
    tc = text_config(load_config(str(pipeline["target"])))
    assert (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim) == (
        tc["hidden_size"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"])  # fmt: skip
    assert (dcfg.intermediate_size, dcfg.vocab_size, dcfg.num_target_layers) == (128, tc["vocab_size"], 8)
    assert dcfg.rope_theta == tc["rope_parameters"]["rope_theta"] and dcfg.rope_scaling is None
    assert dcfg.target_layer_ids == [1, 2, 3, 4, 5]
    assert dcfg.mask_token_id == read_spec(pipeline["cache"]).tokenizer.mask_token_id
    served = json.loads((pipeline["run"] / "export" / "config.json").read_text())
    assert served["model_type"] == "qwen3" and served["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}


def uncached_speculative(model, drafter, dcfg, prompt: list[int], stop: set[int], max_new: int):
    """A plain greedy speculative loop with no cache anywhere: every step recomputes the target over
    the whole sequence (its taps from output_hidden_states) and runs the drafter's training forward
    with one block (BlockLayout), so no state is ever rolled back. (generated ids, accepted counts)."""
    B, embed, head = dcfg.block_size, model.get_input_embeddings(), model.get_output_embeddings()
    with torch.inference_mode():
        seq = list(prompt)
        out = [int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())]
        accepted: list[int] = []
        while len(out) < max_new and out[-1] not in stop:
            p = len(seq) + len(out) - 1
            hs = model(input_ids=torch.tensor([seq + out[:-1]]), output_hidden_states=True).hidden_states
            context = torch.cat([hs[lid + 1][0] for lid in dcfg.target_layer_ids], dim=-1)
            block = torch.full((B,), dcfg.mask_token_id)
            block[0] = out[-1]
            layout = BlockLayout.build(torch.tensor([0, p]), torch.zeros(1, dtype=torch.long), torch.tensor([p]), B)
            hidden = drafter(embed(block), context, layout, attention="sdpa")
            drafts = head(hidden[1:]).argmax(-1).tolist()
            verified = model(input_ids=torch.tensor([seq + out + drafts])).logits[0, p:].argmax(-1).tolist()
            a = 0
            while a < B - 1 and drafts[a] == verified[a]:
                a += 1
            committed = [*drafts[:a], verified[a]][: max_new - len(out)]
            cut = next((i + 1 for i, t in enumerate(committed) if t in stop), len(committed))
            out += committed[:cut]
            accepted.append(cut)
    return out, accepted


@pytest.mark.parametrize("block_size", [None, 8])
def test_eval_on_hybrid_targets_equals_an_uncached_loop(pipeline, tmp_path, block_size):
    """dflash eval on a hybrid rolls the recurrent state back after every rejection (the one-row
    target keeps a copy from before the verification and re-runs the accepted tokens): its outputs
    and acceptance equal an uncached speculative loop's, and greedy speculative equals the target."""
    from dflash_cache.eval.decode import evaluate
    from dflash_cache.generate.dialogue import load_prompts
    from dflash_cache.target.load import stop_token_ids

    drafter_dir = pipeline["run"] / "export"
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": q} for q in fam.QUESTIONS[:2]])
    r = evaluate(EvalConfig(target=str(pipeline["target"]), drafter=drafter_dir, data=str(prompts),
                            max_new_tokens=12, block_size=block_size))  # fmt: skip
    assert r.settings["engine"] == "CachedTarget" and all(s["same_as_target"] for s in r.samples)
    tok = AutoTokenizer.from_pretrained(pipeline["target"])
    model = load_causal_lm(str(pipeline["target"]), torch.float32).eval()
    drafter, dcfg = load_serving(drafter_dir, dtype=torch.float32)
    dcfg.block_size = block_size or dcfg.block_size
    stop = stop_token_ids(tok, model)
    for sample, prompt in zip(r.samples, load_prompts(prompts, tok), strict=True):
        out, accepted = uncached_speculative(model, drafter, dcfg, prompt, stop, 12)
        assert sample["output_ids"] == out and sample["acceptance_lengths"] == accepted


@pytest.mark.parametrize("family", HYBRIDS)
def test_partly_right_drafts_roll_the_recurrent_state_back(hybrid_targets, family):
    """Drafts right up to a slot that moves from step to step, so a hybrid's state is rolled back at
    every cut point: each step commits exactly the right prefix plus the bonus, and the output is
    the target's greedy decode recomputed without a cache."""
    from test_evaluate import scripted_engine

    model = load_causal_lm(str(hybrid_targets[family]), torch.float32).eval()
    prompt = list(range(3, 14))
    with torch.inference_mode():
        seq = list(prompt)
        for _ in range(30):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    want, B, marks = seq[len(prompt):], 6, []

    def half_right(request, out):
        drafts = list(want[len(out) : len(out) + B - 1])
        j = len(marks) % (B - 1)
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % 64
        marks.append(j)
        return drafts

    engine, _ = scripted_engine(model, 0, set(), B, half_right, None)
    (c,) = list(engine.stream([Request(prompt, 24)]))
    assert c.ids == want[:24]
    assert c.accepted[:-1] == [j + 1 for j in marks[:-1]] and sum(c.accepted) == 23


def greedy_without_cache(tok, model, messages, stop: set[int], max_new_tokens: int) -> str:
    """The target's greedy reply, recomputing the whole sequence every step (no cache, no batching)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax())
            if t in stop:
                break
            out.append(t)
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("family", HYBRIDS)
def test_regen_replies_are_the_targets_greedy_ones(hybrid_targets, family, tmp_path):
    """Batched (left-padded) generation with the hybrid's recurrent cache gives the replies of an
    unbatched, uncached greedy decode. The prompt ends in Qwen3.5's opened think block."""
    from dflash_cache.pipelines.regen import run

    target = hybrid_targets[family]
    rows = fam.example_rows(family)[:3]  # one and two turns, with and without a system turn, of unequal lengths
    out = tmp_path / "regen.jsonl"
    run(RegenConfig(target=str(target), data=str(write_rows(tmp_path / "in.jsonl", rows)), out=out,
                    max_new_tokens=6, batch_size=3))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    stop = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    for src, row in zip(rows, jsonl_rows(out), strict=True):
        messages = row["messages"]
        k = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        assert messages[:k] == src["messages"][:k]
        assert messages[k]["content"] == greedy_without_cache(tok, model, messages[:k], stop, 6)


# -------------------------------------------------------------------------------------------------
# A multimodal checkpoint whose head is tied only at the top level of its config
# -------------------------------------------------------------------------------------------------


def _tied_checkpoint(src, dst, *, drop: str | None = None):
    """The multimodal fixture saved as a tied model is: no lm_head.weight, tie_word_embeddings only at
    the top level (text_config without it). `drop` removes one more weight."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["tie_word_embeddings"] = True
    del config["text_config"]["tie_word_embeddings"]
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(dst / "model.safetensors")
    for name in ("lm_head.weight", drop):
        weights.pop(name, None)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_head_tied_at_the_top_level_is_tied_and_a_missing_weight_refused(hybrid_targets, tmp_path):
    tied = _tied_checkpoint(hybrid_targets["qwen3_5_vl"], tmp_path / "tied")
    plain = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)  # transformers alone: a random head
    assert not torch.equal(plain.get_output_embeddings().weight, plain.get_input_embeddings().weight)

    _, model, _ = load_target(str(tied), [1, 5], CPU)  # extract's frozen weights: the head is the embedding
    assert frozen_weights(model)[1] is None
    assert target_info(str(tied), None, load_config(str(tied)), torch.float32).tied_embeddings
    ids = torch.tensor([list(range(5, 25))])
    with torch.no_grad():  # the multimodal class ties its head by the top-level config: the same logits
        want = reference_model(tied)(input_ids=ids).logits
        torch.testing.assert_close(load_causal_lm(str(tied), torch.float32)(input_ids=ids).logits, want)

    broken = _tied_checkpoint(hybrid_targets["qwen3_5_vl"], tmp_path / "broken",
                              drop="model.language_model.layers.2.mlp.up_proj.weight")  # fmt: skip
    with pytest.raises(TargetError, match=r"lacks 1 of the model's weights \(model.layers.2.mlp.up_proj.weight\)"):
        load_target(str(broken), [1, 5], CPU)


# -------------------------------------------------------------------------------------------------
# Real shapes
# -------------------------------------------------------------------------------------------------


def test_drafter_geometry_of_a_qwen3_5_27b_target():
    """The geometry SpecForge's configs/qwen3.5-27b-dflash.json gives the drafter of Qwen3.5-27B:
    the text config's width and its attention (24 heads of 256, 4 KV heads), theta 1e7, full RoPE."""
    config = {"model_type": "qwen3_5", "text_config": bench.QWEN3_5_27B, "vision_config": {"depth": 27}}
    d = DrafterConfig.from_target(config, target_layer_ids=None, mask_token_id=248077).to_serving_config()
    want = {"hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
            "intermediate_size": 17408, "vocab_size": 248320, "num_target_layers": 64, "rope_theta": 10_000_000.0,
            "rope_scaling": None, "max_position_embeddings": 262144, "num_hidden_layers": 5}  # fmt: skip
    assert {k: d[k] for k in want} == want
    assert len(bench.QWEN3_5_9B["layer_types"]) == 32 and bench.QWEN3_5_27B["layer_types"].count("full_attention") == 16
