"""Chunked prefill (extract/prefill.py) against independent computations: `output_hidden_states` of
one plain forward of the whole model over the whole sample, for full-attention, sliding-window,
hybrid (gated delta-net) and latent-attention (DeepSeek-V3) targets; which attention the chunks
take; and a cache made with chunks against one made without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_TARGET, RecordingSink, extract_config, read_cache
from torch.nn.attention.bias import CausalBias
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_cache.core.errors import ExtractError
from dflash_cache.extract import stage
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.forward import batch_inputs
from dflash_cache.extract.prefill import Chunking, forwards, out_of_memory
from dflash_cache.extract.stage import run
from dflash_cache.target.taps import TappedTarget

LAYERS = [1, 3, 5]


def random_qwen3(**fields) -> torch.nn.Module:
    """A random-initialised Qwen3 of the tiny target's shape, float32."""
    config = AutoConfig.from_pretrained(TINY_TARGET)
    for k, v in fields.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def whole_forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states


def chunked(target: TappedTarget, ids: list[torch.Tensor], chunk: int, device: str = "cpu") -> list[list[torch.Tensor]]:
    """Each sample's outputs [n, H] per output, run as one right-padded batch through `forwards`."""
    lengths = np.array([len(x) for x in ids])
    inp, rows = batch_inputs(torch.cat(ids).numpy(), lengths, int(lengths.max()), 0, torch.device(device))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    packed: list[list[torch.Tensor]] = []
    spans = []
    for a, b, outputs, where in forwards(target, inp, rows, lengths, chunk):
        # one sample, one chunk
        assert outputs[0].shape[:2] == (1, b - a) and torch.equal(where.cpu(), torch.arange(b - a))
        spans.append((a, b))
        packed.append([o.reshape(-1, o.shape[-1]).index_select(0, where) for o in outputs])
    # the chunks are the samples' rows in order, each no longer than the chunk
    assert [a for a, _ in spans] == [0, *[b for _, b in spans[:-1]]] and spans[-1][1] == offsets[-1]
    assert all(b - a <= chunk for a, b in spans) and set(offsets[:-1]) <= {a for a, _ in spans}
    per_output = [torch.cat([p[k] for p in packed]) for k in range(len(packed[0]))]
    return [[t[offsets[i] : offsets[i + 1]] for t in per_output] for i in range(len(ids))]


@pytest.fixture(scope="module")
def built(hybrid_targets, tmp_path_factory) -> dict[str, Path]:
    """The family targets these tests read: Qwen3.5's hybrid and DeepSeek-V3's latent attention."""
    import family_targets as fam

    return {"hybrid": hybrid_targets["qwen3_5"], "mla": fam.build("deepseek_v3", tmp_path_factory.mktemp("mla"))}


def target_model(name: str, built: dict[str, Path]) -> torch.nn.Module:
    if name in built:  # hybrid: three gated delta-net layers to one full-attention layer (Qwen3.5's text
        # model); mla: DeepSeek-V3's latent attention, whose keys and values differ in head size
        return AutoModelForCausalLM.from_pretrained(built[name], dtype=torch.float32).eval()
    return {
        "tiny-target": lambda: AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval(),
        "random-qwen3": random_qwen3,
        # a sliding window of 40 tokens on every other layer: shorter than a chunk, so the cache's sliding
        # layers keep only the window while the chunk attends across its edge
        "sliding": lambda: random_qwen3(use_sliding_window=True, sliding_window=40,
                                        layer_types=["sliding_attention", "full_attention"] * 4),  # fmt: skip
    }[name]()


