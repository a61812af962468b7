"""Rows -> (input_ids, loss_mask): one row (:func:`encode_row`), or a whole source once, cached
(:func:`tokenize`).

The loss mask of a conversation comes from its chat template (see :mod:`dflash_cache.rows.chat`);
plain text is supervised throughout. Bad rows (malformed, empty, nothing to learn, too long) are
rejected with a reason instead of crashing the run; problems that concern every row (no such file,
no chat template, a template whose mask cannot be trusted, every row rejected) raise
:class:`DataError`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets

from dflash_cache.rows.chat import (
    DataError,
    DataWarning,
    RowRejected,
    check_generation_markers,
    check_template_kwargs,
    encode_chat,
    has_generation_markers,
    tokenize_text,
)
from dflash_cache.rows.digest import (
    ENCODER_VERSION,
    chat_template_digest,
    sha256_json,
    source_fingerprint,
    tokenizer_digest,
)
from dflash_cache.rows.forms import conversation
from dflash_cache.rows.sources import check_max_samples, cut_warning, json_type, read_rows, source_row

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TOKENIZED_FEATURES", "Tokenized", "encode_row", "tokenize"]

log = logging.getLogger(__name__)

TOKENIZED_FEATURES = datasets.Features(
    {
        "sample_index": datasets.Value("int64"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("uint8")),
        "length": datasets.Value("int32"),
    }
)
_MAPPED_FEATURES = datasets.Features({**TOKENIZED_FEATURES, "reason": datasets.Value("string")})


@dataclass
class Tokenized:
    """The result of :func:`tokenize`.

    ``dataset`` holds the accepted rows only, in source order, with the columns
    ``sample_index`` (int64, the row number in the source), ``input_ids`` (int32 list),
    ``loss_mask`` (uint8 list) and ``length`` (int32). ``rejected`` lists
    ``(source row number, reason)``; ``num_rows`` counts the source rows, accepted or not.
    """

    dataset: datasets.Dataset
    rejected: list[tuple[int, str]]
    num_rows: int
    reused: bool = False  # loaded from a previous run's work_dir instead of tokenized again
    cut_short: str | None = None  # the source is a JSON array cut short: what was read of it


def encode_row(
    row: dict,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncate: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Encode one row (any form :func:`conversation` reads) as ``(input_ids, loss_mask)``.

    A conversation goes through the chat template, with ``template_kwargs`` (``enable_thinking``
    and the like); ``input_ids`` are exactly what ``apply_chat_template`` gives the whole row and
    the mask is on the assistant turns as rendered, each with its end-of-turn token. A ``text``
    row is plain text (special tokens as the tokenizer adds them), the mask all ones.

    Raises :class:`RowRejected` for a row that cannot be used, and :class:`DataError` when no row
    of this form could be (a chat row with a tokenizer that has no chat template, or a template
    whose assistant turns cannot be located).
    """
    messages = conversation(row)
    if messages is not None:
        ids, mask = encode_chat(messages, tokenizer, template_kwargs)
    else:
        text = source_row(row)["text"]
        if not isinstance(text, str):
            raise RowRejected(f"wrong type: text must be a string, got {json_type(text)}")
        if not text:
            raise RowRejected("empty text: the text field is empty")
        ids = tokenize_text(tokenizer, text, add_special_tokens=True)
        mask = [1] * len(ids)
    if len(ids) > max_length:
        if not truncate:
            raise RowRejected(f"too long: {len(ids)} tokens > max_length {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            raise RowRejected(f"no supervised token: none left after truncation to {max_length}")
    if not any(mask):
        raise RowRejected("no supervised token: the assistant turns produced no token")
    return ids, mask


def tokenize(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncate: bool = False,
    num_proc: int = 1,
    work_dir: Path | None = None,
    *,
    save: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    split: str | None = None,
    max_samples: int | None = None,
) -> Tokenized:
    """Tokenize a source (a path or a hub dataset name, see :func:`read_rows`) once.

    With ``work_dir``, the result is saved in ``work_dir/tokenized-<key>/`` (built in a temporary
    directory and renamed into place, so a crash or a concurrent run never leaves half of it),
    where the key digests the source content and split, ``max_samples``, the tokenizer, the chat
    template and its kwargs, ``max_length`` and ``truncate``. A later call with the same inputs
    memory-maps it instead of tokenizing again. Without ``work_dir`` everything stays in memory;
    with ``save=False`` a saved result is reused but nothing is written (``--dry-run``).

    Raises :class:`DataError` for a missing or unreadable source, a chat template that cannot
    give a trustworthy mask, or when every row is rejected (with the most common reasons).
    """
    kwargs = check_template_kwargs(template_kwargs)
    check_max_samples(max_samples)
    if max_length < 1:
        raise DataError(f"max_length must be positive, got {max_length}")
    local = Path(path)
    src = str(path)
    key = sha256_json(
        {
            "encoder": ENCODER_VERSION,
            "source": source_fingerprint(path, split),
            "form": ("dir" if local.is_dir() else local.suffix.lower()) if local.exists() else "hub",
            "split": split,
            "max_samples": max_samples,
            "tokenizer": tokenizer_digest(tokenizer),
            "chat_template": chat_template_digest(tokenizer),
            "template_kwargs": kwargs,
            "max_length": max_length,
            "truncate": truncate,
        }
    )
    final = Path(work_dir) / f"tokenized-{key[:24]}" if work_dir is not None else None
    if final is not None and (final / "meta.json").exists():
        loaded = _load_tokenized(final, key)
        if loaded is not None:
            log.info("reusing tokenized data in %s", final)
            if loaded.cut_short:  # the rows were read by an earlier run: its warning still holds
                warnings.warn(loaded.cut_short, DataWarning, stacklevel=2)
            return loaded
        shutil.rmtree(final, ignore_errors=True)  # unreadable: build it again

    if has_generation_markers(tokenizer):
        check_generation_markers(tokenizer, kwargs)  # fail before touching any row

    if not save:
        final = None
    scratch = None
    if final is not None:
        scratch = final.with_name(f".scratch-{key[:24]}-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    try:
        rows = read_rows(path, cache_dir=scratch / "rows" if scratch else None, split=split, max_samples=max_samples)
        result = _tokenize_rows(src, rows, tokenizer, max_length, truncate, num_proc, key, scratch, kwargs)
        result.cut_short = cut_warning(local) if local.is_file() else None
        if final is None:
            return result
        return _save_tokenized(result, final, scratch / "out", key)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _tokenize_rows(
    src: str,
    rows: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncate: bool,
    num_proc: int,
    key: str,
    scratch: Path | None,
    template_kwargs: dict[str, Any],
) -> Tokenized:
    num_rows = len(rows)
    if num_rows == 0:
        raise DataError(f"{src} holds no rows")
    columns = rows.column_names

    def encode_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in _MAPPED_FEATURES}
        for j, index in enumerate(indices):
            row = {c: batch[c][j] for c in columns}
            try:
                ids, mask = encode_row(row, tokenizer, max_length, truncate, template_kwargs)
                reason = ""
            except RowRejected as e:
                ids, mask, reason = [], [], e.reason
            out["sample_index"].append(index)
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["length"].append(len(ids))
            out["reason"].append(reason)
        return out

    procs = max(1, min(int(num_proc), num_rows))
    mapped = rows.map(
        encode_batch,
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=columns,
        features=_MAPPED_FEATURES,
        num_proc=procs if procs > 1 else None,
        new_fingerprint=key[:40],
        keep_in_memory=scratch is None,
        cache_file_name=str(scratch / "mapped.arrow") if scratch is not None else None,
        desc="tokenizing",
    )
    reasons = list(mapped["reason"])
    rejected = [(i, r) for i, r in enumerate(reasons) if r]
    accepted = [i for i, r in enumerate(reasons) if not r]
    if not accepted:
        raise DataError(_all_rejected_message(src, rejected))
    dataset = mapped.remove_columns("reason").select(accepted)
    return Tokenized(dataset=dataset, rejected=rejected, num_rows=num_rows)


def _all_rejected_message(src: str, rejected: list[tuple[int, str]]) -> str:
    by_kind = Counter(reason.split(":", 1)[0] for _, reason in rejected)
    example = {}
    for _, reason in rejected:
        example.setdefault(reason.split(":", 1)[0], reason)
    top = "; ".join(f"{n} x {example[kind]}" for kind, n in by_kind.most_common(3))
    return f"every row of {src} was rejected ({len(rejected)} rows): {top}"


def _save_tokenized(result: Tokenized, final: Path, tmp: Path, key: str) -> Tokenized:
    result.dataset.save_to_disk(str(tmp))
    meta = {"key": key, "num_rows": result.num_rows, "rejected": result.rejected, "cut_short": result.cut_short}
    (tmp / "meta.json").write_text(json.dumps(meta))
    try:
        tmp.rename(final)
    except OSError:
        if not (final / "meta.json").exists():  # not a concurrent run that got there first
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    loaded = _load_tokenized(final, key)
    if loaded is None:
        raise DataError(f"cannot reload the tokenized data just saved in {final}")
    loaded.reused = False
    return loaded


def _load_tokenized(final: Path, key: str) -> Tokenized | None:
    try:
        meta = json.loads((final / "meta.json").read_text())
        if meta.get("key") != key:
            return None
        dataset = datasets.load_from_disk(str(final))
    except (OSError, ValueError, FileNotFoundError) as e:
        log.warning("ignoring unreadable tokenized data in %s: %s", final, e)
        return None
    rejected = [(int(i), str(r)) for i, r in meta["rejected"]]
    return Tokenized(dataset=dataset, rejected=rejected, num_rows=int(meta["num_rows"]), reused=True,
                     cut_short=meta.get("cut_short"))  # fmt: skip
