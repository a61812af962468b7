"""A conversation -> (input_ids, loss_mask) through the tokenizer's chat template.

A drafter learns only where ``loss_mask`` is 1 (anchors and loss positions are response tokens;
docs/architecture.md, "Where each rule lives"), so the mask is the one thing here that must never be
silently wrong:

- With ``{% generation %}`` markers in the chat template, transformers' assistant-token mask is
  used, after a probe conversation has shown that the markers really cover the replies.
- Without markers, each assistant turn is located inside the one rendering of the whole
  conversation, the tokens the target actually sees. Real templates are often not prefix-stable
  (Qwen3's drops the ``<think>`` block of every assistant turn before the last user message), so a
  turn is supervised as the whole rendering shows it, never as a prefix of the conversation would.
  The template's assistant header and end-of-turn token are derived from probe renderings; a turn
  is the text from the end of its header through its end-of-turn token (not the formatting after
  it). A row whose turns cannot be located without ambiguity is rejected with the reason.

Chat-template options (``enable_thinking`` and the like) reach every rendering as keyword arguments.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_cache.core.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DataError",
    "DataWarning",
    "RowRejected",
    "TurnFormat",
    "check_generation_markers",
    "check_template_kwargs",
    "encode_chat",
    "error_text",
    "has_generation_markers",
    "tokenize_text",
    "turn_format",
]

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class DataError(UserError):
    """A problem with the input as a whole; the message is meant to be printed as one line."""


class DataWarning(UserWarning):
    """Something about the input that the run works around but the user must know (a file cut
    short); the CLI prints it as one ``warning:`` line."""


class RowRejected(Exception):
    """One source row cannot be used; ``reason`` says why (``"category: detail"``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TurnFormat:
    """How a chat template frames an assistant turn.

    ``header`` opens every assistant turn (``"<|im_start|>assistant\\n"`` in ChatML): the part the
    generation prompt and every rendered turn share. ``end`` is the text of the added token that
    closes the turn (``"<|im_end|>"``, ``"<|eot_id|>"``, ``"<end_of_turn>"``) and ``end_id`` its id.
    """

    header: str
    end: str
    end_id: int


# ------------------------------------------------------------------------------------------------
# Template options
# ------------------------------------------------------------------------------------------------


def _reserved_kwargs() -> frozenset[str]:
    """apply_chat_template's own parameters: passing them as template options would change how we
    render or tokenize, not what the template sees. Tools and documents are template inputs."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(params) - {"self", "kwargs", "tools", "documents"}


def check_template_kwargs(value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Chat-template options as a dict, from a mapping or its JSON text (as ``--chat-template-kwargs``
    takes it); ``None`` is no options. They must be JSON (they are recorded in cache.json and keys)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise DataError(f"chat template kwargs are not valid JSON: {error_text(e)}") from None
    if not isinstance(value, Mapping):
        raise DataError(f"chat template kwargs must be a JSON object, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise DataError(f"chat template kwargs keys must be strings, got {key!r}")
    reserved = sorted(set(value) & _reserved_kwargs())
    if reserved:
        raise DataError(f"chat template kwargs cannot set {', '.join(reserved)}: they are not template options")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise DataError(f"chat template kwargs must be plain JSON values: {error_text(e)}") from None


def _kwargs_key(template_kwargs: Mapping[str, Any]) -> str:
    return json.dumps(template_kwargs, sort_keys=True)


# ------------------------------------------------------------------------------------------------
# Encoding a conversation
# ------------------------------------------------------------------------------------------------


def encode_chat(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a validated conversation; ``input_ids`` are exactly
    ``apply_chat_template(messages, tokenize=True, **template_kwargs)``.

    Raises :class:`RowRejected` for a row whose turns cannot be located, and :class:`DataError`
    when no chat row could be encoded with this tokenizer (no chat template, or one whose assistant
    turns cannot be found or whose generation markers do not cover the replies).
    """
    kwargs = dict(template_kwargs or {})
    template = _template(tokenizer)
    if template is None:
        raise DataError(
            "the tokenizer has no chat template, so rows in chat form cannot be tokenized: use a "
            "tokenizer with a chat template, or text rows"
        )
    if has_generation_markers(tokenizer):
        check_generation_markers(tokenizer, kwargs)
        out = _call(
            tokenizer.apply_chat_template,
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kwargs,
        )
        return [int(t) for t in out["input_ids"]], [1 if m else 0 for m in out["assistant_masks"]]
    fmt = turn_format(tokenizer, kwargs)
    text = _call(tokenizer.apply_chat_template, messages, tokenize=False, **kwargs)
    return _located_mask(tokenizer, text, messages, fmt)


def has_generation_markers(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the mask comes from the template's ``{% generation %}`` markers (a fast tokenizer is
    needed for them: transformers maps the marked characters to tokens through offsets)."""
    template = _template(tokenizer)
    return bool(template and _GENERATION_MARKER.search(template) and getattr(tokenizer, "is_fast", False))


def _located_mask(
    tokenizer: PreTrainedTokenizerBase, text: str, messages: list[dict[str, Any]], fmt: TurnFormat
) -> tuple[list[int], list[int]]:
    """Tokens of ``text`` and a mask over the assistant spans located in it.

    The text is cut at the spans' edges and each piece tokenized alone: the pieces' tokens must
    join into the whole text's, which proves that every edge falls between two tokens (no token
    straddles a span), and tells which tokens each span holds.
    """
    spans = _assistant_spans(text, messages, fmt)
    edges = [0, *(e for span in spans for e in span), len(text)]
    pieces = [text[a:b] for a, b in zip(edges, edges[1:], strict=False)]
    ids = tokenize_text(tokenizer, text)
    mask: list[int] = []
    for j, piece_ids in enumerate(_tokenize_batch(tokenizer, pieces)):
        if ids[len(mask) : len(mask) + len(piece_ids)] != piece_ids:
            turn = max(0, (j - 1) // 2)
            raise RowRejected(
                f"token straddles a turn edge: a token crosses the start or end of assistant turn {turn} "
                f"({spans[turn][1] - spans[turn][0]} characters), so its supervised tokens cannot be told apart"
            )
        mask += [j % 2] * len(piece_ids)  # odd pieces are the spans
    if len(mask) != len(ids):
        raise RowRejected("token straddles a turn edge: the pieces of the rendering do not tokenize as the whole")
    return ids, mask


def _assistant_spans(text: str, messages: list[dict[str, Any]], fmt: TurnFormat) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns in the rendered ``text``: from the end
    of each header through the first end-of-turn token after it. Rejects every ambiguity."""
    for k, m in enumerate(messages):
        for key, value in m.items():
            for what, marker in (("assistant header", fmt.header), ("end-of-turn token", fmt.end)):
                if isinstance(value, str) and marker in value:
                    raise RowRejected(
                        f"ambiguous turns: message {k} {key} contains the template's {what} {marker!r} as text"
                    )
    replies = [(k, m) for k, m in enumerate(messages) if m["role"] == "assistant"]
    starts = [match.end() for match in re.finditer(re.escape(fmt.header), text)]
    if len(starts) != len(replies):
        raise RowRejected(
            f"ambiguous turns: the rendered conversation holds {len(starts)} assistant headers "
            f"{fmt.header!r} for {len(replies)} assistant messages"
        )
    spans = []
    for i, ((k, m), start) in enumerate(zip(replies, starts, strict=True)):
        limit = starts[i + 1] - len(fmt.header) if i + 1 < len(starts) else len(text)
        end = text.find(fmt.end, start, limit)
        if end < 0:
            raise RowRejected(f"unlocated turn: assistant message {k} has no end-of-turn token {fmt.end!r}")
        span = (start, end + len(fmt.end))
        reply = _visible_reply(m["content"])
        if reply not in text[span[0] : span[1]]:
            raise RowRejected(
                f"unlocated turn: the reply of assistant message {k} is not where its header says; "
                "the template changes it or places it elsewhere"
            )
        spans.append(span)
    return spans


