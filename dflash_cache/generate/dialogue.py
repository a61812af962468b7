"""Conversations the target answers turn by turn, shared by `dflash eval` and `dflash regen`.

A row is a dialogue: the messages each turn adds (a system prompt and a user turn, then the next user
turn, ...), each turn answered by the target before the next is asked. Turn k's prompt is the chat
template of every earlier turn followed by the target's own answer to it, and of turn k's messages,
with the generation prompt: the on-policy conversation, as MT-Bench's second turn is asked (z-lab's
benchmark) and as DFlash training data is regenerated.

:func:`turn_by_turn` drives a generation backend (``generate.Backend``) this way: the first turns'
requests go in, and each completion makes its dialogue's next request, which waits until then (the
backend's request stream yields None meanwhile). :func:`load_prompts` gives each row's first prompt
alone, for the benchmarks that decode prompts without answering later turns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cache.generate.requests import Backend, Completion, Request
from dflash_cache.rows.chat import DataError, RowRejected, check_template_kwargs, error_text, tokenize_text
from dflash_cache.rows.forms import conversation, user_turns
from dflash_cache.rows.sources import LINE, read_rows, source_row

__all__ = [
    "REASONING_MARKERS", "Dialogue", "chat_prompt", "first_prompt", "load_dialogues", "load_prompts", "reply_decoder",
    "turn_by_turn",
]

REASONING_MARKERS = ("<think>", "</think>")  # kept in a reply even where the tokenizer calls them special


@dataclass(frozen=True)
class Dialogue:
    """A prompt row as the target is asked it. ``turns[k]`` holds the messages turn k adds before the
    target answers; a ``text`` row is one turn of plain text (``text``, special tokens as the
    tokenizer adds them). ``source`` is the row's own, where it names one (long-code's: the file
    its prefix is of), so that eval can set a file's prompts of different lengths side by side."""

    turns: tuple[tuple[dict[str, Any], ...], ...] = ()
    text: str | None = None
    source: str | None = None

    @classmethod
    def of_row(cls, row: dict[str, Any], *, first_turn: bool = False) -> Dialogue:
        """A row of any form extract reads. A ``turns`` row (MT-Bench) is a dialogue of its user turns;
        any other conversation is one turn: its messages up to the reply, the earlier replies as the
        row wrote them (trailing assistant turns dropped, so training data works as prompts).
        ``first_turn`` keeps the first turn only. Raises RowRejected for a row that cannot be asked."""
        row = source_row(row)  # a JSON line parsed once, here
        source = row["source"] if isinstance(row.get("source"), str) else None
        turns = user_turns(row)
        if turns is not None:
            kept = turns[:1] if first_turn else turns
            return cls(turns=tuple(({"role": "user", "content": t},) for t in kept), source=source)
        messages = conversation(row, reply_required=False)
        if messages is None:
            text = row["text"]
            if not isinstance(text, str):
                raise RowRejected("wrong type: text must be a string")
            return cls(text=text, source=source)
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise RowRejected("no message before the assistant's reply")
        return cls(turns=(tuple(messages),), source=source)

    def __len__(self) -> int:
        return 1 if self.text is not None else len(self.turns)

    def messages(self, answers: list[str]) -> list[dict[str, Any]]:
        """The conversation of turn ``len(answers)``: each earlier turn and the target's answer to it,
        then this turn's messages."""
        out: list[dict[str, Any]] = []
        for turn, answer in zip(self.turns, answers, strict=False):
            out += [*turn, {"role": "assistant", "content": answer}]
        return out + list(self.turns[len(answers)])

    def prompt(self, tokenizer, template_kwargs: Mapping[str, Any], answers: list[str]) -> list[int]:
        """Token ids of turn ``len(answers)``'s prompt (see the module docstring)."""
        if self.text is not None:
            ids = tokenize_text(tokenizer, self.text, add_special_tokens=True)
            if not ids:
                raise RowRejected("empty prompt")
            return ids
        return chat_prompt(tokenizer, self.messages(answers), template_kwargs)


