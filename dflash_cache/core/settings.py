"""A stage's settings from three places, resolved one way: the config dataclass's defaults, then
config files (YAML, JSON, or what an earlier run recorded), then `--set key=value`, then flags.

The stages' config dataclasses (ExtractConfig, TrainConfig, RegenConfig, EvalConfig) are the one
source of every default and help text: their fields are declared with `setting()`, and the CLI,
config files, bench and the tests all read them from there. This module only knows dataclasses
and types, never a stage: it checks each value against its field's type (naming the key and the
type it expected), refuses unknown keys (naming them), and turns a resolved config back into YAML.

PyYAML reads and writes the files (transformers already depends on it); the typed checking is
ours, because it must accept the command line's text ("3e-3", "0-4", "1,9,17") and a config
file's parsed values by the same rules and with the same messages.

A config class may translate a recorded form of its own (a run's train.json, a cache's
cache.json) with a `from_record(data, path)` classmethod, and name where a directory or output
keeps that record with `record_path(path)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_cache.core.errors import UserError

T = typing.TypeVar("T")


class SettingsError(UserError, ValueError):
    """A setting that is unknown, missing or of the wrong type; the message names the key."""


def setting(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
            expects: str | None = None, min: float | None = None, tuning: bool = False) -> Any:  # fmt: skip
    """A config field with its help text. `expects` overrides the type's wording in errors ("layer
    ids like 1,9,17"); `min` bounds a number; `tuning` files the flag under the tuning options."""
    meta = {"help": help, "expects": expects, "min": min, "tuning": tuning}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of a config class, as the checks and the CLI see it."""

    name: str
    kind: Any  # the field's type without None: int, float, bool, str, Path, list, dict, or a Literal
    optional: bool
    default: Any  # MISSING for a required setting
    computed: bool  # the default is computed on this machine (a default_factory), not a constant
    help: str
    expects_text: str | None
    min: float | None
    tuning: bool
    words: tuple[str, ...] = ()  # literal words a non-text setting also takes: `int | Literal["auto"]`

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return typing.get_args(self.kind) if typing.get_origin(self.kind) is Literal else None

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def expects(self) -> str:
        if self.expects_text:
            text = self.expects_text
        elif self.choices:
            c = [str(x) for x in self.choices]
            text = " or ".join(c) if len(c) == 2 else "one of " + ", ".join(c)
        elif self.names:
            text = "comma-separated names like a,b"
        else:
            text = _WORDS.get(self.kind, _WORDS.get(typing.get_origin(self.kind), "a value"))
        text += f" >= {self.min:g}" if self.min is not None else ""  # the bound is the number's, not a word's
        return text + "".join(f" or {w}" for w in self.words)

    @property
    def names(self) -> bool:
        """A list of words (`list[str]`) rather than of integers."""
        return self.kind == list[str]

    @property
    def metavar(self) -> str:
        if self.choices:
            return "[" + "|".join(str(x) for x in self.choices) + "]"
        if self.names:
            return "NAMES"
        return "|".join((_METAVARS.get(self.kind, _METAVARS.get(typing.get_origin(self.kind), "TEXT")), *self.words))


_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path",
          list: "comma-separated integers like 1,9,17", dict: "a JSON object"}  # fmt: skip
_METAVARS = {int: "INTEGER", float: "FLOAT", bool: "BOOLEAN", str: "TEXT", Path: "PATH", list: "INTS",
             dict: "JSON"}  # fmt: skip


@cache
def describe(cls: type) -> dict[str, Setting]:
    """The settings of a config dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind, optional, words = hints[f.name], False, ()
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            kind, optional = args[0], len(args) < len(typing.get_args(kind))
            words = tuple(w for a in args[1:] if typing.get_origin(a) is Literal for w in typing.get_args(a))
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)  # fmt: skip
        m = f.metadata
        out[f.name] = Setting(f.name, kind, optional, default, f.default_factory is not MISSING, m.get("help", ""),
                              m.get("expects"), m.get("min"), m.get("tuning", False), words)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- one value


def _fail(s: Setting, where: str, value: Any, why: str | None = None) -> SettingsError:
    shown = repr(value) if not isinstance(value, (list, dict)) else json.dumps(value)
    return SettingsError(f"{where} {shown}: {why or 'expected ' + s.expects}")


def int_list(text: str) -> list[int]:
    """'1,9,17' -> [1, 9, 17]; ranges too: '0,2,5-7' -> [0, 2, 5, 6, 7]; '[1, 9]' as YAML writes it.
    Raises ValueError with the reason."""
    ids: list[int] = []
    for part in text.strip().strip("[]").replace(" ", "").split(","):
        if "-" in part[1:]:
            lo, hi = (int(x) for x in part.split("-", 1))
            if hi < lo:
                raise ValueError(f"the range {part} runs backwards (write {hi}-{lo})")
            ids.extend(range(lo, hi + 1))
        elif part:
            ids.append(int(part))
    if not ids:
        raise ValueError("no ids")
    return ids


def name_list(text: str) -> list[str]:
    """'dflash, dspark' -> ['dflash', 'dspark']; '[a, b]' as YAML writes it. Raises ValueError."""
    names = [x.strip() for x in text.strip().strip("[]").split(",") if x.strip()]
    if not names:
        raise ValueError("no names")
    return names


