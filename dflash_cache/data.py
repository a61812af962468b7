"""Source rows -> (input_ids, loss_mask), and the rows that cannot be used, with a reason.

A drafter learns only where ``loss_mask`` is 1 (DESIGN.md section 2: anchors and loss positions
are response tokens), so the mask is the one thing here that must never be silently wrong:

- With ``{% generation %}`` markers in the chat template, transformers' assistant-token mask is
  used, after a probe conversation has shown that the markers really cover the replies.
- Without markers, each assistant turn's tokens are found by rendering the conversation up to the
  turn (with the generation prompt) and with the turn: the tokens in between are the turn. That is
  only true if both renderings are exact token prefixes of the full conversation; a row where they
  are not is rejected, never given a guessed mask.

Bad rows (malformed, empty, nothing to learn, too long) are rejected with a reason instead of
crashing the run; problems that concern every row (no such file, no chat template, a template
whose mask cannot be trusted, every row rejected) raise :class:`DataError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets

from .errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ROLES",
    "DataError",
    "RowRejected",
    "Tokenized",
    "chat_template_digest",
    "encode_row",
    "read_rows",
    "source_fingerprint",
    "tokenize",
    "tokenizer_digest",
]

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Bump when the encoding of a row changes, so that tokenized data saved by an older version is
# not reused.
ENCODER_VERSION = 1

# Private columns of rows read from JSON text: the raw bytes of each row and its line number.
RAW = "__dflash_raw_json__"
LINE = "__dflash_line__"
_RAW_FEATURES = datasets.Features({RAW: datasets.Value("binary"), LINE: datasets.Value("int64")})

TOKENIZED_FEATURES = datasets.Features(
    {
        "sample_index": datasets.Value("int64"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("uint8")),
        "length": datasets.Value("int32"),
    }
)
_MAPPED_FEATURES = datasets.Features({**TOKENIZED_FEATURES, "reason": datasets.Value("string")})

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class DataError(UserError):
    """A problem with the input as a whole; the message is meant to be printed as one line."""


class RowRejected(Exception):
    """One source row cannot be used; ``reason`` says why (``"category: detail"``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


def read_rows(path: str | Path, cache_dir: str | Path | None = None) -> datasets.Dataset:
    """Read a local JSON Lines, JSON, Parquet file or a ``save_to_disk`` directory.

    JSON text is not parsed here: each row becomes its raw bytes (and line number), parsed one by
    one when it is encoded, so that one bad line (invalid JSON or UTF-8, a value of another type
    than its neighbours) becomes one rejected row instead of a failed load. A JSON file is either
    one top-level array of rows (read whole, so prefer JSON Lines for big data) or JSON Lines.

    With ``cache_dir``, JSON Lines and Parquet rows are written there as Arrow files and
    memory-mapped (what you want for big inputs and ``num_proc``); without it they are held in
    memory. A saved dataset directory is always memory-mapped where it is.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"data source not found: {p}")
    if p.is_dir():
        return _read_saved_dataset(p)
    suffix = p.suffix.lower()
    if suffix == ".json" and _first_non_space_byte(p) == b"[":
        raw = [json.dumps(row, ensure_ascii=False).encode() for row in _read_json_array(p)]
        return datasets.Dataset.from_dict({RAW: raw, LINE: [None] * len(raw)}, features=_RAW_FEATURES)
    if suffix in JSONL_SUFFIXES or suffix == ".json":
        if cache_dir is None:
            rows = list(_iter_jsonl(str(p)))
            return datasets.Dataset.from_list(rows, features=_RAW_FEATURES) if rows else _empty_raw()
        return datasets.Dataset.from_generator(
            _iter_jsonl,
            features=_RAW_FEATURES,
            gen_kwargs={"path": str(p)},
            cache_dir=str(cache_dir),
            fingerprint=_sha256_json(["jsonl", source_fingerprint(p), ENCODER_VERSION]),
        )
    if suffix == ".parquet":
        try:
            if cache_dir is None:
                import pyarrow.parquet as pq

                return datasets.Dataset(pq.read_table(p))
            return datasets.Dataset.from_parquet(str(p), cache_dir=str(cache_dir))
        except Exception as e:  # pyarrow raises several unrelated types for a bad file
            raise DataError(f"cannot read Parquet file {p}: {_short(e)}") from e
    raise DataError(
        f"unsupported data source {p}: expected a .jsonl, .json or .parquet file or a directory "
        "saved with datasets' save_to_disk"
    )


def _read_saved_dataset(p: Path) -> datasets.Dataset:
    if not ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
        raise DataError(
            f"{p} is a directory but not one saved with datasets' save_to_disk (no dataset_dict.json or state.json)"
        )
    try:
        loaded = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"cannot load the saved dataset {p}: {_short(e)}") from e
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise DataError(
            f"{p} holds the splits {sorted(loaded)} and none is called 'train': save the split to use on its own"
        )
    return loaded


def _first_non_space_byte(p: Path) -> bytes:
    with open(p, "rb") as f:
        while chunk := f.read(1 << 16):
            stripped = chunk.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()
            if stripped:
                return stripped[:1]
    return b""


def _read_json_array(p: Path) -> list[Any]:
    try:
        with open(p, "rb") as f:
            rows = json.loads(f.read().removeprefix(b"\xef\xbb\xbf"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{p} is not valid JSON ({_short(e)}); JSON Lines (.jsonl) tolerates bad lines") from e
    if not isinstance(rows, list):
        raise DataError(f"{p}: a JSON file must hold one array of rows")
    return rows


def _iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """Raw rows of a JSON Lines file: one per non-blank line, with its line number."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if lineno == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if line.strip():
                yield {RAW: line.rstrip(b"\r\n"), LINE: lineno}


def _empty_raw() -> datasets.Dataset:
    return datasets.Dataset.from_dict({RAW: [], LINE: []}, features=_RAW_FEATURES)


def source_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row of `read_rows` as the source wrote it (JSON Lines are kept raw until now)."""
    return _parse_raw(row[RAW], row.get(LINE)) if RAW in row else row


def _parse_raw(raw: bytes, line: int | None) -> dict[str, Any]:
    where = f" (line {line})" if line is not None else ""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowRejected(f"invalid UTF-8: {e.reason} at byte {e.start}{where}") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowRejected(f"invalid JSON: {e.msg.removesuffix(' at')} at column {e.colno}{where}") from None
    except ValueError as e:  # e.g. a number too long to convert
        raise RowRejected(f"invalid JSON: {_short(e)}{where}") from None
    if not isinstance(row, dict):
        raise RowRejected(f"not a JSON object: got {_json_type(row)}{where}")
    return row


# ------------------------------------------------------------------------------------------------
# Encoding one row
# ------------------------------------------------------------------------------------------------


def encode_row(
    row: dict, tokenizer: PreTrainedTokenizerBase, max_length: int, truncate: bool
) -> tuple[list[int], list[int]]:
    """Encode one parsed row as ``(input_ids, loss_mask)``.

    Row forms (a ``None`` value counts as absent, as in Arrow tables with optional columns, and
    the first form present wins): ``{"messages": [{"role", "content"}, ...]}`` through the chat
    template, the mask on assistant tokens only; ``{"prompt", "response"}`` as one user and one
    assistant turn; ``{"text"}`` as plain text (special tokens as the tokenizer adds them), the
    mask all ones.

    Raises :class:`RowRejected` for a row that cannot be used, and :class:`DataError` when no row
    of this form could be (a chat row with a tokenizer that has no chat template, or a template
    whose generation markers do not cover the replies).
    """
    if not isinstance(row, dict):
        raise RowRejected(f"malformed row: expected an object, got {_json_type(row)}")
    row = source_row(row)
    messages = row.get("messages")
    if messages is not None:
        ids, mask = _encode_chat(check_messages(messages), tokenizer)
    elif row.get("prompt") is not None or row.get("response") is not None:
        prompt, response = row.get("prompt"), row.get("response")
        for name, other, value in (("prompt", "response", prompt), ("response", "prompt", response)):
            if value is None:
                raise RowRejected(f"missing field: a row with {other} needs {name} too")
            if not isinstance(value, str):
                raise RowRejected(f"wrong type: {name} must be a string, got {_json_type(value)}")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        ids, mask = _encode_chat(messages, tokenizer)
    elif row.get("text") is not None:
        text = row["text"]
        if not isinstance(text, str):
            raise RowRejected(f"wrong type: text must be a string, got {_json_type(text)}")
        if not text:
            raise RowRejected("empty text: the text field is empty")
        ids = _tokenize_text(tokenizer, text, add_special_tokens=True)
        mask = [1] * len(ids)
    else:
        present = sorted(k for k, v in row.items() if v is not None)
        raise RowRejected(
            "missing field: a row needs messages, prompt and response, or text"
            f" (it has {', '.join(present) if present else 'no fields'})"
        )
    if len(ids) > max_length:
        if not truncate:
            raise RowRejected(f"too long: {len(ids)} tokens > max_length {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            raise RowRejected(f"no supervised token: none left after truncation to {max_length}")
    if not any(mask):
        raise RowRejected("no supervised token: the assistant turns produced no token")
    return ids, mask


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate a conversation; return its messages with ``None`` fields dropped."""
    if not isinstance(messages, list):
        raise RowRejected(f"wrong type: messages must be a list, got {_json_type(messages)}")
    if not messages:
        raise RowRejected("empty conversation: messages is an empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowRejected(f"wrong type: message {i} must be an object, got {_json_type(m)}")
        m = {k: v for k, v in m.items() if v is not None}
        for key in ("role", "content"):
            if key not in m:
                raise RowRejected(f"missing field: message {i} has no {key}")
            if not isinstance(m[key], str):
                raise RowRejected(f"wrong type: message {i} {key} must be a string, got {_json_type(m[key])}")
        if m["role"] not in ROLES:
            raise RowRejected(f"unknown role: message {i} has role {m['role']!r} (expected {', '.join(ROLES)})")
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise RowRejected("no assistant turn: nothing to learn from this conversation")
    return out


def _encode_chat(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    template = _template(tokenizer)
    if template is None:
        raise DataError(
            "the tokenizer has no chat template, so rows in messages or prompt/response form "
            "cannot be tokenized: use a tokenizer with a chat template, or text rows"
        )
    if _GENERATION_MARKER.search(template) and getattr(tokenizer, "is_fast", False):
        _check_generation_markers(tokenizer, template)
        out = _call(
            tokenizer.apply_chat_template,
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids = [int(t) for t in out["input_ids"]]
        mask = [1 if m else 0 for m in out["assistant_masks"]]
        return ids, mask
    return _prefix_diff_mask(messages, tokenizer)


def _prefix_diff_mask(
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[int], list[int]]:
    """The loss mask of a template without generation markers, from renderings of prefixes.

    Assistant turn i's tokens are those between the rendering of messages[:i] with the
    generation prompt and that of messages[:i+1], up to and including its last end-of-turn
    (eos) token: what follows it (a newline in ChatML) is formatting, not something the model
    generates. Both renderings must be exact token prefixes of the whole conversation's, or the
    span would be a guess, and the row is rejected.
    """
    full = _render_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise RowRejected(
                "assistant turn first: without generation markers in the chat template the "
                "tokens of an opening assistant turn cannot be located"
            )
        head = _render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        turn = _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        for what, part in (("prompt of", head), ("conversation up to", turn)):
            if full[: len(part)] != part:
                raise RowRejected(
                    f"chat template not prefix-stable: the {what} assistant turn {i} does not "
                    "render as a prefix of the whole conversation, so its tokens cannot be "
                    "located; add {% generation %} markers to the template"
                )
        start, end = len(head), len(turn)
        if eos is not None and eos in full[start:end]:
            end = start + max(j for j, t in enumerate(full[start:end]) if t == eos) + 1
        for j in range(start, end):
            mask[j] = 1
    return full, mask


def _render_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> list[int]:
    text = _call(
        tokenizer.apply_chat_template,
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    return _tokenize_text(tokenizer, text, add_special_tokens=False)


def _tokenize_text(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> list[int]:
    try:
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:
        raise RowRejected(f"tokenizer error: {_short(e)}") from None
    return [int(t) for t in ids]


def _call(fn, *args, **kwargs):
    """Call a chat-template function; a template that fails on this row rejects the row."""
    try:
        return fn(*args, **kwargs)
    except (DataError, RowRejected):
        raise
    except Exception as e:  # jinja2 raises many types (raise_exception, undefined, ...)
        raise RowRejected(f"chat template error: {_short(e)}") from None


def _template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


_PROBE = [
    {"role": "user", "content": "Probe question one?"},
    {"role": "assistant", "content": "Probe reply one."},
    {"role": "user", "content": "Probe question two?"},
    {"role": "assistant", "content": "Probe reply two."},
]
_PROBE_SYSTEM = {"role": "system", "content": "Probe system prompt."}
_marker_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_generation_markers(tokenizer: PreTrainedTokenizerBase, template: str) -> None:
    """Check once per tokenizer and template that the generation markers cover the replies.

    The masked tokens of two probe conversations (two exchanges, without and with a system turn,
    so both the last-turn and earlier-turn branches render) must decode to text holding each reply
    and no other message; otherwise masks from this template would be wrong, which is a DataError.
    A template that cannot render a probe is not judged on it: its rows fail on their own.
    """
    try:
        verdicts = _marker_verdicts.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: check every time
        verdicts = {}
    if template not in verdicts:
        verdicts[template] = _probe_markers(tokenizer)
    if verdicts[template] is not None:
        raise DataError(verdicts[template])


def _probe_markers(tokenizer: PreTrainedTokenizerBase) -> str | None:
    for probe in (_PROBE, [_PROBE_SYSTEM, *_PROBE]):
        try:
            out = tokenizer.apply_chat_template(
                probe, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception:  # e.g. a template that refuses system turns: nothing to judge
            continue
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
        replies = [m["content"] for m in probe if m["role"] == "assistant"]
        others = [m["content"] for m in probe if m["role"] != "assistant"]
        if not all(r in masked for r in replies) or any(o in masked for o in others):
            return (
                "the chat template's {% generation %} markers do not cover exactly the assistant replies "
                f"(a probe conversation's supervised text was {masked[:120]!r}), so its loss mask cannot be "
                "trusted: fix the markers, or remove them to locate replies by prefixes"
            )
    return None


# ------------------------------------------------------------------------------------------------
# Tokenizing a source
# ------------------------------------------------------------------------------------------------


def tokenize(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncate: bool = False,
    num_proc: int = 1,
    work_dir: Path | None = None,
) -> Tokenized:
    """Tokenize a source once.

    With ``work_dir``, the result is saved in ``work_dir/tokenized-<key>/`` (built in a temporary
    directory and renamed into place, so a crash or a concurrent run never leaves half of it),
    where the key digests the source content, the tokenizer, the chat template, ``max_length``
    and ``truncate``. A later call with the same inputs memory-maps it instead of tokenizing
    again. Without ``work_dir`` everything stays in memory.

    Raises :class:`DataError` for a missing or unreadable source, a chat template that cannot
    give a trustworthy mask, or when every row is rejected (with the most common reasons).
    """
    src = Path(path)
    if not src.exists():
        raise DataError(f"data source not found: {src}")
    if max_length < 1:
        raise DataError(f"max_length must be positive, got {max_length}")
    key = _sha256_json(
        {
            "encoder": ENCODER_VERSION,
            "source": source_fingerprint(src),
            "form": "dir" if src.is_dir() else src.suffix.lower(),
            "tokenizer": tokenizer_digest(tokenizer),
            "chat_template": chat_template_digest(tokenizer),
            "max_length": max_length,
            "truncate": truncate,
        }
    )
    final = Path(work_dir) / f"tokenized-{key[:24]}" if work_dir is not None else None
    if final is not None and (final / "meta.json").exists():
        loaded = _load_tokenized(final, key)
        if loaded is not None:
            log.info("reusing tokenized data in %s", final)
            return loaded
        shutil.rmtree(final, ignore_errors=True)  # unreadable: build it again

    template = _template(tokenizer)
    if template and _GENERATION_MARKER.search(template) and getattr(tokenizer, "is_fast", False):
        _check_generation_markers(tokenizer, template)  # fail before touching any row

    scratch = None
    if final is not None:
        scratch = final.with_name(f".scratch-{key[:24]}-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    try:
        rows = read_rows(src, cache_dir=scratch / "rows" if scratch else None)
        result = _tokenize_rows(src, rows, tokenizer, max_length, truncate, num_proc, key, scratch)
        if final is None:
            return result
        return _save_tokenized(result, final, scratch / "out", key)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _tokenize_rows(
    src: Path,
    rows: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncate: bool,
    num_proc: int,
    key: str,
    scratch: Path | None,
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
                ids, mask = encode_row(row, tokenizer, max_length, truncate)
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


def _all_rejected_message(src: Path, rejected: list[tuple[int, str]]) -> str:
    by_kind = Counter(reason.split(":", 1)[0] for _, reason in rejected)
    example = {}
    for _, reason in rejected:
        example.setdefault(reason.split(":", 1)[0], reason)
    top = "; ".join(f"{n} x {example[kind]}" for kind, n in by_kind.most_common(3))
    return f"every row of {src} was rejected ({len(rejected)} rows): {top}"


def _save_tokenized(result: Tokenized, final: Path, tmp: Path, key: str) -> Tokenized:
    result.dataset.save_to_disk(str(tmp))
    meta = {"key": key, "num_rows": result.num_rows, "rejected": result.rejected}
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
    return Tokenized(dataset=dataset, rejected=rejected, num_rows=int(meta["num_rows"]), reused=True)


# ------------------------------------------------------------------------------------------------
# Digests: what decides the tokens, for cache keys and cache.json
# ------------------------------------------------------------------------------------------------

_fingerprints: dict[tuple, str] = {}


def source_fingerprint(path: str | Path) -> str:
    """The sha256 of the source's bytes (a directory: its files' relative paths and bytes, in
    sorted order), so that the same data under another name or date is still the same data."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data source not found: {p}")
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
    return _sha256_json({"tokenizer": body, "special": special})


def chat_template_digest(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The sha256 of the chat template(s), or None when the tokenizer has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    if isinstance(template, str):
        return hashlib.sha256(template.encode()).hexdigest()
    return _sha256_json(template)


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number"}
    if value is None:
        return "null"
    return names.get(type(value), "number" if isinstance(value, float) else type(value).__name__)


def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