@pytest.mark.parametrize("name", ["tiny-target", "random-qwen3", "sliding", "hybrid", "mla"])
def test_chunks_equal_one_forward(built, name):
    """300- and 260-token samples in chunks of 64, 70 and 75 tokens (75 divides 300, the others
    divide neither) give every tapped layer's output, and the final hidden state, of one forward
    of the uncut model over each whole sample, as float32 allows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the hybrid's torch path is many small ops
    try:
        model = target_model(name, built)
        g = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (300, 260)]
        want = [whole_forward(model, x[None]) for x in ids]
        num_layers = model.config.num_hidden_layers
        # (the last layer's output is not in output_hidden_states: the final-normed state is in its place)
        layers = LAYERS if num_layers > max(LAYERS) + 1 else list(range(num_layers - 1))
        target = TappedTarget(model, layers, num_layers, final=True)
        for chunk in (64, 70, 75):
            got = chunked(target, ids, chunk)
            for i, sample in enumerate(got):
                for k, layer in enumerate(layers):
                    torch.testing.assert_close(sample[k], want[i][layer + 1][0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(sample[-1], want[i][-1][0], rtol=1e-5, atol=1e-5)  # after the final norm
    finally:
        torch.set_num_threads(threads)


def test_a_batch_that_fits_is_one_forward():
    """A batch no longer than the chunk is today's one forward, its outputs bit for bit."""
    target = TappedTarget(random_qwen3(), LAYERS, 8)
    lengths = np.array([60, 50, 20])
    ids = np.random.default_rng(0).integers(0, 1000, int(lengths.sum()))
    inp, rows = batch_inputs(ids, lengths, 60, 0, torch.device("cpu"))
    for chunk in (None, 60, 4096):
        (a, b, outputs, where), *more = forwards(target, inp, rows, lengths, chunk)
        assert not more and (a, b) == (0, 130) and where is rows
        assert all(torch.equal(o, r) for o, r in zip(outputs, target(inp), strict=True))


def test_out_of_memory_names_what_to_change():
    """The line a forward out of GPU memory stops with names the setting to change: a chunk for one
    long sample (at most 16,384, at most half the sample), a smaller chunk for a sample already in
    chunks, a smaller token budget for a batch of several (the GPU suite runs it out of memory)."""
    assert "pass --prefill-chunk 16384 " in out_of_memory(1, 65536, 65536, None)
    assert "pass --prefill-chunk 2048 " in out_of_memory(1, 5000, 5000, None)
    chunked = out_of_memory(1, 65536, 65536, 16384)
    assert "in a 16,384-token chunk" in chunked and "smaller --prefill-chunk (e.g. 8192)" in chunked
    batch = out_of_memory(3, 4096, 4000, None)
    assert "3 samples of 4,096 tokens" in batch and "lower --token-budget (this forward held 12,288" in batch


def test_chunking_is_asked_for():
    """No chunk by default: one forward a batch, and chunks only for a sample that one forward cannot
    hold (above), until chunked and unchunked forwards of 16K-64K tokens are timed side by side on a
    GPU."""
    assert ExtractConfig.prefill_chunk is None


def test_chunked_cache_equals_unchunked(tmp_path):
    """A cache extracted with --prefill-chunk 64 holds what one without it holds: every batch no
    longer than 64 tokens bit for bit, the longer samples (run alone, in chunks) up to the bf16
    rounding of float32 differences."""
    plain = run(extract_config(tmp_path / "plain", max_samples=48, token_budget=1024))
    chunk = run(extract_config(tmp_path / "chunked", max_samples=48, token_budget=1024, prefill_chunk=64))
    assert (plain["samples"], plain["tokens"], plain["units"]) == (chunk["samples"], chunk["tokens"], chunk["units"])
    a, b = read_cache(tmp_path / "plain"), read_cache(tmp_path / "chunked")
    assert a.keys() == b.keys()
    lengths = {s: len(v[1]) for s, v in a.items()}
    # batches never cross a bucket edge and the first edge is 64: a sample of up to 64 tokens is in a
    # batch that fits a chunk, a longer one is not
    fits = {s for s in a if lengths[s] <= 64}
    long = [s for s in a if lengths[s] > 64]
    assert fits and long  # both kinds are in the data
    assert_same_up_to_rounding(a, b, fits)


def assert_same_up_to_rounding(a: dict, b: dict, exact: set) -> None:
    """Two caches' samples (`read_cache`) hold the same tokens and mask, the `exact` samples' hidden
    states bit for bit and the others' up to the bf16 rounding of float32 differences."""
    for s in a:
        bits_a, ids_a, mask_a, _ = a[s]
        bits_b, ids_b, mask_b, _ = b[s]
        assert np.array_equal(ids_a, ids_b) and np.array_equal(mask_a, mask_b)
        if s in exact:
            assert np.array_equal(bits_a, bits_b), s
        else:
            x, y = (torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).float() for v in (bits_a, bits_b))
            torch.testing.assert_close(y, x, rtol=2**-7, atol=1e-5)


