"""`dflash extract --dry-run`: the plan and the size estimate, with nothing written."""

from __future__ import annotations

from typing import Any

from dflash_cache.extract.config import ExtractConfig


def extract_plan(cfg: ExtractConfig) -> dict[str, Any]:
    """What `dflash extract` would do with `cfg`: samples, tokens and padding, units (and how many
    are committed already), the tapped layers and how a token is stored, and the bytes it would write."""
    from dflash_cache.extract import stage as ex

    prep = ex.prepare(cfg, write=False)
    plan, spec = prep.plan, prep.spec
    return {
        "samples": plan.num_samples, "rejected": len(prep.tokens.rejected), "tokens": plan.num_tokens,
        "padded_tokens": plan.padded_tokens, "padding": round(plan.padding_ratio, 4),
        "units": len(plan.units), "units_committed": len(prep.done),
        "batches": sum(len(u.batches) for u in plan.units),
        "layers": spec.layers.ids, "storage": spec.storage.dtype, "mask_token_id": spec.tokenizer.mask_token_id,
        "mask_token": spec.tokenizer.mask_token,
        "final_hidden": spec.layers.final_hidden, **ex.final_bytes(spec), "parallel": spec.parallel,
        "projection": spec.projection and {"basis": spec.projection.basis, "rank": spec.projection.rank},
        "stored_values_per_token": spec.row_width,
        "raw_bf16_bytes_per_token": spec.raw_bf16_bytes_per_token,
        "estimated_bytes_max": ex.estimated_bytes(spec, plan.num_tokens),
    }  # fmt: skip
