"""Our DFlash training step against SpecForge 0.2.0's, in one process, on the same batches: step time,
MFU (one useful-FLOPs count for both) and peak GPU memory of each, and the ratio specforge/ours.

SpecForge is imported at run time, never vendored: install its wheel without its dependencies into a
folder on PYTHONPATH (sglang, wandb, yunchang, ... are not needed: the modules used here import only
torch and transformers, so no stub module is inserted):

    pip install --no-deps --target /tmp/sf/site specforge==0.2.0   # or its wheel file
    PYTHONPATH=/tmp/sf/site python benchmarks/bench_specforge.py --shape smollm2-135m --out sf_smollm2.json
    PYTHONPATH=/tmp/sf/site python benchmarks/bench_specforge.py --shape qwen3-8b --steps 10 --out sf_qwen3.json
    PYTHONPATH=/tmp/sf/site python benchmarks/bench_specforge.py --device cpu --shape tiny --batch 1 --seq 256 \\
        --steps 1 --warmup 1 --sf-attention sdpa   # the plumbing alone, on a CPU

The batch: BSZ sequences of SEQ tokens (random ids, the first fifth unsupervised), context hidden
states random [BSZ*SEQ, K*H] bf16 on the GPU, the target's embedding and LM head random bf16
[V, H], frozen and shared. Ours takes it packed (offsets every SEQ tokens), SpecForge padded
[BSZ, SEQ, ...]: the same memory, viewed.

- Ours: `FAMILY.bind(...)` + `train_step` (as benchmarks/bench_step.py), fp32 weights under bf16 autocast,
  clip_grad_norm_ and a fused AdamW.
- SpecForge: its `DFlashDraftModel` (Qwen3Config, 5 layers, block 16, our target_layer_ids and mask
  token) inside its `OnlineDFlashModel` (the `dflash` loss, 512 anchors, objective chunks of 128
  blocks: its defaults; the slot decay set to our gamma), attention `flex_attention` (its default).
  `--sf-precision masters` (default, SpecForge's recipe): bf16 weights and SpecForge's own
  `BF16Optimizer` (grad norm, clip, fp32 master copies) with its inner AdamW swapped for a fused
  one; `--sf-precision autocast`: fp32 weights under bf16 autocast, clip_grad_norm_ and a fused
  AdamW, exactly our recipe.

Anchors (`--anchors same`, default): both train the same blocks. Our step draws its anchors on the
host from a generator seeded by the step (512 a sequence, supervised p with p + 16 <= SEQ); the
same draw, made before timing, replaces SpecForge's: its own sampler still runs inside the timed
step (its cost counts) and its result is dropped. `--anchors own`: SpecForge keeps its own draw
(512 a sequence too, from a slightly wider candidate set), so the blocks differ but not their number.

FLOPs: ONE count for both, our `StepFlops` over our step's blocks (draft layers 6*P*tokens, the LM
head's 4*V*H on the B-1 drafted slots, context projections, attention up to each anchor); with the
same anchors it is exactly the same useful work. Work SpecForge does beyond it (slot 0 through the LM
head, recomputation in its checkpointed loss chunks) is not useful, so it lowers MFU, as ours would.
MFU = FLOPs / seconds / peak bf16 FLOP/s of the GPU (`peak_flops`).

Timing: each side in turn (`--order`), built, warmed up (`--warmup` steps: compiles included), then
`--steps` steps each between CUDA events; the other side's model and optimizer are freed first, so
peak memory is its own plus the shared batches and frozen tensors (`shared_gb`).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

try:  # whichever dflash_cache is first on PYTHONPATH; else this checkout's
    import dflash_cache  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache.bench.shapes import SHAPES
from dflash_cache.drafters.blocks import anchors_by_sequence, default_gamma, sample_anchors
from dflash_cache.drafters.dflash.config import DrafterConfig
from dflash_cache.drafters.dflash.family import FAMILY, StepFlops
from dflash_cache.drafters.dflash.model import DFlashDrafter
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.metrics import peak_flops
from dflash_cache.train.stage import train_step

TINY = {
    "model_type": "qwen3", "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
DEFAULTS = {"smollm2-135m": (16, 2048), "qwen3-8b": (4, 3072), "tiny": (2, 256)}  # (batch, seq)
BLOCK, ANCHORS, LAYERS, LR = 16, 512, 5, 1e-5


def make_batches(n: int, bsz: int, seq: int, width: int, vocab: int, dtype: torch.dtype, dev: torch.device
                 ) -> list[SimpleNamespace]:  # fmt: skip
    """n batches of bsz sequences of seq tokens: ours packed (host ids and mask, offsets), SpecForge's
    the same tensors as [bsz, seq, ...] on the device."""
    g = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, (bsz + 1) * seq, seq, dtype=torch.int64)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 1, (bsz * seq,), generator=g)
        mask = torch.ones(bsz, seq, dtype=torch.bool)
        mask[:, : seq // 5] = False  # the prompt: unsupervised
        mask = mask.flatten()
        context = torch.randn(bsz * seq, width, generator=g).to(dev, dtype)
        out.append(SimpleNamespace(
            host=(ids, mask, offsets), context=context, num_tokens=bsz * seq,  # ours
            input_ids=ids.view(bsz, seq).to(dev), loss_mask=mask.view(bsz, seq).to(dev, torch.float32),
            hidden_states=context.view(bsz, seq, width),  # SpecForge's
        ))  # fmt: skip
    return out


def our_anchors(batch: SimpleNamespace, step: int, max_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_seq, block_anchor) exactly as our step `step` draws them (make_blocks, one generator
    seeded by the step, sequence after sequence)."""
    _, mask, offsets = batch.host
    g = torch.Generator().manual_seed(step)
    return anchors_by_sequence(mask, offsets, lambda m: sample_anchors(m, BLOCK, max_anchors, g))