def chat_prompt(tokenizer, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any]) -> list[int]:
    """The ids the target continues to answer `messages`: their chat template with the generation
    prompt and the template kwargs, tokenized as rendered (the template writes the special tokens)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as e:  # jinja2 raises many types
        raise RowRejected(f"chat template error: {error_text(e)}") from None
    ids = tokenize_text(tokenizer, text)
    if not ids:
        raise RowRejected("empty prompt")
    return ids


def reply_decoder(tokenizer) -> Callable[[list[int]], str]:
    """Generated ids -> reply text: special tokens dropped (as `skip_special_tokens` would), except
    the reasoning markers, which `skip_special_tokens` drops where they are added as special."""
    added = tokenizer.added_tokens_decoder
    drop = (set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}) - {
        i for i, t in added.items() if t.content in REASONING_MARKERS
    }
    return lambda ids: tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)


def turn_by_turn(backend: Backend, first: Iterable[Request], follow: Callable[[Completion], Request | None], *,
                 drop: Callable[[Hashable], bool] | None = None) -> Iterator[Completion]:  # fmt: skip
    """Completions of `first` and of every request their completions lead to.

    `follow(c)` is called on each completion before it is yielded and returns its dialogue's next
    request (None: the dialogue is done). A next turn goes to the front of the queue, so dialogues
    finish in about the order they began. `drop(key)` skips a queued request (a caller giving up on
    a group of dialogues)."""
    queue: deque[Request] = deque(first)
    in_flight = 0

    def feed() -> Iterator[Request | None]:
        nonlocal in_flight
        while queue or in_flight:
            if not queue:
                yield None  # the next request waits on a completion
            elif drop is not None and drop(queue[0].key):
                queue.popleft()
            else:
                in_flight += 1
                yield queue.popleft()

    for c in backend.stream(feed()):
        in_flight -= 1
        if (r := follow(c)) is not None:
            queue.appendleft(r)
        yield c


def load_dialogues(path: str, *, split: str | None = None, limit: int | None = None,
                   first_turn: bool = False) -> list[Dialogue]:  # fmt: skip
    """The rows of a prompt set (any source `rows.sources.read_rows` reads) as dialogues. A row that
    cannot be asked fails the whole set, naming its line or row: a benchmark is meant whole."""
    out = []
    for i, row in enumerate(read_rows(path, split=split, max_samples=limit)):
        where = f"{path} row {i}" if row.get(LINE) is None else f"{path} line {row[LINE]}"
        try:
            out.append(Dialogue.of_row(row, first_turn=first_turn))
        except RowRejected as e:
            raise DataError(f"{where}: {e.reason}") from None
    if not out:
        raise DataError(f"{path}: no prompts")
    return out


def load_prompts(
    path: str | Path,
    tokenizer,
    limit: int | None = None,
    chat_template_kwargs: dict | None = None,
    split: str | None = None,
) -> list[list[int]]:
    """Prompt token ids (each row's first turn) from the rows `dflash extract` reads (a JSONL / JSON /
    Parquet file, a saved dataset or a hub dataset name; any form `dialogue.Dialogue.of_row` reads).

    A conversation goes through the chat template with the generation prompt, and with
    ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``); its trailing assistant turns
    are dropped first, so the training data works as a prompt set, and rows that stop before the
    reply (user-only ``messages``, a ``prompt`` without ``response``) are prompts as they are.
    ``text`` rows are plain text (special tokens as the tokenizer adds them). A ``turns`` row gives
    its first turn (the later ones need the target's answers: `turn_by_turn` asks them).
    """
    kwargs = check_template_kwargs(chat_template_kwargs)
    dialogues = load_dialogues(str(path), split=split, limit=limit)
    return [first_prompt(d, tokenizer, kwargs, f"{path} row {i}") for i, d in enumerate(dialogues)]


def first_prompt(dialogue: Dialogue, tokenizer, kwargs: dict, where: str) -> list[int]:
    try:
        return dialogue.prompt(tokenizer, kwargs, [])
    except RowRejected as e:
        raise DataError(f"{where}: {e.reason}") from None
