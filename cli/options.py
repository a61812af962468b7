"""A command's options from its stage's config dataclass, so the CLI restates no default, type or
help text: one `--flag` per setting (choices shown, bools as --x/--no-x), plus --config, --set,
--print-config and --json. Every flag defaults to unset; dflash_cache.core.settings resolves
defaults <- config files <- --set <- flags and checks each value. A new setting in the dataclass
is a new flag, with nothing to add here."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from functools import wraps
from pathlib import Path

import typer
from rich.markup import escape

from dflash_cache.core import settings
from dflash_cache.core.settings import Setting

TUNING = "Tuning"
CONFIG = "Config files and output"


def _option(s: Setting) -> tuple[typing.Any, typer.models.OptionInfo]:
    """(annotation, typer option) for one setting. Values reach `settings` as text (or a bool) and
    are checked there, so a flag, `--set` and a config file fail with the same message."""
    if isinstance(s.default, list):  # a constant list, made by a factory only because lists are mutable
        shown = ",".join(map(str, s.default))
    else:
        shown = "" if s.default is None or s.computed else str(s.default).lower() if s.kind is bool else str(s.default)
    tail = " [required]" if s.required else f" [default: {shown}]" if shown else ""
    common = {"help": s.help + escape(tail), "rich_help_panel": TUNING if s.tuning else None}
    if s.kind is bool:
        name = s.name.replace("_", "-")
        return bool | None, typer.Option(None, f"--{name}/--no-{name}", **common)
    extra: dict[str, typing.Any] = {"metavar": s.metavar}
    if s.choices:
        extra["autocompletion"] = lambda: list(s.choices)
    if s.kind is Path:  # click's Path type completes paths in the shell; it checks nothing by default
        return Path | None, typer.Option(None, s.flag, **common, **extra)
    return str | None, typer.Option(None, s.flag, **common, **extra)


def configured(cls: type, title: str) -> Callable[[Callable], Callable]:
    """Decorate `fn(cfg, *, as_json, **extra)`: the command gets an option per setting of `cls`
    and the common ones; `fn`'s own keyword options (e.g. --dry-run) follow."""

    def wrap(fn: Callable) -> Callable:
        specs = settings.describe(cls)
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(fn).parameters.values() if p.name not in ("cfg", "as_json")]  # fmt: skip
        params = []
        for s in specs.values():
            annotation, option = _option(s)
            params.append(inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))  # fmt: skip
        common = {
            "config_files": (list[Path] | None, typer.Option(
                None, "--config", "-c", rich_help_panel=CONFIG, metavar="FILE",
                help="Settings file (YAML or JSON; or a run's own record: RUN, RUN/train.json, CACHE, "
                     "CACHE/cache.json, OUT.jsonl of regen). Repeatable: later files win; --set and flags win over "
                     "files.")),
            "set_items": (list[str] | None, typer.Option(
                None, "--set", rich_help_panel=CONFIG, metavar="KEY=VALUE",
                help="Override one setting, e.g. --set lr=3e-3 (repeatable; flags win over --set).")),
            "print_config": (bool, typer.Option(
                False, "--print-config", rich_help_panel=CONFIG,
                help="Print the resolved settings as YAML (a config file) and exit.")),
            "as_json": (bool, typer.Option(
                False, "--json", rich_help_panel=CONFIG,
                help="Print the result as one JSON object on stdout, and no progress.")),
        }  # fmt: skip
        for name, (annotation, option) in common.items():
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=annotation))  # fmt: skip
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]

        @wraps(fn)
        def command(**kwargs: typing.Any) -> typing.Any:
            flags = {name: kwargs.pop(name) for name in specs}
            files, sets = kwargs.pop("config_files") or (), kwargs.pop("set_items") or ()
            show = kwargs.pop("print_config")
            cfg = settings.resolve(cls, files=files, sets=sets, flags={k: v for k, v in flags.items() if v is not None},
                                   complete=not show)  # fmt: skip
            if show:
                print(settings.to_yaml(cfg, f"{title} settings (defaults <- --config <- --set <- flags)"), end="")
                return None
            return fn(cfg, **kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap
