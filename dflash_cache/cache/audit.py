"""Whole-cache questions: what is in it (`dflash info`) and is every byte sound (`dflash verify`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_cache.cache.projection import PROJECTION, Basis, CorruptBasis
from dflash_cache.cache.spec import read_spec
from dflash_cache.cache.store import PARTIAL, committed_units, unit_name
from dflash_cache.cache.unit.layout import FINAL_ARRAYS, RowFormat
from dflash_cache.cache.unit.read import CorruptUnit, UnitReader
from dflash_cache.cache.unit.verify import verify_unit


def info(cache_dir: Path) -> dict[str, Any]:
    """Spec, counts, bytes on disk and compression ratio, from the committed units themselves."""
    spec = read_spec(cache_dir)
    units = committed_units(cache_dir)
    samples = tokens = nbytes = final_bytes = 0
    bad = []
    for path in units.values():
        try:
            r = UnitReader(path)
        except CorruptUnit as e:
            bad.append(str(e))
            continue
        samples += r.n_samples
        tokens += r.n_tokens
        nbytes += r.nbytes
        final_bytes += sum(size for rel, size in r.files.items() if rel.split("/", 1)[0] in FINAL_ARRAYS)
    row = RowFormat.of(spec)
    raw = tokens * row.row_bytes
    taps_bf16 = spec.raw_bf16_bytes_per_token
    taps_on_disk = (nbytes - final_bytes) / tokens if tokens else 0.0
    partial = Path(cache_dir) / PARTIAL
    final = {}
    if row.final:  # what the final hidden state adds to each token: raw, and as stored (compressed)
        final = {"final_hidden_bytes_per_token": row.final_bytes,
                 "final_hidden_bytes_on_disk_per_token": final_bytes / tokens if tokens else 0.0}  # fmt: skip
    return {
        "spec": spec.to_dict(),
        "units": len(units),
        "units_planned": spec.plan.num_units,
        "complete": len(units) == spec.plan.num_units,
        "samples": samples,
        "tokens": tokens,
        "bytes_on_disk": nbytes,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "compression_ratio": raw / nbytes if nbytes else 0.0,
        # the tapped layers' share of the disk (ids and mask included, the final state not) against raw bf16
        "raw_bf16_bytes_per_token": taps_bf16,
        "fraction_of_raw_bf16": taps_on_disk / taps_bf16 if tokens else 0.0,
        **({"retained_energy": spec.projection.retained_energy} if spec.projection else {}),
        "final_hidden": spec.layers.final_hidden,
        **final,
        "partial_entries": len(list(partial.iterdir())) if partial.is_dir() else 0,
        "unreadable_units": bad,
    }


def verify(cache_dir: Path, *, present_only: bool = False) -> dict[str, list[str]]:
    """Decode every committed unit; maps each bad unit's name to its problems (empty: all sound).
    A projected cache's basis is checked against cache.json's digest too (`projection.safetensors`).

    Also checks that no sample appears in two units and that every unit holds what the plan
    says, so a cache that lost or duplicated samples does not pass. A planned unit that is not
    committed is a problem too (an incomplete cache would train on part of the data), unless
    `present_only` asks about the committed units alone (a cache still being extracted).
    """
    spec = read_spec(cache_dir)
    bad: dict[str, list[str]] = {}
    seen: dict[int, str] = {}
    if spec.projection is not None:
        try:
            Basis.load(cache_dir, spec)
        except CorruptBasis as e:
            bad[PROJECTION] = [str(e)]
    units = committed_units(cache_dir)
    if not present_only:
        for uid in sorted(set(range(spec.plan.num_units)) - set(units)):
            bad[unit_name(uid)] = [f"not committed (the plan has {spec.plan.num_units} units)"]
    for uid, path in units.items():
        problems = verify_unit(path, RowFormat.of(spec))
        if uid >= spec.plan.num_units:
            problems.append(f"unit id {uid} is beyond the plan's {spec.plan.num_units} units")
        if not problems:
            reader = UnitReader(path)
            for s in reader.sample_index.tolist():
                if s in seen:
                    problems.append(f"sample {s} is also in {seen[s]}")
                    break
                seen[s] = path.name
        if problems:
            bad[path.name] = problems
    return bad
