"""Storage and training on the GPU against the same runs on the CPU: fp8 storage encoded there, a
projected cache and the drafter trained on it, the compiled training step, DDP over NCCL; and
chunked prefill there against one forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import CHAT, ROOT, TINY_TARGET, extract_config, jsonl_rows, read_cache, read_metrics
from test_hybrid import write_rows
from test_train import test_fused_clipped_step_is_clip_grad_norm_then_step as check_clipped_step
from transformers import AutoModelForCausalLM

from dflash_cache.cache.spec import read_spec
from dflash_cache.eval.config import EvalConfig
from dflash_cache.eval.decode import evaluate
from dflash_cache.extract import stage as extract_stage
from dflash_cache.train import stage as train_stage
from dflash_cache.train.config import TrainConfig
from gpu.common import GPU

pytestmark = GPU


def test_fp8_cache_on_cuda_equals_the_cpu_one(tmp_path):
    """fp8 storage encoded on the GPU against the same extraction on the CPU: the scales agree to
    bf16 rounding and the decoded rows to within fp8's step."""
    from dflash_cache.cache.unit.codec import decode_hidden

    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    data = write_rows(tmp_path / "rows.jsonl", jsonl_rows(CHAT, 24))
    extract_stage.run(extract_config(gpu, data=str(data), storage="fp8", gpus=[0]))
    extract_stage.run(extract_config(cpu, data=str(data), storage="fp8"))
    a, b = read_cache(gpu), read_cache(cpu)
    assert sorted(a) == sorted(b)
    K = len(read_spec(cpu).layers.ids)
    for s in sorted(a):
        x, y = (decode_hidden(torch.from_numpy(c[s][0]), torch.from_numpy(c[s][3]), K) for c in (a, b))
        assert float((x - y).norm() / y.norm()) < 0.08, s
        assert np.array_equal(a[s][1], b[s][1]) and np.array_equal(a[s][2], b[s][2])


def test_projected_cache_on_cuda_trains_a_drafter_that_decodes_as_the_target(tmp_path):
    """A projected cache extracted on the GPU (the basis fitted there, bf16 products) holds the
    basis applied to the float32 model's own hidden states, to bf16 rounding; a drafter trained on
    it there exports folded, and eval with the target live decodes the target alone's tokens."""
    from dflash_cache.cache.projection import Basis
    from dflash_cache.cache.unit.codec import decode_hidden

    data = write_rows(tmp_path / "rows.jsonl", jsonl_rows(CHAT, 48))
    cache = tmp_path / "cache"
    extract_stage.run(extract_config(cache, data=str(data), project="auto", storage="bf16", gpus=[0]))
    spec = read_spec(cache)
    basis = Basis.load(cache, spec)
    model = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    cached = read_cache(cache)
    for s in sorted(cached)[:4]:
        bits, ids, _, _ = cached[s]
        with torch.inference_mode():
            states = model(input_ids=torch.tensor([ids.tolist()]), output_hidden_states=True).hidden_states
        want = torch.cat([states[lid + 1][0] for lid in spec.layers.ids], dim=1) @ basis.weights[0].T
        got = decode_hidden(torch.from_numpy(bits), None, 1).float()
        assert float((got - want).norm() / want.norm()) < 5e-2, s
    run = tmp_path / "run"
    train_stage.run(TrainConfig(cache=cache, out=run, epochs=1, max_steps=8, token_budget=1024, max_anchors=16,
                                draft_layers=1, block_size=8, log_every=1, gpus=[0]))  # fmt: skip
    r = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=run / "export", data=str(ROOT / "data" / "prompts.jsonl"),
                            max_new_tokens=24, limit=4))  # fmt: skip
    assert r.settings["device"] == "cuda" and all(x["same_as_target"] for x in r.samples)