def padded_anchors(block_seq: torch.Tensor, block_anchor: torch.Tensor, bsz: int, dev: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """SpecForge's (anchor_positions [bsz, N], block_keep_mask [bsz, N]) for the same blocks: sorted,
    padded with anchor 0 / keep False, as its `_sample_anchor_positions` returns them."""
    counts = torch.bincount(block_seq, minlength=bsz)
    n = int(counts.max())
    anchors = torch.zeros(bsz, n, dtype=torch.int64)
    keep = torch.arange(n)[None, :] < counts[:, None]
    anchors[keep] = block_anchor  # grouped by sequence, sorted within: row-major order fills them
    return anchors.to(dev), keep.to(dev)


def import_specforge() -> SimpleNamespace:
    try:
        from specforge.algorithms.common import dflash_family_model
        from specforge.lr_scheduler import CosineAnnealingWarmupLR
        from specforge.modeling.draft.dflash import DFlashDraftModel
        from specforge.optimizer import BF16Optimizer
    except ImportError as e:
        sys.exit(f"SpecForge does not import ({e}): pip install --no-deps --target DIR specforge==0.2.0 "
                 "(or its wheel) and put DIR on PYTHONPATH")  # fmt: skip
    try:
        version = importlib.metadata.version("specforge")
    except importlib.metadata.PackageNotFoundError:  # unpacked, not installed
        version = None
    return SimpleNamespace(model=dflash_family_model, draft=DFlashDraftModel, bf16_optimizer=BF16Optimizer,
                           cosine=CosineAnnealingWarmupLR, version=version)  # fmt: skip


def sf_config(dcfg: DrafterConfig, attention: str):
    """SpecForge's draft config for our drafter's geometry (what its dflash provider generates)."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=dcfg.hidden_size, num_attention_heads=dcfg.num_attention_heads,
        num_key_value_heads=dcfg.num_key_value_heads, head_dim=dcfg.head_dim,
        intermediate_size=dcfg.intermediate_size, vocab_size=dcfg.vocab_size, rms_norm_eps=dcfg.rms_norm_eps,
        max_position_embeddings=dcfg.max_position_embeddings, rope_parameters=dcfg.rope_parameters(),
        num_hidden_layers=dcfg.num_hidden_layers, attention_bias=dcfg.attention_bias, hidden_act=dcfg.hidden_act,
        tie_word_embeddings=False, layer_types=["full_attention"] * dcfg.num_hidden_layers,
        use_sliding_window=False, sliding_window=None,
    )  # fmt: skip
    config.num_target_layers = dcfg.num_target_layers
    config.block_size = dcfg.block_size
    config.dflash_config = {"target_layer_ids": list(dcfg.target_layer_ids), "mask_token_id": dcfg.mask_token_id}
    config._attn_implementation = attention
    return config


class Side:
    """One implementation's model, optimizer and step(i) (forward, backward, optimizer step)."""

    def __init__(self, name: str, params: int, step: Callable[[int], None], free: Callable[[], None]) -> None:
        self.name, self.params, self.step, self.free = name, params, step, free


def build_ours(dcfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor, data: list, dev: torch.device,
               record: list) -> Side:  # fmt: skip
    cfg = TrainConfig(cache=Path("."), out=Path("."), max_anchors=ANCHORS)
    torch.manual_seed(0)
    model = DFlashDrafter(dcfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    objective = FAMILY.bind(dcfg, cfg.drafter_settings(), reduce=True)

    def step(i: int) -> None:
        blocks = train_step(objective, model, embed, head, data[i % len(data)], torch.Generator().manual_seed(i)).blocks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.append((i, blocks.layout.block_anchor))  # checked against the draw given to SpecForge

    def free() -> None:
        nonlocal model, opt
        del model, opt

    return Side("ours", sum(p.numel() for p in model.parameters()), step, free)


def build_specforge(sf: SimpleNamespace, dcfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor, data: list,
                    dev: torch.device, a: argparse.Namespace, anchors: dict[int, tuple]) -> Side:  # fmt: skip
    masters, cuda = a.sf_precision == "masters", dev.type == "cuda"
    torch.manual_seed(0)
    draft = sf.draft(sf_config(dcfg, a.sf_attention))
    draft.mask_token_id = dcfg.mask_token_id
    draft = draft.to(dev, torch.bfloat16 if masters and cuda else torch.float32)  # a CPU dry run: fp32 throughout
    embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)  # the shared frozen tensors, not copies
    lm_head = nn.Linear(dcfg.hidden_size, dcfg.vocab_size, bias=False, device="meta")
    lm_head.weight = nn.Parameter(head, requires_grad=False)
    model = sf.model.OnlineDFlashModel(
        draft_model=draft, target_lm_head=lm_head, target_embed_tokens=embed_tokens,
        mask_token_id=dcfg.mask_token_id, block_size=dcfg.block_size, attention_backend=a.sf_attention,
        num_anchors=ANCHORS, loss_decay_gamma=default_gamma(dcfg.block_size), loss_type="dflash",
    )  # fmt: skip
    if a.anchors == "same":
        own = model._sample_anchor_positions
        current: list[int] = [0]

        def same_anchors(seq_len: int, loss_mask: torch.Tensor, device: torch.device) -> tuple:
            own(seq_len, loss_mask, device)  # SpecForge's draw still runs (and is timed); ours replaces it
            return anchors[current[0]]

        model._sample_anchor_positions = same_anchors
    if masters:  # SpecForge's BF16Optimizer (grad norm, clip, fp32 masters), its AdamW made fused
        opt = sf.bf16_optimizer(draft, lr=LR)
        opt.optimizer = torch.optim.AdamW(opt.fp32_params, lr=LR, weight_decay=0.0, fused=True)
        opt.scheduler = sf.cosine(opt.optimizer, total_steps=800_000, warmup_steps=12_000)  # its defaults
    else:
        opt = torch.optim.AdamW(draft.parameters(), lr=LR, fused=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and not masters else nullcontext()

    def step(i: int) -> None:
        if a.anchors == "same":
            current[0] = i
        b = data[i % len(data)]
        with autocast:
            loss, _, _ = model(input_ids=b.input_ids, hidden_states=b.hidden_states, loss_mask=b.loss_mask)
        loss.backward()
        if masters:
            opt.step()  # clips, steps the masters, copies them back, drops the grads
        else:
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def free() -> None:
        nonlocal model, draft, opt
        del model, draft, opt

    return Side("specforge", sum(p.numel() for p in draft.parameters()), step, free)


def timed(side: Side, warmup: int, steps: int, dev: torch.device) -> dict:
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for i in range(warmup):
        side.step(i)
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    seconds = []
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            side.step(i)
            end.record()
            seconds.append((start, end))
        else:
            t = time.perf_counter()
            side.step(i)
            seconds.append(time.perf_counter() - t)
    sync()
    wall = time.perf_counter() - t0
    if cuda:
        seconds = [s.elapsed_time(e) / 1e3 for s, e in seconds]
    return {
        "params": side.params, "warmup_s": warmup_s, "step_s_median": statistics.median(seconds),
        "step_s_mean": statistics.fmean(seconds), "step_s_min": min(seconds), "wall_s_per_step": wall / steps,
        "step_s": seconds, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "peak_over_start_gb": (torch.cuda.max_memory_allocated() - base) / 1e9 if cuda else None,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=["smollm2-135m", "qwen3-8b", "tiny"])
    ap.add_argument("--batch", type=int, help="sequences a batch (default: smollm2 16, qwen3-8b 4)")
    ap.add_argument("--seq", type=int, help="tokens a sequence (default: smollm2 2048, qwen3-8b 3072)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=4, help="distinct batches, cycled (anchors differ every step)")
    ap.add_argument("--anchors", default="same", choices=["same", "own"])
    ap.add_argument("--sf-precision", default="masters", choices=["masters", "autocast"])
    ap.add_argument("--sf-attention", default="flex_attention", choices=["flex_attention", "sdpa", "eager"])
    ap.add_argument("--order", default="ours-first", choices=["ours-first", "specforge-first"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the plumbing")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark times GPU training steps (--device cpu for a dry run only)")
    dev = torch.device(a.device)
    sf = import_specforge()

    shape = TINY if a.shape == "tiny" else SHAPES[a.shape]
    bsz, seq = a.batch or DEFAULTS[a.shape][0], a.seq or DEFAULTS[a.shape][1]
    dcfg = DrafterConfig.from_target(shape, target_layer_ids=None, mask_token_id=shape["vocab_size"] - 1,
                                     num_draft_layers=LAYERS, block_size=BLOCK)  # fmt: skip
    vocab, hidden = dcfg.vocab_size, dcfg.hidden_size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # our CPU path runs without autocast
    g = torch.Generator().manual_seed(1)
    embed = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dev, dtype)
    head = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dev, dtype)
    need = a.warmup + a.steps
    data = make_batches(min(a.distinct, need), bsz, seq, dcfg.num_context_layers * hidden, vocab, dtype, dev)
    draws = {i: our_anchors(data[i % len(data)], i, ANCHORS) for i in range(need)}
    anchors = {i: padded_anchors(s, p, bsz, dev) for i, (s, p) in draws.items()}
    shared_gb = torch.cuda.memory_allocated() / 1e9 if dev.type == "cuda" else None

    record: list = []
    builders = {
        "ours": lambda: build_ours(dcfg, embed, head, data, dev, record),
        "specforge": lambda: build_specforge(sf, dcfg, embed, head, data, dev, a, anchors),
    }
    results = {}
    for name in ["ours", "specforge"] if a.order == "ours-first" else ["specforge", "ours"]:
        side = builders[name]()
        results[name] = timed(side, a.warmup, a.steps, dev)
        side.free()
        del side
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # our step drew exactly the anchors given to SpecForge (the same blocks, the same FLOPs)
    for i, got in record:
        if not torch.equal(got.cpu(), draws[i][1]):
            sys.exit(f"step {i}: our step's anchors differ from the precomputed draw; the comparison is void")
    with torch.device("meta"):  # the geometry alone
        flops = StepFlops(DFlashDrafter(dcfg))
    per_step = [flops(len(draws[i][1]), bsz * seq, int(draws[i][1].sum())) for i in range(a.warmup, need)]
    useful = statistics.fmean(per_step)
    peak = peak_flops(dev)
    for r in results.values():
        r["tflops"] = useful / r["step_s_median"] / 1e12
        r["mfu"] = useful / r["step_s_median"] / peak if peak else None
    ours, theirs = results["ours"], results["specforge"]
    result = {
        "shape": a.shape, "batch": bsz, "seq": seq, "block_size": BLOCK, "draft_layers": LAYERS,
        "anchors_per_seq": ANCHORS, "anchors": a.anchors, "blocks_per_step": statistics.fmean(len(draws[i][1])
        for i in range(a.warmup, need)), "target_layer_ids": dcfg.target_layer_ids, "hidden": hidden, "vocab": vocab,
        "steps": a.steps, "warmup": a.warmup, "order": a.order, "sf_precision": a.sf_precision,
        "sf_attention": a.sf_attention, "useful_flops_per_step": useful, "peak_flops": peak, "shared_gb": shared_gb,
        "ours": ours, "specforge": theirs,
        "ratio_specforge_over_ours": theirs["step_s_median"] / ours["step_s_median"],  # step time; = MFU ours/theirs
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "specforge_version": sf.version,
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
