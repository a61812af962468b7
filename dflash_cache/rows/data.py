"""Source rows -> (input_ids, loss_mask), and the rows that cannot be used, with a reason.

Rows come in the forms users already have (OpenAI ``messages``, ShareGPT ``conversations``, Alpaca
``instruction``/``input``/``output``, ``prompt``/``response``, plain ``text``), from local files, a
saved or downloaded dataset directory, or a hub dataset name. :func:`conversation` turns every chat
form into one list of messages, so regen, extract and eval accept the same rows; the loss mask of a
conversation comes from its chat template (see :mod:`dflash_cache.rows.chat`).

Bad rows (malformed, empty, nothing to learn, too long) are rejected with a reason instead of
crashing the run; problems that concern every row (no such file, no chat template, a template
whose mask cannot be trusted, every row rejected) raise :class:`DataError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import datasets

from dflash_cache.rows.chat import (
    DataError,
    DataWarning,
    RowRejected,
    check_generation_markers,
    check_template_kwargs,
    encode_chat,
    error_text,
    has_generation_markers,
    tokenize_text,
)
from dflash_cache.rows.json_array import read_json_array

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ROLES",
    "SHAREGPT_ROLES",
    "DataError",
    "DataWarning",
    "RowRejected",
    "Tokenized",
    "chat_template_digest",
    "check_messages",
    "check_template_kwargs",
    "conversation",
    "encode_row",
    "read_rows",
    "source_fingerprint",
    "source_row",
    "tokenize",
    "tokenizer_digest",
    "user_turns",
]

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
NO_ASSISTANT = "no assistant turn: nothing to learn from this conversation"
# ShareGPT's `from` values and the roles they stand for. ShareGPT V3 also names the assistant of a
# turn pasted from another model's chat (chatgpt, bing, bard: 14 of its turns): still the reply in
# that conversation, so an assistant turn (regen replaces it with the target's own, as any reply).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}  # fmt: skip
NO_ANSWERS = ("no assistant turn: a turns row holds the user's turns only (MT-Bench's form); "
              "dflash regen answers them")  # fmt: skip
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATA_SUFFIXES = (*JSONL_SUFFIXES, ".json", ".parquet", ".csv", ".txt", ".arrow")
# Bump when the encoding of a row changes, so that tokenized data saved by an older version is
# not reused. 2: assistant turns located in the whole rendering; template kwargs; more row forms.
ENCODER_VERSION = 2
# A hub dataset id: `name` or `owner/name`.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
HUB_CONNECT_TIMEOUT_S = 3.0

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


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


def read_rows(
    path: str | Path,
    cache_dir: str | Path | None = None,
    split: str | None = None,
    max_samples: int | None = None,
) -> datasets.Dataset:
    """Read a local JSON Lines, JSON or Parquet file, a dataset directory, or a hub dataset.

    JSON text is not parsed here: each row becomes its raw bytes (and line number), parsed one by
    one when it is encoded, so that one bad line (invalid JSON or UTF-8, a value of another type
    than its neighbours) becomes one rejected row instead of a failed load. A JSON file is either
    one top-level array of rows (held in memory, so prefer JSON Lines for big data) or JSON Lines;
    an array cut short keeps its whole records, with one warning (`json_array`).

    With ``cache_dir``, JSON Lines and Parquet rows are written there as Arrow files and
    memory-mapped (what you want for big inputs and ``num_proc``); without it they are held in
    memory. A directory saved with ``save_to_disk`` is memory-mapped where it is; any other
    directory (a dataset repository cloned from the hub) and a ``path`` that does not exist but
    looks like a hub id (``name`` or ``owner/name``) go through ``datasets.load_dataset`` and its
    own cache. ``split`` picks a split other than ``train`` of a source that has splits;
    ``max_samples`` keeps the first rows only.
    """
    _check_max_samples(max_samples)
    rows = _read_source(path, cache_dir, split)
    if max_samples is not None and max_samples < len(rows):
        rows = rows.select(range(max_samples))
    return rows


def _read_source(path: str | Path, cache_dir: str | Path | None, split: str | None) -> datasets.Dataset:
    p = Path(path)
    if not p.exists():
        if is_hub_id(path):
            return _load_dataset(str(path), split, hub=True)
        raise DataError(f"data source not found: {p}")
    if p.is_dir():
        return _read_dataset_dir(p, split)
    if split not in (None, "train"):
        raise DataError(f"{p} is one file, which has no split {split!r}: leave the split unset")
    suffix = p.suffix.lower()
    if suffix == ".json" and _first_non_space_byte(p) == b"[":
        return _read_array(p)
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
            raise DataError(f"cannot read Parquet file {p}: {error_text(e)}") from e
    raise DataError(
        f"unsupported data source {p}: expected a .jsonl, .json or .parquet file, a dataset directory "
        "(saved with datasets' save_to_disk, or a dataset repository) or a hub dataset name"
    )


def is_hub_id(path: str | Path) -> bool:
    """Whether a path that does not exist locally is taken for a hub dataset name: ``name`` or
    ``owner/name``, not a file name with a data suffix (a missing ``rows.jsonl`` is just missing)."""
    text = str(path)
    return bool(_HUB_ID.fullmatch(text)) and not text.lower().endswith(DATA_SUFFIXES)


def _check_max_samples(max_samples: int | None) -> None:
    if max_samples is not None and (type(max_samples) is not int or max_samples < 1):
        raise DataError(f"max_samples must be a positive number of rows, got {max_samples!r}")


def _read_dataset_dir(p: Path, split: str | None) -> datasets.Dataset:
    if not ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
        return _load_dataset(str(p), split, hub=False)
    try:
        loaded = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"cannot load the saved dataset {p}: {error_text(e)}") from e
    if isinstance(loaded, datasets.DatasetDict):
        return _pick_split(loaded, split, str(p))
    if split not in (None, "train"):
        raise DataError(f"{p} is one saved dataset, which has no split {split!r}: leave the split unset")
    return loaded


def _pick_split(splits: datasets.DatasetDict, split: str | None, where: str) -> datasets.Dataset:
    """The split asked for; unasked, ``train``, or the only split there is."""
    if split is not None:
        if split not in splits:
            raise DataError(f"{where} has no split {split!r}; its splits are {', '.join(sorted(splits))}")
        return splits[split]
    if "train" in splits:
        return splits["train"]
    if len(splits) == 1:
        return next(iter(splits.values()))
    raise DataError(f"{where} holds the splits {', '.join(sorted(splits))} and none is called 'train': pick one")


_loaded: dict[tuple[str, str | None], datasets.Dataset] = {}


def _load_dataset(name: str, split: str | None, hub: bool) -> datasets.Dataset:
    """A split of a hub dataset (or a local dataset repository) through ``datasets.load_dataset``.

    Without a route to the hub, datasets retries for about half a minute before it gives up; we
    look first (one connection, a few seconds at most) and load in offline mode when there is none,
    so a dataset in the local cache still loads and any other fails at once with one line.
    """
    key = (name, split)
    if hub and key in _loaded:  # the fingerprint and the rows load it once per process
        return _loaded[key]
    where = f"the hub dataset {name!r}" if hub else f"the dataset directory {name}"
    offline = not hub or _hub_offline()
    want = split or "train"  # only the split asked for is downloaded and prepared
    try:
        with _offline_mode(offline):
            rows = datasets.load_dataset(name, split=want)
    except Exception as e:  # datasets raises many types: not found, no route, bad files, no such split
        raise DataError(_load_failure(name, where, want, hub and offline, hub, e)) from None
    if hub:
        _loaded[key] = rows
    return rows


def _load_failure(name: str, where: str, split: str, unreachable: bool, hub: bool, e: Exception) -> str:
    if isinstance(e, ValueError) and "Unknown split" in str(e):
        splits = re.search(r"\[.*\]", str(e))
        return f"{where} has no split {split!r}; its splits are {splits[0] if splits else 'not listed'}"
    if unreachable:
        host = urlparse(_hub_endpoint()).hostname
        return (
            f"cannot load {where}: no such local path, the hub ({host}) cannot be reached and the dataset is "
            "not in the local datasets cache"
        )
    if not hub:
        return (
            f"{name} is a directory neither saved with datasets' save_to_disk (no dataset_dict.json or "
            f"state.json) nor readable by datasets.load_dataset: {error_text(e)}"
        )
    return f"cannot load {where}: {error_text(e)}"


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _hub_offline() -> bool:
    """Whether the hub is out of reach: offline mode is set, or its host takes no connection."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # the proxy may have a route we cannot see from here
    url = urlparse(_hub_endpoint())
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError:
        return True
    return False