def test_a_sample_one_forward_cannot_hold_runs_in_chunks(tmp_path, monkeypatch):
    """Without --prefill-chunk, a sample alone whose one forward runs out of GPU memory (injected:
    the real tiny target raises CUDA's out-of-memory error for a forward of more than 256 tokens at
    once) runs again in chunks, and so does every longer sample after it: the run says so once, and
    its cache holds what an uninjected run's holds, the samples that fit a chunk bit for bit, the
    longer ones up to the bf16 rounding of float32 differences."""
    plain = run(extract_config(tmp_path / "plain", max_samples=48, token_budget=512))
    raised, load_copy = [], stage.load_copy

    def tight_memory(spec, device):
        target, model = load_copy(spec, device)

        def forward(ids, **kwargs):
            if ids.shape[1] > 256 and "carry" not in kwargs:
                raised.append(ids.shape[1])
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return target(ids, **kwargs)

        return forward, model

    monkeypatch.setattr(stage, "load_copy", tight_memory)
    sink = RecordingSink()
    adapted = run(extract_config(tmp_path / "adapted", max_samples=48, token_budget=512), sink)
    assert (adapted["samples"], adapted["tokens"]) == (plain["samples"], plain["tokens"])
    a, b = read_cache(tmp_path / "plain"), read_cache(tmp_path / "adapted")
    lengths = {s: len(v[1]) for s, v in a.items()}
    assert len(raised) == 1 and raised[0] in lengths.values()  # once: the longer samples after it were chunked
    told = [d["info"] for d in sink.deltas if "out of GPU memory" in d.get("info", "")]
    assert len(told) == 1 and f"a sample of {raised[0]:,} tokens" in told[0], sink.deltas
    assert "chunks of 128 tokens" in told[0] and "--prefill-chunk 128" in told[0], told
    assert a.keys() == b.keys() and sum(n > 256 for n in lengths.values()) >= 2
    assert_same_up_to_rounding(a, b, {s for s in a if lengths[s] <= 128})


def test_a_sharded_copy_does_not_find_its_chunk():
    """The ranks of a sharded copy must run the same forwards, so out of memory they stop with the
    line that names --prefill-chunk, as does a batch of several samples anywhere (it names
    --token-budget)."""

    def no_memory(ids, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    one, two = (torch.ones(n, 300, dtype=torch.long) for n in (1, 2))
    for chunking, inp, says in [(Chunking(None, adapt=False), one, "--prefill-chunk 128"),
                                (Chunking(None, adapt=True), two, "--token-budget")]:  # fmt: skip
        with pytest.raises(ExtractError, match=says):
            list(chunking.forwards(no_memory, inp, torch.arange(inp.numel()), np.full(inp.shape[0], 300)))
        assert chunking.tokens is None


def test_the_window_is_in_force():
    """The sliding model above is the random Qwen3 with windows: the same weights, other outputs
    past its 40th token (so the chunks above cross windows that matter)."""
    full, sliding = random_qwen3(), target_model("sliding", {})
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), sliding.parameters(), strict=True))
    ids = torch.randint(0, 1000, (1, 120), generator=torch.Generator().manual_seed(2))
    a, b = whole_forward(full, ids)[2][0], whole_forward(sliding, ids)[2][0]
    assert torch.equal(a[:40], b[:40]) and (a[40:] - b[40:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["random-qwen3", "hybrid", "mla", "sliding"])
def test_chunks_attend_without_a_mask(built, monkeypatch, name):
    """A chunk after earlier ones attends to them with no [chunk, keys] mask where every layer is
    causal over the whole context: SDPA is handed torch's lower-right causal bias, never a mask
    tensor (at 256K tokens transformers' mask was 4 GiB a chunk). A target with sliding layers keeps
    transformers' masks, which its windows need; both give one forward's outputs (above)."""
    seen: list[object] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        seen.append(attn_mask)
        if isinstance(attn_mask, CausalBias):  # its dispatch looks for the unpatched function
            attn_mask = attn_mask._materialize(q.device)
        return sdpa(q, k, v, attn_mask, *args, **kwargs)

    model = target_model(name, built)
    layers = [0, 1, model.config.num_hidden_layers - 1]
    target = TappedTarget(model, layers, model.config.num_hidden_layers)
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    chunked(target, [ids], 64)
    tensors = [m for m in seen if isinstance(m, torch.Tensor) and not isinstance(m, CausalBias)]
    biases = [m for m in seen if isinstance(m, CausalBias)]
    if name == "sliding":
        assert tensors and not biases
    else:
        assert seen and not tensors and biases
        assert {(b.seq_len_q, b.seq_len_kv) for b in biases} >= {(64, 128), (44, 300)}
    assert model.config._attn_implementation == "sdpa"  # switched back after the call
