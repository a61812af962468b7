"""Hub datasets by name, and dataset repositories, through ``datasets.load_dataset``.

A source that does not exist locally but looks like a hub id (:func:`is_hub_id`) is a hub dataset;
a directory not saved with ``save_to_disk`` (a dataset repository cloned from the hub) loads the
same way (:func:`load_split`), quickly failing with one line when the hub is out of reach.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import datasets

from dflash_cache.rows.chat import DataError, error_text

__all__ = ["DATA_SUFFIXES", "HUB_CONNECT_TIMEOUT_S", "JSONL_SUFFIXES", "check_source", "is_hub_id", "load_split"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATA_SUFFIXES = (*JSONL_SUFFIXES, ".json", ".parquet", ".csv", ".txt", ".arrow")
# A hub dataset id: `name` or `owner/name`.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
HUB_CONNECT_TIMEOUT_S = 3.0


def is_hub_id(path: str | Path) -> bool:
    """Whether a path that does not exist locally is taken for a hub dataset name: ``name`` or
    ``owner/name``, not a file name with a data suffix (a missing ``rows.jsonl`` is just missing)."""
    text = str(path)
    return bool(_HUB_ID.fullmatch(text)) and not text.lower().endswith(DATA_SUFFIXES)


def check_source(path: str | Path) -> None:
    """Refuse a source that is neither on disk nor a hub dataset name (:func:`is_hub_id`)."""
    if not Path(path).exists() and not is_hub_id(path):
        raise DataError(f"data source not found: {Path(path)}")


_loaded: dict[tuple[str, str | None], datasets.Dataset] = {}


def load_split(name: str, split: str | None, hub: bool) -> datasets.Dataset:
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
