"""Start-up at cache scale: `CacheLoader` to its first batch, and `audit.info`, on N tiny units.

A real 1B-token cache holds about 76,000 units, and start-up (every start, resume and rank) once
grew by about 5 ms a unit. This builds caches of N units of a few short samples each and times
what grows with N. Writing 100,000 units with `store.write_unit` (about 0.1 s each, fsyncs
included) would take hours, so a few template units are written with it and the rest are copies
of them, each with its own unit id and sample_index (the chunk re-encoded with the cache's own
zstd settings, the manifest updated to match); a sample of the copies is read back and checked.

    python benchmarks/bench_startup.py build /tmp/c100k --units 100000 [--legacy]   # --legacy: no manifest index
    python benchmarks/bench_startup.py time /tmp/c100k                                # JSON line of timings
    PYTHONPATH=/tmp/before python benchmarks/bench_startup.py time /tmp/c100k        # an older dflash_cache

`time` imports whichever `dflash_cache` is first on PYTHONPATH, so one cache times two versions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PER_UNIT = 4  # samples per unit
TEMPLATES = 8  # distinct units written with store.write_unit; the rest copy them


def build(cache: Path, units: int, *, legacy: bool = False, seed: int = 0) -> dict:
    """A cache of `units` units (tests/test_loader.py's geometry: 3 layers of width 8)."""
    from numcodecs import Zstd

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_loader import _spec, build_cache

    from dflash_cache.cache import store
    from dflash_cache.cache.spec import write_spec
    from dflash_cache.cache.unit.manifest import MANIFEST
    from dflash_cache.cache.unit.read import UnitReader

    t0 = time.perf_counter()
    if cache.exists():
        shutil.rmtree(cache)
    n_templates = min(TEMPLATES, units)
    build_cache(cache, units=n_templates, per_unit=PER_UNIT, seed=seed, max_len=40)
    write_spec(cache, _spec("bf16", units, units * PER_UNIT))
    spec = json.loads((cache / "cache.json").read_text())
    codec = Zstd(level=spec["storage"]["codec"]["level"], checksum=spec["storage"]["codec"]["checksum"])
    templates = [cache / store.UNITS / store.unit_name(t) for t in range(n_templates)]
    metas = [json.loads((t / MANIFEST).read_text()) for t in templates]
    # Source rows: the templates keep build_cache's (below 3 * their samples); the copies' follow, shuffled.
    rows = np.random.default_rng(seed).permutation(units * PER_UNIT * 2).astype(np.int64) + 3 * PER_UNIT * n_templates
    rows = rows[: units * PER_UNIT].reshape(units, PER_UNIT)
    rows[:n_templates] = [UnitReader(t).sample_index for t in templates]
    for u in range(units):
        src, meta = templates[u % n_templates], metas[u % n_templates]
        dst = cache / store.UNITS / store.unit_name(u)
        sample_index = rows[u]
        if u >= n_templates:
            _copy_unit(src, dst, meta, u, sample_index, codec, legacy)
        elif legacy:
            _drop_index(dst)
    seconds = time.perf_counter() - t0
    _check_copies(cache, rows, units)
    size = subprocess.run(["du", "-sk", str(cache)], capture_output=True, text=True).stdout.split()[0]
    return {"units": units, "build_s": round(seconds, 1), "disk_mib": round(int(size) / 1024, 1), "legacy": legacy}


def _copy_unit(src: Path, dst: Path, meta: dict, unit_id: int, sample_index: np.ndarray, codec, legacy: bool) -> None:
    """`src` as unit `unit_id` holding `sample_index`: what write_unit would have written for it."""
    meta = json.loads(json.dumps(meta))
    manifest = meta["attributes"]["dflash_unit"]
    tmp = dst.with_name(dst.name + ".tmp")
    for rel in manifest["files"]:
        os.makedirs(tmp / os.path.dirname(rel), exist_ok=True)
        shutil.copyfile(src / rel, tmp / rel)
    chunk = codec.encode(np.ascontiguousarray(sample_index, dtype="<i8").tobytes())
    (tmp / "sample_index" / "c" / "0").write_bytes(chunk)
    manifest["files"]["sample_index/c/0"] = len(chunk)
    manifest["id"] = unit_id
    if legacy:
        manifest.pop("index", None)
    elif "index" in manifest:
        from dflash_cache.cache.unit.manifest import index_crc

        offsets = np.asarray(manifest["index"]["offsets"], dtype=np.int64)
        manifest["index"].update(sample_index=sample_index.tolist(), crc32=index_crc(offsets, sample_index))
    (tmp / "zarr.json").write_text(json.dumps(meta, indent=2))
    os.rename(tmp, dst)


def _drop_index(unit: Path) -> None:
    """Make a unit look like one written before manifests held the index."""
    meta = json.loads((unit / "zarr.json").read_text())
    meta["attributes"]["dflash_unit"].pop("index", None)
    (unit / "zarr.json").write_text(json.dumps(meta, indent=2))


def _check_copies(cache: Path, rows: np.ndarray, units: int) -> None:
    """Some copies, read back through Zarr, hold the samples they should, and verify clean."""
    from dflash_cache.cache.store import committed_units
    from dflash_cache.cache.unit.layout import RowFormat
    from dflash_cache.cache.unit.read import UnitReader
    from dflash_cache.cache.unit.verify import verify_unit

    paths = committed_units(cache)
    assert len(paths) == units
    for u in sorted({0, units - 1, units // 2, *range(min(units, 12))}):
        reader = UnitReader(paths[u])
        decoded = reader.read_all("sample_index")
        np.testing.assert_array_equal(decoded, rows[u])
        np.testing.assert_array_equal(reader.sample_index, decoded)
        assert verify_unit(paths[u], RowFormat("bf16", 24, 3)) == [], u


def time_startup(cache: Path, token_budget: int = 600) -> dict:
    """Seconds to construct a CacheLoader, to its first batch (epoch plan included), and for info."""
    import torch

    import dflash_cache
    from dflash_cache.cache.audit import info
    from dflash_cache.train.loader import CacheLoader

    t0 = time.perf_counter()
    loader = CacheLoader(cache, token_budget=token_budget, device=torch.device("cpu"), readers=2)
    t1 = time.perf_counter()
    batch = next(iter(loader.epoch(0)))
    t2 = time.perf_counter()
    samples = len(loader.table)
    loader.close()
    t3 = time.perf_counter()
    facts = info(cache)
    t4 = time.perf_counter()
    assert facts["samples"] == samples and facts["unreadable_units"] == [] and batch.num_tokens > 0
    return {
        "code": str(Path(dflash_cache.__file__).parents[1]),
        "units": facts["units"],
        "samples": samples,
        "loader_open_s": round(t1 - t0, 2),
        "first_batch_s": round(t2 - t0, 2),
        "info_s": round(t4 - t3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("cache", type=Path)
    b.add_argument("--units", type=int, required=True)
    b.add_argument("--legacy", action="store_true", help="no index in the manifests, as caches written before it")
    t = sub.add_parser("time")
    t.add_argument("cache", type=Path)
    t.add_argument("--token-budget", type=int, default=600)
    args = ap.parse_args()
    if args.cmd == "build":
        print(json.dumps(build(args.cache, args.units, legacy=args.legacy)))
    else:
        print(json.dumps(time_startup(args.cache, args.token_budget)))


if __name__ == "__main__":
    main()
