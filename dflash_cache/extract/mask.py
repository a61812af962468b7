"""The mask token: the id that fills DFlash's block slots 1..B-1, chosen once per cache.

It must be an id no text produces, inside the target's embedding table. In order:

1. ``--mask-token-id N``: checked (inside the table, not a token that text encodes to, not in the
   data);
2. the tokenizer's own mask token;
3. ``len(tokenizer)`` when the embedding table is larger than the tokenizer: a row past every
   token (the published Qwen3 drafters use 151669 = len(tokenizer) of a 151,936-row table);
4. otherwise (Llama 3, Mistral, SmolLM2 fill their tables) an added special token that no row of
   the data holds and that the chat template never writes: the first reserved one (Llama 3's
   ``<|reserved_special_token_0|>``, 128002; the published Llama-3.1 DFlash drafter uses a reserved
   special token), else the last such token by id (families append their rarest tokens last).

2-4 are ``auto``, the default. Rule 4 used to be a refusal; a validated choice recorded in
``cache.json`` with its reason works for every such tokenizer, and the drafter only ever feeds the
id in as an input, so a token that is merely rare at inference costs at most that position's draft.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dflash_cache.core.errors import ExtractError

AUTO = "auto"
ROLE_TOKENS = ("bos", "eos", "unk", "pad", "sep", "cls")  # inserted by tokenizers and pipelines themselves


@dataclass(frozen=True)
class MaskChoice:
    """The chosen id, the token it stands for (None past the tokenizer), the rule that chose it
    ("setting", "tokenizer", "spare_row" or "unused_special") and why, as cache.json records it."""

    id: int
    token: str | None
    rule: str
    reason: str

    def record(self) -> dict:
        return asdict(self)


def data_token_ids(dataset, vocab_size: int) -> np.ndarray:
    """The distinct token ids of a tokenized dataset (its `input_ids` column), counted chunk by
    chunk from Arrow without building Python lists (a second or so for 100M tokens)."""
    seen = np.zeros(vocab_size + 1, dtype=bool)
    for chunk in dataset.data.column("input_ids").chunks:
        ids = chunk.flatten().to_numpy(zero_copy_only=False)
        if ids.size:
            seen |= np.bincount(np.clip(ids, 0, vocab_size), minlength=vocab_size + 1).astype(bool)
    return np.flatnonzero(seen[:vocab_size])


def choose_mask_token(tokenizer, vocab_size: int, setting: int | str | None = AUTO, *,
                      data_ids: np.ndarray | None = None) -> MaskChoice:  # fmt: skip
    """The mask token for a cache: `setting` is --mask-token-id (an id, or "auto"/None), `data_ids`
    the distinct ids of the tokenized rows (None: not checked against the data)."""
    present = set() if data_ids is None else {int(i) for i in data_ids}
    if setting is not None and setting != AUTO:
        return _checked_setting(tokenizer, vocab_size, int(setting), present)
    own = tokenizer.mask_token_id
    if own is not None:
        if not 0 <= own < vocab_size:
            raise ExtractError(f"the tokenizer's mask token {own} is outside the target's embedding table "
                               f"(vocab_size {vocab_size}); pass --mask-token-id N")  # fmt: skip
        return MaskChoice(int(own), tokenizer.mask_token, "tokenizer", "the tokenizer's mask token")
    spare = len(tokenizer)
    if spare < vocab_size and _text_token(tokenizer, spare) is None:
        return MaskChoice(spare, None, "spare_row", f"no mask token; the embedding table has {vocab_size} rows, "
                          f"the tokenizer {spare} tokens: id len(tokenizer) is a row no text produces")  # fmt: skip
    candidates = unused_special_tokens(tokenizer, vocab_size, present)
    if not candidates:
        raise ExtractError(
            f"the target's tokenizer has no mask token, its embedding table no spare row past the tokenizer "
            f"(len(tokenizer) {spare}, vocab_size {vocab_size}), and every added special token is used by the data "
            "or the chat template; pass --mask-token-id N"
        )
    reserved = [c for c in candidates if "reserved" in c[1].lower()]
    token_id, token = reserved[0] if reserved else candidates[-1]
    kind = "the first reserved special token" if reserved else "the last added special token by id"
    reason = (
        f"no mask token and no spare embedding row (len(tokenizer) {spare}, vocab_size {vocab_size}); {token} "
        f"is {kind} that no data row holds and the chat template never writes ({len(candidates)} such tokens)"
    )
    return MaskChoice(token_id, token, "unused_special", reason)


def unused_special_tokens(tokenizer, vocab_size: int, present: set[int]) -> list[tuple[int, str]]:
    """(id, token) of the added special tokens a mask may use, by id: inside the table, not one
    of the tokenizer's role tokens (bos, eos, pad, ...), not in the data, and not written
    anywhere in the chat template's source (so no rendering can emit it)."""
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ROLE_TOKENS}
    template = _template_text(tokenizer)
    out = []
    for token_id, added in sorted(tokenizer.added_tokens_decoder.items()):
        if not added.special or not 0 <= token_id < vocab_size or token_id in roles or token_id in present:
            continue
        if added.content in template:
            continue
        out.append((int(token_id), added.content))
    return out


def _checked_setting(tokenizer, vocab_size: int, token_id: int, present: set[int]) -> MaskChoice:
    if not 0 <= token_id < vocab_size:
        raise ExtractError(f"--mask-token-id {token_id}: outside the target's embedding table "
                           f"(vocab_size {vocab_size}: ids 0..{vocab_size - 1})")  # fmt: skip
    text = _text_token(tokenizer, token_id)
    hint = ("use the tokenizer's mask token, an added special token the data does not use (e.g. a reserved one)"
            + (f", or an id from {len(tokenizer)} to {vocab_size - 1}" if len(tokenizer) < vocab_size else "")
            + "; or --mask-token-id auto")  # fmt: skip
    if text is not None:
        raise ExtractError(f"--mask-token-id {token_id} is {text!r}, a regular token that text encodes to, so masked "
                           f"slots would look like real text; {hint}")  # fmt: skip
    token = tokenizer.convert_ids_to_tokens(token_id) if token_id < len(tokenizer) else None
    if token_id in present:
        raise ExtractError(f"--mask-token-id {token_id} ({token}) occurs in the data, so masked slots would look "
                           f"like real tokens; {hint}")  # fmt: skip
    return MaskChoice(token_id, token, "setting", "--mask-token-id")


def _text_token(tokenizer, token_id: int) -> str | None:
    """The token `token_id` stands for when text can encode to it; None for ids past the
    tokenizer, its mask token and added special tokens."""
    if token_id == tokenizer.mask_token_id:
        return None
    added = tokenizer.added_tokens_decoder.get(token_id)
    if added is not None and added.special:
        return None
    return tokenizer.convert_ids_to_tokens(token_id)


def _template_text(tokenizer) -> str:
    """Every chat template's source (a tokenizer may carry several, by name)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    return t or ""