def _visible_reply(content: str) -> str:
    """The part of a reply every template renders: what follows its reasoning, trimmed."""
    return content.rsplit("</think>", 1)[-1].strip()


# ------------------------------------------------------------------------------------------------
# What the template does: derived once per tokenizer, template and options
# ------------------------------------------------------------------------------------------------

_PROBE = [
    {"role": "user", "content": "Probe question one?"},
    {"role": "assistant", "content": "Probe reply one."},
    {"role": "user", "content": "Probe question two?"},
    {"role": "assistant", "content": "Probe reply two."},
]
_PROBE_SYSTEM = {"role": "system", "content": "Probe system prompt."}
_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _verdict(tokenizer: PreTrainedTokenizerBase, kind: str, kwargs: dict[str, Any], judge: Callable[[], Any]) -> Any:
    """``judge()`` once per tokenizer, template, options and kind; a DataError it raised is raised
    again on every later call."""
    try:
        cache = _verdicts.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: judge every time
        cache = {}
    key = (kind, _template(tokenizer), _kwargs_key(kwargs))
    if key not in cache:
        try:
            cache[key] = judge()
        except DataError as e:
            cache[key] = e
    if isinstance(cache[key], DataError):
        raise DataError(str(cache[key]))
    return cache[key]


def turn_format(tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None = None) -> TurnFormat:
    """The assistant header and end-of-turn token of the tokenizer's chat template, derived from
    probe renderings (see :class:`TurnFormat`); :class:`DataError` when they cannot be."""
    kwargs = dict(template_kwargs or {})
    return _verdict(tokenizer, "turns", kwargs, lambda: _derive_turn_format(tokenizer, kwargs))