def from_text(s: Setting, text: str, where: str) -> Any:
    """A command-line value (a flag's or --set's text) as the setting's type."""
    if s.optional and (text == "null" or (s.kind is not str and text.strip().lower() in ("none", "~"))):
        return None
    if text in s.words:
        return text
    kind = typing.get_origin(s.kind) or s.kind
    if kind is dict:
        try:
            return check(s, json.loads(text), where)
        except ValueError as e:
            if isinstance(e, SettingsError):
                raise
            raise _fail(s, where, text, f"not valid JSON ({e})") from None
    try:
        if kind is bool:
            low = text.strip().lower()
            if low not in _BOOLS:
                raise ValueError
            value: Any = _BOOLS[low]
        elif kind is int:
            value = int(text)
        elif kind is float:
            value = float(text)
        elif kind is list:
            value = name_list(text) if s.names else int_list(text)
        elif kind is Path:
            value = Path(text)
        else:  # str and Literal
            value = text
    except ValueError as e:
        raise _fail(s, where, text, str(e) if str(e).startswith("the range") else None) from None
    return check(s, value, where)


_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def check(s: Setting, value: Any, where: str) -> Any:
    """A value from a config file (already typed by YAML or JSON), checked and normalised."""
    if value is None:
        if s.optional:
            return None
        raise _fail(s, where, value)
    if value in s.words:
        return value
    kind = typing.get_origin(s.kind) or s.kind
    if isinstance(value, str) and kind not in (str, Literal, Path):  # "3e-3" is a string to PyYAML
        return from_text(s, value, where)
    if s.names and isinstance(value, list):  # [auto, 288]: a name that YAML read as a number
        value = [str(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in value]
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        Path: lambda v: isinstance(v, (str, Path)),
        list: lambda v: isinstance(v, list) and all(isinstance(x, str) if s.names else
                                                    isinstance(x, int) and not isinstance(x, bool) for x in v),
        dict: lambda v: isinstance(v, dict),
        Literal: lambda v: v in s.choices,
    }[kind]
    if not ok(value):
        if kind is dict:
            raise _fail(s, where, value, f"must be a JSON object, got {type(value).__name__}")
        raise _fail(s, where, value)
    if kind is float:
        value = float(value)
    elif kind is Path:
        value = Path(value)
    if s.min is not None and value < s.min:
        raise _fail(s, where, value)
    return value


# ----------------------------------------------------------------------------- files


def read_config(path: str | Path, cls: type) -> dict[str, Any]:
    """A config file as a mapping of settings: YAML or JSON, or a run's own record (a directory or
    output that `cls.record_path` knows, a train.json, a cache.json), translated by
    `cls.from_record`. Keys are not checked here (`resolve` does, naming the file)."""
    given = Path(path)
    path = cls.record_path(given) if hasattr(cls, "record_path") else given
    if not path.is_file():
        why = ("no such file" if path == given else f"a directory without {path.name}" if given.is_dir()
               else f"no {path.name} beside it")  # fmt: skip
        raise SettingsError(f"--config {given}: {why}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise SettingsError(f"--config {path}: not YAML or JSON ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    if hasattr(cls, "from_record"):
        data = cls.from_record(data, path)
    return data


def parse_sets(items: Iterable[str]) -> dict[str, str]:
    """`--set key=value` items as {key: text}; later items win."""
    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE, e.g. --set lr=3e-3")
        out[key.strip()] = text
    return out


def _setting(cls: type, key: str, source: str) -> Setting:
    known = describe(cls)
    name = key.replace("-", "_")
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f"; the settings are: {', '.join(known)}"
        raise SettingsError(f"{source}: unknown setting {key!r}{hint}")
    return known[name]


# ----------------------------------------------------------------------------- resolution


def resolve(cls: type[T], *, files: Iterable[str | Path] = (), sets: Iterable[str] = (),
            flags: Mapping[str, Any] | None = None, complete: bool = True) -> T:  # fmt: skip
    """The config: `cls`'s defaults <- each config file in order <- `--set` items <- flags (a
    mapping of setting name to the flag's text, or a bool). With `complete=False` a required
    setting may stay unset (None), for `--print-config` of a template."""
    values: dict[str, Any] = {}
    for path in files:
        for key, value in read_config(path, cls).items():
            s = _setting(cls, key, f"--config {path}")
            values[s.name] = check(s, value, f"{s.name} (in {path})")
    for key, text in parse_sets(sets).items():
        s = _setting(cls, key, "--set")
        values[s.name] = from_text(s, text, f"--set {s.name}")
    for name, value in (flags or {}).items():
        s = _setting(cls, name, "flags")
        values[s.name] = from_text(s, value, s.flag) if isinstance(value, str) else check(s, value, s.flag)
    missing = [s for s in describe(cls).values() if s.required and s.name not in values]
    if missing and complete:
        raise SettingsError(f"missing {', '.join(s.flag for s in missing)} (a flag, --set or a --config file)")
    return cls(**{s.name: None for s in missing}, **values)


def plain(cfg: Any) -> dict[str, Any]:
    """A config as JSON-able values (paths as text)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()}


def to_yaml(cfg: Any, title: str = "") -> str:
    """The config as YAML that `--config` reads back, each key under its help text as a comment."""
    lines, values = [f"# {title}"] if title else [], plain(cfg)
    for s in describe(type(cfg)).values():
        if s.help:
            lines.append(f"# {s.help}")
        text = yaml.safe_dump(values[s.name], default_flow_style=True, width=1 << 16).strip()
        lines.append(f"{s.name}: {text.removesuffix('...').strip()}")
    return "\n".join(lines) + "\n"


def same_as(cls: type, name: str, more: str = "") -> Any:
    """A setting that means what `cls`'s setting `name` means: its default, its help (`more`
    appended) and its checks."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    m = f.metadata
    factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
    return setting(f.default, f"{m['help']} {more}".strip(), factory=factory, expects=m["expects"], min=m["min"],
                   tuning=m["tuning"])  # fmt: skip
