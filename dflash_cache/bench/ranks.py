"""`dflash bench ranks`: how evenly DDP ranks' steps are loaded, from the sample lengths alone (no
timing, so it runs anywhere)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from dflash_cache.bench.config import RanksBenchConfig
from dflash_cache.train.config import TrainConfig


def cache_lengths(cache: Path) -> tuple[np.ndarray, list[int] | None]:
    """A cache's sample lengths and its plan's bucket edges, for `rank_balance`."""
    from dflash_cache.cache.spec import read_spec
    from dflash_cache.train.batching import SampleTable
    from dflash_cache.train.index import open_units

    spec = read_spec(cache)
    return SampleTable.from_units(open_units(cache, spec=spec)[0]).length, list(spec.plan.bucket_edges) or None


def rank_balance(lengths: np.ndarray, *, token_budget: int = RanksBenchConfig.token_budget,
                 block_size: int | None = TrainConfig.block_size,
                 max_anchors: int = TrainConfig.max_anchors,
                 ranks: tuple[int, ...] = (2, 4, 8), bucket_edges: list[int] | None = None,
                 seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Predicted DDP speed-up over one rank, batches dealt as they come against dealt by cost (what
    `dflash train` does). A step lasts as long as its costliest rank's batch, with a batch's cost
    modelled by `cost.drafter_cost`; no timing, so it runs anywhere, on a cache's lengths."""
    from dflash_cache.cache.spec import default_bucket_edges
    from dflash_cache.train.batching import SampleTable, pack_and_deal
    from dflash_cache.train.cost import drafter_cost

    lengths = np.asarray(lengths, dtype=np.int64)
    table = SampleTable(np.zeros_like(lengths), np.zeros_like(lengths), lengths, np.arange(len(lengths)))
    edges = bucket_edges or default_bucket_edges(int(lengths.max()))
    block_size = block_size or TrainConfig(cache=Path(), out=Path()).family().default_block_size  # dflash train's
    cost_of = partial(drafter_cost, block_size=block_size, max_anchors=max_anchors)

    def dealt(world: int, by_cost: bool) -> list[list[np.ndarray]]:  # the same packing every time (same seed)
        return pack_and_deal(table, np.random.default_rng(seed), token_budget=token_budget, bucket_edges=edges,
                             world_size=world, final=False, batch_cost=cost_of if by_cost else None)[0]  # fmt: skip

    cost = np.array([cost_of(lengths[b]) for b in dealt(1, False)[0]])
    out: dict[str, Any] = {"samples": len(lengths), "batches": len(cost),
                           "batch_cost_spread": float(cost.max() / cost.min())}  # fmt: skip
    for w in ranks:
        for name, by_cost in (("as_they_come", False), ("by_cost", True)):
            per_rank = dealt(w, by_cost)
            steps = np.array([[cost_of(lengths[r[i]]) for r in per_rank] for i in range(len(per_rank[0]))])
            out[f"speedup_{w}_{name}"] = float(w * steps.mean(1).sum() / steps.max(1).sum())
    return out
