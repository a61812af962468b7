"""A committed unit of the cache: what it holds and how it is encoded, written, read and checked.

A unit is a Zarr v3 group. Each token-wise array is one shard whose inner chunks are a few MiB,
zstd-compressed with a content checksum, so a reader can fetch one sample without decoding the unit
and a flipped byte fails loudly. The group's own `zarr.json` carries a manifest (counts, file sizes,
and the sample index with its crc32) that catches truncated or missing files before any decode, and
that start-up reads as plain JSON.

- `layout.py`: the arrays a token has and their dtypes and shapes (`RowFormat`);
- `codec.py`: hidden states to and from their bf16 or fp8 storage bits;
- `manifest.py`: the manifest, built and read as plain JSON;
- `write.py`: a unit's Zarr group written;
- `read.py`: random access to a committed unit's samples (`UnitReader`);
- `shard.py`: a token-wise array's rows read from its shard file without zarr (`ShardRows`);
- `verify.py`: a unit checked against cache.json, and decoded in full.

This package is the only code that imports zarr. Where each rule lives: docs/architecture.md.
"""