@contextlib.contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """datasets and huggingface_hub read their offline flag at call time from these constants."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    if offline:
        constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _first_non_space_byte(p: Path) -> bytes:
    with open(p, "rb") as f:
        while chunk := f.read(1 << 16):
            stripped = chunk.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()
            if stripped:
                return stripped[:1]
    return b""


_arrays: dict[tuple, datasets.Dataset] = {}
_cuts: dict[tuple, str] = {}  # file version -> the warning it deserves
_warned: set[tuple] = set()


def _file_version(p: Path) -> tuple:
    st = p.stat()
    return str(p.resolve()), st.st_size, st.st_mtime_ns


def _read_array(p: Path) -> datasets.Dataset:
    """The rows of a JSON array file as raw rows (each record's own bytes), read once per process
    and file version; a file cut short keeps its whole records and warns once (see json_array)."""
    key = _file_version(p)
    if key not in _arrays:
        array = read_json_array(p)
        _arrays.clear()  # one file's rows held at a time
        _arrays[key] = datasets.Dataset.from_dict({RAW: array.records, LINE: [None] * len(array.records)},
                                                  features=_RAW_FEATURES)  # fmt: skip
        if array.cut_at is not None:
            _cuts[key] = array.cut_message(p)
    if key in _cuts and key not in _warned:
        _warned.add(key)
        warnings.warn(_cuts[key], DataWarning, stacklevel=2)
    return _arrays[key]


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
        raise RowRejected(f"invalid JSON: {error_text(e)}{where}") from None
    if not isinstance(row, dict):
        raise RowRejected(f"not a JSON object: got {_json_type(row)}{where}")
    return row


# ------------------------------------------------------------------------------------------------
# Encoding one row
# ------------------------------------------------------------------------------------------------


def conversation(row: dict[str, Any], *, reply_required: bool = True) -> list[dict[str, Any]] | None:
    """A row of any chat form as validated chat messages; ``None`` for a plain ``text`` row.

    Training rows need a reply to learn from (``reply_required``). Prompt rows (eval, regen) need
    not have one: a conversation may then hold no assistant turn, and an Alpaca or prompt row
    without its answer gets an empty assistant turn, the one regen fills.

    Forms, the first present winning (a ``None`` value counts as absent, as in Arrow tables with
    optional columns):

    - OpenAI ``{"messages": [{"role", "content", ...}, ...]}``;
    - ShareGPT ``{"conversations": [{"from", "value", ...}, ...]}`` with ``from`` one of human, gpt,
      system, user, assistant, or chatgpt, bing and bard (replies pasted from those chats, read as
      assistant turns); entries with ``role``/``content`` are read as OpenAI messages;
    - MT-Bench ``{"turns": [first, second, ...]}``: the user's turns alone, each to be answered after
      the answer to the one before (:func:`user_turns`); as a conversation, each user turn followed by
      an empty assistant turn for regen to fill, and no training row until then;
    - Alpaca ``{"instruction", "input", "output"}``: the user says the instruction, then a blank
      line and the input when there is one; the assistant says the output;
    - ``{"prompt", "response"}``: one user and one assistant turn;
    - ``{"text"}``: plain text, no conversation.

    Other string fields of a message (``reasoning_content``) are kept: the template may read them.
    Raises :class:`RowRejected` for a row of none of these forms or a malformed one.
    """
    if not isinstance(row, dict):
        raise RowRejected(f"malformed row: expected an object, got {_json_type(row)}")
    row = source_row(row)
    if row.get("messages") is not None:
        return check_messages(row["messages"], reply_required=reply_required)
    if row.get("conversations") is not None:
        return check_messages(_sharegpt_messages(row["conversations"]), field="conversations",
                              reply_required=reply_required)  # fmt: skip
    if row.get("turns") is not None:
        if reply_required:
            user_turns(row)  # a malformed row says so first
            raise RowRejected(NO_ANSWERS)
        empty_reply = {"role": "assistant", "content": ""}
        return [m for t in user_turns(row) for m in ({"role": "user", "content": t}, dict(empty_reply))]
    answer = {} if reply_required else {"output": "", "response": ""}  # an absent answer is an empty one
    fields = {**answer, **_present(row)}
    if row.get("instruction") is not None or row.get("output") is not None:
        instruction, extra, output = (
            _string_field(fields, k, "instruction/output") for k in ("instruction", "input", "output")
        )
        if instruction is None or output is None:
            missing = "instruction" if instruction is None else "output"
            raise RowRejected(f"missing field: an Alpaca row needs {missing}")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        return check_messages([{"role": "user", "content": user}, {"role": "assistant", "content": output}])
    if row.get("prompt") is not None or row.get("response") is not None:
        prompt, response = (_string_field(fields, k, "prompt/response") for k in ("prompt", "response"))
        for name, other, value in (("prompt", "response", prompt), ("response", "prompt", response)):
            if value is None:
                raise RowRejected(f"missing field: a row with {other} needs {name} too")
        return check_messages([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
    if row.get("text") is not None:
        return None
    present = sorted(k for k, v in row.items() if v is not None)
    raise RowRejected(
        "missing field: a row needs messages, conversations, instruction and output, prompt and response, text, "
        "or turns"
        f" (it has {', '.join(present) if present else 'no fields'})"
    )


def user_turns(row: dict[str, Any]) -> list[str] | None:
    """The user's turns of a ``turns`` row (MT-Bench's ``question.jsonl``), asked one after another,
    each after the answer to the one before; None for a row of another form."""
    row = source_row(row)
    turns = row.get("turns")
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise RowRejected(f"wrong type: turns must be a list of strings, got {_json_type(turns)}")
    if not turns:
        raise RowRejected("empty conversation: turns is an empty list")
    for i, t in enumerate(turns):
        if not isinstance(t, str):
            raise RowRejected(f"wrong type: turn {i} must be a string, got {_json_type(t)}")
    return turns


def _present(row: dict[str, Any]) -> dict[str, Any]:
    """The row without its None values (absent, as in Arrow tables with optional columns)."""
    return {k: v for k, v in row.items() if v is not None}


def _string_field(row: dict[str, Any], key: str, form: str) -> str | None:
    value = row.get(key)
    if value is not None and not isinstance(value, str):
        raise RowRejected(f"wrong type: {key} of a {form} row must be a string, got {_json_type(value)}")
    return value


def _sharegpt_messages(turns: Any) -> Any:
    """ShareGPT turns as OpenAI messages; anything malformed is left for check_messages to name."""
    if not isinstance(turns, list):
        return turns
    out = []
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and (turn.get("from") is not None or turn.get("value") is not None):
            speaker = turn.get("from")
            if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
                raise RowRejected(
                    f"unknown role: conversations turn {i} has from {speaker!r} (expected {', '.join(SHAREGPT_ROLES)})"
                )
            rest = {k: v for k, v in turn.items() if k not in ("from", "value")}
            turn = {**rest, "role": SHAREGPT_ROLES[speaker], "content": turn.get("value")}
        out.append(turn)
    return out


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
            raise RowRejected(f"wrong type: text must be a string, got {_json_type(text)}")
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


def check_messages(messages: Any, field: str = "messages", reply_required: bool = True) -> list[dict[str, Any]]:
    """Validate a conversation; return its messages with ``None`` fields dropped, other fields kept."""
    if not isinstance(messages, list):
        raise RowRejected(f"wrong type: {field} must be a list, got {_json_type(messages)}")
    if not messages:
        raise RowRejected(f"empty conversation: {field} is an empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowRejected(f"wrong type: message {i} must be an object, got {_json_type(m)}")
        m = {k: v for k, v in m.items() if v is not None}
        for key in ("role", "content"):
            if key not in m:
                raise RowRejected(f"missing field: message {i} has no {key}")
        for key in ("role", "content", "reasoning_content"):
            if key in m and not isinstance(m[key], str):
                raise RowRejected(f"wrong type: message {i} {key} must be a string, got {_json_type(m[key])}")
        if m["role"] not in ROLES:
            raise RowRejected(f"unknown role: message {i} has role {m['role']!r} (expected {', '.join(ROLES)})")
        out.append(m)
    if reply_required and not any(m["role"] == "assistant" for m in out):
        raise RowRejected(NO_ASSISTANT)
    return out


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
    _check_max_samples(max_samples)
    if max_length < 1:
        raise DataError(f"max_length must be positive, got {max_length}")
    local = Path(path)
    if not local.exists() and not is_hub_id(path):
        raise DataError(f"data source not found: {local}")
    src = str(path)
    key = _sha256_json(
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
        result.cut_short = _cuts.get(_file_version(local)) if local.is_file() else None
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


# ------------------------------------------------------------------------------------------------
# Digests: what decides the tokens, for cache keys and cache.json
# ------------------------------------------------------------------------------------------------

_fingerprints: dict[tuple, str] = {}


def source_fingerprint(path: str | Path, split: str | None = None) -> str:
    """What identifies the source's rows, so that the same data under another name or date is
    still the same data: the sha256 of a local source's bytes (a directory: its files' relative
    paths and bytes, in sorted order), or of a hub dataset's name, split and datasets' own
    fingerprint of the prepared split. A ``split`` is part of it."""
    p = Path(path)
    if not p.exists():
        if not is_hub_id(path):
            raise DataError(f"data source not found: {p}")
        rows = _load_dataset(str(path), split, hub=True)
        return _sha256_json(["hub", str(path), split, rows._fingerprint])
    digest = _local_fingerprint(p)
    return digest if split is None else _sha256_json(["split", digest, split])


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