def _derive_turn_format(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> TurnFormat:
    """The header is the longest text that the generation prompt and every rendered assistant turn
    of a two-exchange probe open with (Qwen3 adds a think block to some of them, not to all); the
    end-of-turn token is the added token right after each probe reply. A conversation that ends on
    a user turn must render as a prefix of the longer one, which every template we know does."""

    def render(messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as e:  # jinja2 raises many types
            raise DataError(_no_turn_format(f"a probe conversation fails to render ({error_text(e)})")) from None

    if _template(tokenizer) is None:
        raise DataError("the tokenizer has no chat template")
    bare, prompted = render(_PROBE[:1]), render(_PROBE[:1], True)
    if not prompted.startswith(bare) or prompted == bare:
        raise DataError(_no_turn_format("its generation prompt adds no assistant header after a user turn"))
    full = render(_PROBE)
    openings, ends = [prompted[len(bare) :]], []
    for k, m in enumerate(_PROBE):
        if m["role"] != "assistant":
            continue
        head = render(_PROBE[:k])
        at = full.find(m["content"], len(head))
        if not full.startswith(head) or at < 0:
            raise DataError(_no_turn_format("a probe conversation cut after a user turn is not a prefix of the whole"))
        openings.append(full[len(head) : at])
        ends.append(_leading_added_token(tokenizer, full[at + len(m["content"]) :]))
    header = os.path.commonprefix(openings)
    if not header.strip():
        raise DataError(_no_turn_format(f"its assistant turns open with no common header ({openings!r})"))
    if ends[0] is None or len(set(ends)) != 1:
        raise DataError(_no_turn_format("an assistant reply is not followed by one end-of-turn token"))
    fmt = TurnFormat(header=header, end=ends[0][0], end_id=ends[0][1])
    try:
        _located_mask(tokenizer, full, _PROBE, fmt)
    except RowRejected as e:
        raise DataError(_no_turn_format(f"the probe conversation's turns cannot be located ({e.reason})")) from None
    return fmt


def _leading_added_token(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[str, int] | None:
    """The added (special or control) token that ``text`` starts with, if any."""
    ids = tokenize_text(tokenizer, text)
    if not ids:
        return None
    token = getattr(tokenizer, "added_tokens_decoder", {}).get(ids[0])
    content = getattr(token, "content", None)
    if content and text.startswith(content):
        return content, ids[0]
    return None


def _no_turn_format(why: str) -> str:
    return (
        f"cannot locate assistant turns with this chat template: {why}. Add {{% generation %}} markers "
        "to the template, or use text rows"
    )


def check_generation_markers(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> None:
    """Check once per tokenizer, template and options that the generation markers cover the replies.

    The masked tokens of two probe conversations (two exchanges, without and with a system turn,
    so both the last-turn and earlier-turn branches render) must decode to text holding each reply
    and no other message; otherwise masks from this template would be wrong, which is a DataError.
    A template that cannot render a probe is not judged on it: its rows fail on their own.
    """
    _verdict(tokenizer, "markers", kwargs, lambda: _probe_markers(tokenizer, kwargs))


def _probe_markers(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> None:
    for probe in (_PROBE, [_PROBE_SYSTEM, *_PROBE]):
        try:
            out = tokenizer.apply_chat_template(
                probe, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
            )
        except Exception:  # e.g. a template that refuses system turns: nothing to judge
            continue
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        masked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
        replies = [m["content"] for m in probe if m["role"] == "assistant"]
        others = [m["content"] for m in probe if m["role"] != "assistant"]
        if not all(r in masked for r in replies) or any(o in masked for o in others):
            raise DataError(
                "the chat template's {% generation %} markers do not cover exactly the assistant replies "
                f"(a probe conversation's supervised text was {masked[:120]!r}), so its loss mask cannot be "
                "trusted: fix the markers, or remove them to locate replies in the rendering"
            )


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a chat-template function; a template that fails on this row rejects the row."""
    try:
        return fn(*args, **kwargs)
    except (DataError, RowRejected):
        raise
    except Exception as e:  # jinja2 raises many types (raise_exception, undefined, ...)
        raise RowRejected(f"chat template error: {error_text(e)}") from None


def tokenize_text(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = False) -> list[int]:
    """``text``'s token ids; a tokenizer that fails on it rejects the row rather than the run."""
    try:
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:
        raise RowRejected(f"tokenizer error: {error_text(e)}") from None
    return [int(t) for t in ids]


def _tokenize_batch(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    try:
        batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
    except Exception as e:
        raise RowRejected(f"tokenizer error: {error_text(e)}") from None
    return [[int(t) for t in ids] for ids in batch]


def error_text(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line, for a rejection reason or a one-line error."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
