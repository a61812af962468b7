"""The useful-FLOPs count behind MFU, against the geometry counted by hand and against the matrix
products torch's FlopCounterMode sees in a real training step."""

from pathlib import Path
from types import SimpleNamespace

import torch
from helpers import jsonl_rows
from torch.utils.flop_counter import FlopCounterMode

from dflash_cache.bench.shapes import QWEN3_8B
from dflash_cache.drafters.dflash import family as dflash
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.family import StepFlops
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.metrics import MetricsLog, peak_flops
from dflash_cache.train.stage import train_step


def test_qwen3_8b_geometry_by_hand():
    cfg = DrafterConfig.from_target(QWEN3_8B, target_layer_ids=None, mask_token_id=0)
    with torch.device("meta"):
        flops = StepFlops(DFlashDrafter(cfg))
    h, kv, ff = 4096, 8 * 128, 12288
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * ff + 2 * h + 2 * 128  # q, o, k, v, MLP, 2 norms, q/k norms
    assert flops.p_layers == 5 * per_layer
    assert flops.p_ctx == 5 * h * h + 5 * 2 * h * kv  # fc over 5 layers, then each layer's k and v
    blocks, ctx, anchors = 100, 3000, 40_000
    expected = (6 * 5 * per_layer * blocks * 16 + 4 * 151936 * h * blocks * 15 + 4 * flops.p_ctx * ctx
                + 14 * 5 * 32 * 128 * 16 * (anchors + blocks * 16))  # fmt: skip
    assert flops(blocks, ctx, anchors) == expected
    assert peak_flops(torch.device("cpu")) is None


def test_linear_terms_match_the_matrix_products_of_a_step():
    """Every slot supervised: the draft layers' and LM head's products equal the count; the
    context's k/v projections also get an input gradient, which the count leaves out (2 FLOPs a
    parameter a token); attention (batched products) is checked by hand above."""
    config = {**QWEN3_8B, "num_hidden_layers": 8, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 97}  # fmt: skip
    cfg = DrafterConfig.from_target(config, target_layer_ids=[1, 3, 5], mask_token_id=96, num_draft_layers=2,
                                    block_size=4)  # fmt: skip
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    lengths = [9, 14, 6]
    n = sum(lengths)
    batch = SimpleNamespace(
        host=(torch.randint(0, 96, (n,)), torch.ones(n, dtype=torch.bool), torch.tensor([0, 9, 23, 29])),
        context=torch.randn(n, 3 * 32),
        num_tokens=n,
    )
    embed, head = torch.randn(97, 32), torch.randn(97, 32)
    train_cfg = TrainConfig(cache=Path("."), out=Path("."), max_anchors=512)
    with FlopCounterMode(display=False) as counter:
        objective = dflash.FAMILY.bind(cfg, train_cfg.drafter_settings(), reduce=True)
        blocks = train_step(objective, model, embed, head, batch, torch.Generator().manual_seed(0)).blocks
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if "bmm" not in str(op))
    flops = StepFlops(model)
    nb, anchors = blocks.layout.num_blocks, int(blocks.layout.block_anchor.sum())
    assert nb == sum(ln - 4 + 1 for ln in lengths)  # every position with p + B <= len is an anchor
    norms = sum(p.numel() for name, p in model.layers.named_parameters() if "norm" in name)
    kv = sum(a.self_attn.k_proj.weight.numel() + a.self_attn.v_proj.weight.numel() for a in model.layers)
    attention = flops.attn * (anchors + nb * 4)
    linear = flops(nb, n, anchors) - attention - 6 * norms * nb * 4
    assert matmuls == linear + 2 * kv * n


class _Sink:
    def __init__(self):
        self.records, self.closed = [], False

    def log(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


def test_metrics_log_keeps_every_record_once_and_hands_it_to_the_sinks(tmp_path):

    sink, other, bars = _Sink(), _Sink(), []
    line = {"step": 1, "epoch": 0, "loss": 2.5, "accept_len": 1.5, "tokens_per_s": 9.0, "loader_wait_s": 0.0,
            "tflops_per_gpu": 0.1, "tokens": 100, "time": 1.0}  # fmt: skip
    log = MetricsLog(tmp_path, None, on_progress=bars.append, sinks=[sink])
    log.log(line)
    log.log({**line, "step": 2})
    log.log({"epoch_end": 0, "step": 2, "samples": 7})
    MetricsLog(tmp_path, None, rank=1, sinks=[other]).log(line)  # other ranks keep nothing
    log.close()
    lines = jsonl_rows(tmp_path / "metrics.jsonl")
    assert lines == sink.records and len(lines) == 3 and other.records == [] and sink.closed
    assert [b["bar"]["step"] for b in bars] == [1, 2]  # step lines reach the bar, epoch ends do not
    MetricsLog(tmp_path, 1)  # resumed at step 1: the lines past it go
    assert [r["step"] for r in jsonl_rows(tmp_path / "metrics.jsonl")] == [1]
