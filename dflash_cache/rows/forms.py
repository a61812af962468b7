"""The row forms users already have, as one list of validated chat messages.

OpenAI ``messages``, ShareGPT ``conversations``, MT-Bench ``turns``, Alpaca
``instruction``/``input``/``output`` and ``prompt``/``response`` rows all become one list of
messages (:func:`conversation`), so regen, extract and eval accept the same rows; a plain ``text``
row has none. A malformed row raises :class:`RowRejected` with the reason.
"""

from __future__ import annotations

from typing import Any

from dflash_cache.rows.chat import RowRejected
from dflash_cache.rows.sources import json_type, source_row

__all__ = ["NO_ANSWERS", "NO_ASSISTANT", "ROLES", "SHAREGPT_ROLES", "check_messages", "conversation", "user_turns"]

ROLES = ("system", "user", "assistant")
NO_ASSISTANT = "no assistant turn: nothing to learn from this conversation"
# ShareGPT's `from` values and the roles they stand for. ShareGPT V3 also names the assistant of a
# turn pasted from another model's chat (chatgpt, bing, bard: 14 of its turns): still the reply in
# that conversation, so an assistant turn (regen replaces it with the target's own, as any reply).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}  # fmt: skip
NO_ANSWERS = ("no assistant turn: a turns row holds the user's turns only (MT-Bench's form); "
              "dflash regen answers them")  # fmt: skip


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
        raise RowRejected(f"malformed row: expected an object, got {json_type(row)}")
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
        raise RowRejected(f"wrong type: turns must be a list of strings, got {json_type(turns)}")
    if not turns:
        raise RowRejected("empty conversation: turns is an empty list")
    for i, t in enumerate(turns):
        if not isinstance(t, str):
            raise RowRejected(f"wrong type: turn {i} must be a string, got {json_type(t)}")
    return turns


def _present(row: dict[str, Any]) -> dict[str, Any]:
    """The row without its None values (absent, as in Arrow tables with optional columns)."""
    return {k: v for k, v in row.items() if v is not None}


def _string_field(row: dict[str, Any], key: str, form: str) -> str | None:
    value = row.get(key)
    if value is not None and not isinstance(value, str):
        raise RowRejected(f"wrong type: {key} of a {form} row must be a string, got {json_type(value)}")
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


def check_messages(messages: Any, field: str = "messages", reply_required: bool = True) -> list[dict[str, Any]]:
    """Validate a conversation; return its messages with ``None`` fields dropped, other fields kept."""
    if not isinstance(messages, list):
        raise RowRejected(f"wrong type: {field} must be a list, got {json_type(messages)}")
    if not messages:
        raise RowRejected(f"empty conversation: {field} is an empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowRejected(f"wrong type: message {i} must be an object, got {json_type(m)}")
        m = {k: v for k, v in m.items() if v is not None}
        for key in ("role", "content"):
            if key not in m:
                raise RowRejected(f"missing field: message {i} has no {key}")
        for key in ("role", "content", "reasoning_content"):
            if key in m and not isinstance(m[key], str):
                raise RowRejected(f"wrong type: message {i} {key} must be a string, got {json_type(m[key])}")
        if m["role"] not in ROLES:
            raise RowRejected(f"unknown role: message {i} has role {m['role']!r} (expected {', '.join(ROLES)})")
        out.append(m)
    if reply_required and not any(m["role"] == "assistant" for m in out):
        raise RowRejected(NO_ASSISTANT)
    return out
