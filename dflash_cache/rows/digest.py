"""Digests of what decides the tokens: the source's rows, the tokenizer, the chat template and the
encoder, for the tokenized-data cache key and cache.json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cache.rows.hub import check_source, load_split

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ENCODER_VERSION", "chat_template_digest", "sha256_json", "source_fingerprint", "tokenizer_digest"]

# Bump when the encoding of a row changes, so that tokenized data saved by an older version is
# not reused. 2: assistant turns located in the whole rendering; template kwargs; more row forms.
ENCODER_VERSION = 2

_fingerprints: dict[tuple, str] = {}


def source_fingerprint(path: str | Path, split: str | None = None) -> str:
    """What identifies the source's rows, so that the same data under another name or date is
    still the same data: the sha256 of a local source's bytes (a directory: its files' relative
    paths and bytes, in sorted order), or of a hub dataset's name, split and datasets' own
    fingerprint of the prepared split. A ``split`` is part of it."""
    p = Path(path)
    check_source(path)
    if not p.exists():
        rows = load_split(str(path), split, hub=True)
        return sha256_json(["hub", str(path), split, rows._fingerprint])
    digest = _local_fingerprint(p)
    return digest if split is None else sha256_json(["split", digest, split])


def _local_fingerprint(p: Path) -> str:
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if stats in _fingerprints:
        return _fingerprints[stats]
    h = hashlib.sha256()
    for f in files:
        if p.is_dir():
            name = f.relative_to(p).as_posix().encode()
            h.update(b"%d:%s:%d\0" % (len(name), name, f.stat().st_size))
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    digest = h.hexdigest()
    _fingerprints[stats] = digest
    return digest


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A sha256 of what decides the tokens: the backend tokenizer's JSON (without the per-call
    padding and truncation state) and the special tokens; stable across save and reload."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        state.pop("padding", None)
        state.pop("truncation", None)
        body: Any = state
    else:
        body = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    special = {
        name: [getattr(tokenizer, name, None), getattr(tokenizer, name + "_id", None)]
        for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
    }
    return sha256_json({"tokenizer": body, "special": special})


def chat_template_digest(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The sha256 of the chat template(s), or None when the tokenizer has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    if isinstance(template, str):
        return hashlib.sha256(template.encode()).hexdigest()
    return sha256_json(template)


def sha256_json(obj: Any) -> str:
    """The sha256 of ``obj`` as JSON with sorted keys (other types by their ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
