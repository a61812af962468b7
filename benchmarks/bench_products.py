"""A batch-1 step's products on a GPU: the product kernel (kernels/products.py) with and
without programmatic dependent launch, against cuBLAS, in the whole step and alone.

    python benchmarks/bench_products.py --shape smollm2-135m --out products.json

For a random-weight target of a named shape (`dflash_cache.bench.shapes.SHAPES`), each a replayed CUDA
graph:

- the slot target's step of 1, 2 and 8 tokens at each of `--contexts` (150): products by cuBLAS
  (`decoder.Products`, the compiler fusing the norms, activation and residuals around them), by
  the product kernel (`decoder.KernelProducts`, the default for up to `KernelSettings.kernel_rows`
  rows), by the kernels launched plainly (no early weight loads), the attention kernel alone
  launched plainly, the RoPE compiled apart from the q/k/v product, and with other settings of the
  kernels (`--variants`, fields of `kernels.settings.KernelSettings`: the product kernel's K
  slices, columns and pipelining, the attention's key blocks and pieces);
- each of those ways' products alone, each kind once a layer in a row (qkv, o, gate_up, down), at
  1 and 8 tokens: microseconds a product.

With `--markov`, instead: DSpark's greedy Markov kernel seven times in a row (a block's draft) and
the greedy argmax of a verify step's rows, alone, under each setting of their tiles given
(`AloneTiles`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import replay_ms, with_settings  # noqa: E402

from dflash_cache.bench.generate import random_model  # noqa: E402
from dflash_cache.bench.shapes import shape_config  # noqa: E402
from dflash_cache.generate.targets import SlotTarget  # noqa: E402
from dflash_cache.kernels import argmax as argmax_kernel  # noqa: E402
from dflash_cache.kernels import markov as markov_kernel  # noqa: E402
from dflash_cache.kernels.products import rows_product  # noqa: E402
from dflash_cache.kernels.settings import DEFAULT_KERNELS, KernelSettings  # noqa: E402
from dflash_cache.kernels.tiles import DEFAULT_MARKOV_TILES, MarkovTiles, ProductTiles  # noqa: E402

CUDA = torch.device("cuda")
KINDS = ("qkv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class AloneTiles:
    """The Markov and argmax kernels' tiles, as `--markov` sets them: `block_v=64,warps=4`."""

    block_v: int = DEFAULT_MARKOV_TILES.block_v
    block_r: int = DEFAULT_MARKOV_TILES.block_r
    warps: int = DEFAULT_MARKOV_TILES.warps
    argmax_block_v: int = argmax_kernel.BLOCK_V


def ways(variants: list[str]) -> dict[str, KernelSettings]:
    """Each way a step runs, as its kernel settings; a variant is settings such as
    `products.slice_k=512,attention.block_n=128`."""
    k, replace = DEFAULT_KERNELS, dataclasses.replace
    out = {"cuBLAS products": replace(k, kernel_rows=0),
           "kernel products": k,
           "kernel products, no PDL": replace(k, products=replace(k.products, pdl=False),
                                              attention=replace(k.attention, pdl=False)),
           "kernel products, attention launched without PDL": replace(k, attention=replace(k.attention, pdl=False)),
           "kernel products, RoPE compiled apart": replace(k, rope_in_product=False)}  # fmt: skip
    return out | {f"kernel products, {v}": with_settings(k, v) for v in variants}


def products_us(layers: list, tokens: int, tiles: ProductTiles) -> dict:
    """Each kind's products of every layer in a row, replayed: us a product."""
    x = torch.randn(tokens, layers[0].o.shape[1], device=CUDA, dtype=layers[0].o.dtype)
    inter = torch.randn(tokens, layers[0].down.shape[1], device=CUDA, dtype=x.dtype)

    def kind(name: str) -> None:
        for w in layers:
            rows_product(inter if name == "down" else x, getattr(w, name), None, None, None, 0.0, False, tiles)

    return {name: 1e3 * replay_ms(lambda n=name: kind(n), reps=50) / len(layers) for name in KINDS}


def markov_us(vocab: int, variants: list[str], rank: int = 256) -> dict:
    """DSpark's greedy Markov step (`markov_kernel`) seven times in a row, as a block's draft runs
    it, and the greedy argmax of a verify step's 8 rows (`argmax_kernel`), replayed under each
    setting of their tiles (`AloneTiles`): us a call, and the Markov step's W2 read in GB/s."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    base = torch.randn(1, 7, vocab, device=CUDA, generator=g).bfloat16()
    z = torch.randn(1, rank, device=CUDA, generator=g).bfloat16()
    w2 = (torch.randn(vocab, rank, device=CUDA, generator=g) * rank**-0.5).bfloat16()
    logits = torch.randn(1, 8, vocab, device=CUDA, generator=g).bfloat16()
    out = {}
    for name in ["default", *variants]:
        t = with_settings(AloneTiles(), "" if name == "default" else name)
        try:
            tiles = MarkovTiles(t.block_v, t.block_r, t.warps)
            us = 1e3 * replay_ms(lambda tiles=tiles: [markov_kernel.markov_argmax(base[:, k], z, w2, None, tiles)
                                                      for k in range(7)], reps=100) / 7  # fmt: skip
            argmax_us = 1e3 * replay_ms(lambda t=t: argmax_kernel.argmax(logits, t.argmax_block_v), reps=100)
            out[name] = {"markov_us": us, "markov_GBps": w2.numel() * 2 / us / 1e3, "argmax_8_rows_us": argmax_us}
        except Exception as e:  # noqa: BLE001 - a setting the GPU cannot build: say so, go on
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print("markov", name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--contexts", default="150", help="the contexts the steps start at, in one buffer: 150,1024")
    ap.add_argument("--length", type=int, help="the buffer's positions (default: the longest context + 64)")
    ap.add_argument("--variants", default="", help="other kernel settings to time, ';' between variants: "
                    "products.slice_k=512;products.stages=3,attention.block_n=64")  # fmt: skip
    ap.add_argument("--markov", default=None, help="time the Markov and argmax kernels alone under these "
                    "tiles (';' between; '' for the defaults) instead of the step: block_v=64,warps=4")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.markov is not None:
        shape = shape_config(args.shape)
        variants = [v for v in args.markov.split(";") if v]
        result = {"shape": args.shape, "device": torch.cuda.get_device_name(),
                  "markov": markov_us(shape["vocab_size"], variants)}
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    model = random_model(args.shape, CUDA)
    length = args.length or max(contexts) + 64
    ids = torch.randint(0, 1000, (1, 8), device=CUDA)
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "length": None, "ways": {}}  # fmt: skip
    for name, kernels in ways([v for v in args.variants.split(";") if v]).items():
        try:
            target = SlotTarget(model, 1, length, kernels=kernels)
            result["length"], row = target.length, {}
            for c in contexts:
                target.prefill([0], [tuple(range(3, 3 + c))])
                positions = (c + torch.arange(8, device=CUDA))[None]
                for T in (1, 2, 8):
                    step = lambda T=T, p=positions, t=target: t.step(ids[:, :T], p[:, :T])  # noqa: E731
                    row[f"step, {T} tokens, context {c}, ms"] = replay_ms(step, reps=100)
            if name != "cuBLAS products":
                for T in (1, 8):
                    row[f"us a product, {T} tokens"] = products_us(target.decoder.layers.layers, T, kernels.products)
        except Exception as e:  # noqa: BLE001 - a setting the GPU cannot build (its shared memory): say so, go on
            row = {"error": f"{type(e).__name__}: {e}"}
        result["ways"][name] = row
        print(name, json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
