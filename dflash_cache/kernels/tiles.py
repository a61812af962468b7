"""Each kernel's tiles: how it cuts and launches its work, as a frozen value its callers pass in.

Kept apart from the kernels so that settings and interfaces that name them (`KernelSettings`, a
drafter family's `bind`) import no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProductTiles:
    """How the product kernel (`products.py`) cuts and launches a product. Every value gives the same results, each
    token's bits whatever the step holds; they differ in speed."""

    block_t: int = 16  # rows (tokens) a program takes at once, whatever the step holds
    cols: int = 16  # output columns a program owns
    slice_k: int = 256  # K a warp sums: a program sums K (padded to a power of two) in slices of this, side by side
    warps: int = 0  # warps a program runs (0: one a slice)
    stages: int = 1  # Triton's pipelining of the loop over rows (1: none, the fastest one-row step; 3 is Triton's)
    pdl: bool = True  # programmatic dependent launch where the GPU has it (`triton_support.pdl_options`)

    def args(self) -> tuple[int, int, int, int, int, bool]:
        """The tiles as the custom ops take them."""
        return self.block_t, self.cols, self.slice_k, self.warps, self.stages, self.pdl


@dataclass(frozen=True)
class AttentionTiles:
    """How the slot attention kernel (`slot_attention.py`) cuts and launches a step's attention. A
    query's bits depend on these (its keys' blocks and pieces), never on the step around it."""

    block_m: int = 16  # query rows (token x head of the group) a program holds
    block_n: int = 128  # keys a block
    split: int = 256  # keys a program walks in a buffer longer than this; a multiple of block_n
    warps: int = 4
    pdl: bool = True  # programmatic dependent launch where the GPU has it (`triton_support.pdl_options`)


@dataclass(frozen=True)
class LossTiles:
    """How the loss kernel (`loss.py`) walks and launches a chunk's rows. The defaults are what ships; a benchmark
    passes others (benchmarks/bench_loss.py --tiles). They differ in speed, and may change the loss's
    last bits (the order of float32 sums)."""

    block: int = 2048  # logits a program reads at once, of its one row
    warps: int = 8  # warps a program runs


@dataclass(frozen=True)
class MarkovTiles:
    """How the Markov kernel (`markov.py`, `markov_argmax`) cuts and launches a slot's work. The
    defaults are what ships; a benchmark passes others. They differ in speed, and may change a
    logit's last bits (the product's summation order)."""

    block_v: int = 128  # vocabulary rows a program takes
    block_r: int = 64  # of the rank, summed at once
    warps: int = 8  # an H200 reads W2 at 3.6 TB/s with 8 warps a program, 2.6 with 4

    def args(self) -> tuple[int, int, int]:
        """The tiles as the custom op takes them."""
        return self.block_v, self.block_r, self.warps


# What ships: each kernel's default, and what `KernelSettings` starts from.
DEFAULT_PRODUCT_TILES = ProductTiles()
DEFAULT_ATTENTION_TILES = AttentionTiles()
DEFAULT_LOSS_TILES = LossTiles()
DEFAULT_MARKOV_TILES = MarkovTiles()
