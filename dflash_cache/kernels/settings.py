"""How generation's GPU kernels run, as one value: which products a few-row step takes, the product
and attention kernels' tiles and launches, and whether greedy tokens come from the argmax kernels.

The defaults are what ships. A benchmark or a test that tries other settings makes another value
and passes it where generation is built (`SlotTarget`, `BlockProposer`, `Engine`); nothing is
patched. The compiled pieces that read a setting are specialised on it (dynamo guards on what
they read), so a target with other settings compiles its own pieces beside the default ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_cache.kernels.tiles import AttentionTiles, ProductTiles


@dataclass(frozen=True)
class KernelSettings:
    """The defaults are what ships. Other values run other kernels or cut the work otherwise, which
    changes the speed and may change the logits' last bits (the summation order)."""

    kernel_rows: int = 4  # a step of at most this many batch rows runs its products as `layer_products.KernelProducts`
    padded_tokens: int = 32  # or, where they do not serve, with each row's tokens padded to this many
    rope_in_product: bool = True  # KernelProducts' q/k/v projection rotates and writes the cache itself
    products: ProductTiles = field(default_factory=ProductTiles)  # the product kernel's tiles and launch
    attention: AttentionTiles = field(default_factory=AttentionTiles)  # the slot attention kernel's
    argmax: bool = True  # greedy tokens through `kernels.argmax` where it runs (False: torch's argmax)
    fused_drafts: bool = True  # a drafter family picks greedy drafts its own fused way (DSpark's Markov kernel)


DEFAULT_KERNELS = KernelSettings()