def test_compiled_training_step_on_cuda_follows_the_cpu_run(tiny_cache, tmp_path):
    """The drafter's training on the GPU (compiled objective, bf16 autocast) against the same run on
    the CPU: the same batches give the same first losses to bf16 rounding, and both learn."""
    runs = {}
    for name, gpus in (("gpu", [0]), ("cpu", None)):
        train_stage.run(TrainConfig(cache=tiny_cache, out=tmp_path / name, epochs=1, max_steps=12, token_budget=1024,
                                    max_anchors=16, draft_layers=2, block_size=8, log_every=1, gpus=gpus))  # fmt: skip
        runs[name] = [m["loss"] for m in read_metrics(tmp_path / name) if "loss" in m]
    gpu, cpu = runs["gpu"], runs["cpu"]
    assert len(gpu) == len(cpu) == 12
    assert abs(gpu[0] - cpu[0]) / cpu[0] < 2e-2, (gpu[0], cpu[0])
    assert gpu[-1] < gpu[0] and cpu[-1] < cpu[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs two GPUs")
def test_ddp_over_nccl_trains_and_resumes_on_one_gpu(tiny_cache, tmp_path):
    """Two NCCL ranks train, and the run resumes on one GPU to the step count asked for (the
    loader deals the rest of the epoch to the new world size)."""
    from dflash_cache.train.checkpoint import Checkpointer

    cfg = {"cache": tiny_cache, "out": tmp_path / "run", "epochs": 1, "token_budget": 1024, "max_anchors": 16,
           "draft_layers": 1, "block_size": 8, "log_every": 1, "save_every": 3}  # fmt: skip
    train_stage.run(TrainConfig(**cfg, max_steps=3, gpus=[0, 1]))
    train_stage.run(TrainConfig(**cfg, max_steps=6, gpus=[0]))
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(losses) == 6 and all(np.isfinite(losses)) and Checkpointer(tmp_path / "run").load()["step"] == 6


def test_chunked_prefill_on_cuda_equals_one_forward():
    """A 4,096-token sample in chunks of 1,000 on the GPU (bf16, each chunk after the first on
    torch's lower-right causal bias: the flash kernel, no mask) gives one bf16 forward's tapped
    layers and final hidden state, to bf16 rounding."""
    from test_prefill import LAYERS, chunked, random_qwen3

    from dflash_cache.target.taps import TappedTarget

    model = random_qwen3().to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(input_ids=ids[None].cuda(), output_hidden_states=True).hidden_states
    target = TappedTarget(model, LAYERS, model.config.num_hidden_layers, final=True)
    got = chunked(target, [ids], 1000, "cuda")[0]
    for k, layer in enumerate(LAYERS):
        w = want[layer + 1][0].float()
        assert float((got[k].float() - w).norm() / w.norm()) < 2e-2, layer
    assert float((got[-1].float() - want[-1][0].float()).norm() / want[-1][0].float().norm()) < 2e-2


def test_extract_out_of_gpu_memory_names_the_prefill_chunk_that_fits():
    """A 65,536-token sample whose one forward exceeds the GPU memory the process may use stops
    with an ExtractError that names --prefill-chunk and a size; in chunks of that size the same
    sample runs within the same limit. The limit lies halfway between the two runs' own peaks."""
    from test_prefill import LAYERS, random_qwen3

    from dflash_cache.core.errors import ExtractError
    from dflash_cache.extract.prefill import forwards
    from dflash_cache.target.taps import TappedTarget

    n = 65536
    shape = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 num_hidden_layers=6, layer_types=["full_attention"] * 6, max_position_embeddings=2 * n)  # fmt: skip
    model = random_qwen3(**shape).to("cuda", torch.bfloat16)
    target = TappedTarget(model, LAYERS, model.config.num_hidden_layers)
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
    rows, lengths = torch.arange(n, device="cuda"), np.array([n])

    def peak(chunk: int | None) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            for *_, outputs, _ in forwards(target, ids, rows, lengths, chunk):
                del outputs
        return torch.cuda.max_memory_reserved()

    whole, chunks = peak(None), peak(16384)
    assert whole > 1.5 * chunks, (whole, chunks)  # what chunking is for
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((whole + chunks) / 2 / torch.cuda.get_device_properties(0).total_memory)
    try:
        with pytest.raises(ExtractError, match="--prefill-chunk 16384"), torch.inference_mode():
            for _ in forwards(target, ids, rows, lengths, None):
                pass
        peak(16384)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_fused_clipped_step_on_cuda_is_clip_grad_norm_then_step():
    """The CUDA fused AdamW divides by the clipping's factor in its kernel (`train.optimizer.clipped_step`)
    as clip_grad_norm_ then the unfused step would."""
    check_clipped_step("cuda")
