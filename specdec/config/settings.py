"""Settings declared once: each field of a service's config dataclass carries its flag.

A field declared with `setting(default, "--flag", "help")` gives, from that one line, the
argparse flag, its environment variable (`PREFIX_FLAG`, e.g. SPECDEC_TARGET_MAX_SESSIONS; the
flag wins), its default, its `--help` text, the frozen config's field, and its row in
docs/configuration.md (`make docs` writes the tables; a test checks they are current). A
nested settings dataclass (the TLS settings) is a `group`, its flags optionally prefixed.

Nothing reads the environment at import time: `parse_settings` is called once, in a
service's `__main__`, with the environment it should read.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

C = TypeVar("C")
_FLAG = "specdec.setting"
_GROUP = "specdec.group"
_FIXED = "specdec.fixed"
REQUIRED_HINT = "(or set the environment variable named in --help)"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Flag:
    name: str  # "--max-sessions"
    help: str
    parse: Callable[[str], Any] | None = None  # text -> value; None: from the default's type
    choices: tuple[str, ...] | None = None  # the texts accepted, where they are a closed set
    required: bool = False  # the default ("" or None) is refused after parsing
    shown: str | None = None  # the default as --help and the docs show it, where the value reads badly
    more: str = ""  # docs only: detail and links beyond --help
    repeated: bool = False  # the flag may be given several times: its values joined by commas


def setting(default: Any, flag: str, help: str, **options: Any) -> Any:
    """A config field that is also a flag (see the module docstring)."""
    return field(default=default, metadata={_FLAG: Flag(flag, help, **options)})


def fixed(default: Any, why: str) -> Any:
    """A config field that is no flag: one value for every deployment, which code that builds the
    config may still set (tests, an embedding program). `why` says what it is and why it is fixed."""
    return field(default=default, metadata={_FIXED: why})


def group(default: Any, flag_prefix: str = "") -> Any:
    """A nested settings dataclass; its flags are named `--{flag_prefix}{flag}`."""
    return field(default=default, metadata={_GROUP: flag_prefix})


def on_off(text: str) -> bool:
    """'on' / 'off' -> bool: the flags' spelling of a switch."""
    if text not in ("on", "off"):
        raise ValueError(f"{text!r}: choose from on, off")
    return text == "on"


def number(kind: type, low: float, high: float | None = None) -> Callable[[str], Any]:
    """A parser of `kind` (int or float) values in [low, high]: a port past 65535, a negative
    thread count or a NaN is refused by name at start-up rather than failing later (gRPC binds
    port 70000 as 4464; torch raises at a negative thread count once the model has loaded)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and low <= value and (high is None or value <= high)):
            raise ValueError(f"{text!r} is not in [{low}, {'∞' if high is None else high}]")
        return value

    parse.__name__ = kind.__name__
    return parse


def log_level(text: str) -> str:
    """A logging level's name, in either case."""
    if text.upper() not in LOG_LEVELS:
        raise ValueError(f"{text!r}: choose from {', '.join(LOG_LEVELS)}")
    return text.upper()


def optional_text(text: str) -> str | None:
    """An empty value counts as unset (an environment variable set to "")."""
    return text or None


def _parser_for(flag: Flag, default: Any) -> Callable[[str], Any]:
    if flag.parse is not None:
        return flag.parse
    if isinstance(default, bool):
        return on_off
    if default is None:
        return optional_text
    if isinstance(default, (int, float, str)):
        return type(default)
    raise TypeError(f"{flag.name}: say how to parse a default of type {type(default).__name__}")


def shown_default(flag: Flag, default: Any) -> str:
    """The default in words: 'on', 'unset', '2.0', 'required'."""
    if flag.shown is not None:
        return flag.shown
    if flag.required:
        return "required"
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == () or default == "":
        return "unset"
    return str(default)


@dataclass(frozen=True)
class Declared:
    """One setting as a config class declares it, with its place in the (nested) config."""

    path: tuple[str, ...]  # field names from the top config down: ("upstream", "tls_ca")
    flag: Flag  # the flag's name carries its group's prefix
    default: Any

    @property
    def dest(self) -> str:
        return "__".join(self.path)

    def env_name(self, env_prefix: str) -> str:
        return f"{env_prefix}_{self.flag.name.lstrip('-').replace('-', '_').upper()}"


def declared(cls: type, flag_prefix: str = "", path: tuple[str, ...] = ()) -> Iterator[Declared]:
    """Every setting of `cls` in field order; a field that is neither a setting nor a group is an error,
    so nothing in a config escapes its flag, its variable or the docs."""
    for item in fields(cls):
        if _FLAG in item.metadata:
            flag = item.metadata[_FLAG]
            name = f"--{flag_prefix}{flag.name.removeprefix('--')}"
            yield Declared((*path, item.name), dataclasses.replace(flag, name=name), item.default)
        elif _GROUP in item.metadata:
            yield from declared(type(item.default), flag_prefix + item.metadata[_GROUP], (*path, item.name))
        elif _FIXED not in item.metadata:
            raise TypeError(f"{cls.__name__}.{item.name} is declared with neither setting(), fixed() nor group()")


class _HasProblem(Protocol):
    def problem(self) -> str | None: ...


def _build(cls: type[C], values: Mapping[tuple[str, ...], Any]) -> C:
    kwargs: dict[str, Any] = {}
    for item in fields(cls):  # type: ignore[arg-type]
        if _GROUP in item.metadata:
            inner = {path[1:]: value for path, value in values.items() if path[0] == item.name}
            kwargs[item.name] = _build(type(item.default), inner)
        elif _FIXED not in item.metadata:  # a fixed field keeps its default
            kwargs[item.name] = values[(item.name,)]
    return cls(**kwargs)


_MALFORMED = object()  # parse_config: the default of a setting whose variable is malformed


def env_value(env: Mapping[str, str], name: str, parse: Callable[[str], Any], choices: Sequence[str] | None) -> Any:
    """The variable `name` parsed; a malformed value is a start-up error naming the variable
    (argparse checks choices on flags only, never on defaults, so they are checked here too)."""
    text = env[name]
    if choices is not None and text not in choices:
        raise SystemExit(f"environment variable {name}={text!r} is invalid: choose from {', '.join(choices)}")
    try:
        return parse(text)
    except ValueError as exc:
        raise SystemExit(f"environment variable {name}={text!r} is invalid: {exc}") from exc


def saying_why(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type whose ValueError message reaches the user (argparse shows
    only "invalid parse_bytes value" for a plain ValueError)."""

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parsed.__name__ = getattr(parse, "__name__", "value")
    return parsed


def unknown_variables(env: Mapping[str, str], env_prefix: str, settings: Sequence[Declared]) -> Iterator[str]:
    """The `env_prefix`_* variables in `env` that name none of `settings`."""
    known = {item.env_name(env_prefix) for item in settings}
    return (name for name in env if name.startswith(f"{env_prefix}_") and name not in known)


def parse_settings(
    cls: type[C],
    env_prefix: str,
    argv: Sequence[str] | None,
    env: Mapping[str, str] | None,
    prog: str,
    description: str,
) -> C:
    """The frozen config from flags over `env_prefix` variables over the declared defaults;
    a missing required setting or the config's own `problem()` is a usage error."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog, description=description)
    settings = list(declared(cls))
    fallback: dict[str, Any] = {}
    bad: dict[str, str] = {}  # a malformed variable's error: a usage error only where no flag overrides it
    for item in settings:
        flag, variable = item.flag, item.env_name(env_prefix)
        parse = _parser_for(flag, item.default)
        try:
            default = env_value(env, variable, parse, flag.choices) if variable in env else item.default
        except SystemExit as exc:
            default, bad[item.dest] = _MALFORMED, str(exc)
        fallback[item.dest] = default
        parser.add_argument(
            flag.name,
            dest=item.dest,
            type=parse if parse in (int, float, str) else saying_why(parse),
            action="append" if flag.repeated else "store",
            default=None if flag.repeated else default,
            choices=list(flag.choices) if flag.choices else None,
            metavar="{on,off}" if parse is on_off else None,
            # argparse %-formats help (%(default)s): a literal % is written %%.
            help=f"{flag.help} [env {variable}; default: {shown_default(flag, item.default)}]".replace("%", "%%"),
        )
    ns = parser.parse_args(argv)  # --help first: it lists the variables the check below names
    if unknown := sorted(unknown_variables(env, env_prefix, settings)):  # gone or misspelt: never ignored
        parser.error(f"{', '.join(unknown)}: no setting of this service has that variable (`--help` lists every one)")
    for item in settings:  # a repeated flag's values, joined; its environment value or default when not given
        if item.flag.repeated:
            given = getattr(ns, item.dest)
            setattr(ns, item.dest, ",".join(given) if given else fallback[item.dest])
        if getattr(ns, item.dest) is _MALFORMED:  # the flag did not override its variable
            raise SystemExit(bad[item.dest])
    for item in settings:
        if item.flag.required and not getattr(ns, item.dest):
            parser.error(f"{item.flag.name} is required {REQUIRED_HINT}")
    config = _build(cls, {item.path: getattr(ns, item.dest) for item in settings})
    problem: _HasProblem = config  # type: ignore[assignment]
    if message := problem.problem():
        parser.error(message)
    return config


# --- docs/configuration.md ------------------------------------------------------------------


@dataclass(frozen=True)
class Service:
    """A service as the docs list it: its name, config class and variable prefix."""

    name: str  # "draft"
    config: type
    env_prefix: str  # "SPECDEC_DRAFT"


def _row(flag: Flag, variables: str, default: str) -> str:
    meaning = f"{flag.help}{'. ' + flag.more if flag.more else ''}".replace("|", "\\|")
    return f"| `{flag.name}` | `{variables}` | {default} | {meaning} |"


def _table(rows: list[str]) -> list[str]:
    return ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|", *rows]


def render_tables(services: Sequence[Service], shared: tuple[str, str] | None = None) -> str:
    """Markdown tables of every service's settings. With `shared` = two service names, the
    settings both declare go in one table first (differing defaults shown per service), and
    each of the two then lists only its own."""
    by_name = {service.name: service for service in services}
    settings = {service.name: {item.flag.name: item for item in declared(service.config)} for service in services}
    out: list[str] = []
    common: set[str] = set()
    if shared:
        first, second = (by_name[name] for name in shared)
        common = settings[first.name].keys() & settings[second.name].keys()
        rows = []
        for name, item in settings[first.name].items():
            if name not in common:
                continue
            other = settings[second.name][name]
            defaults = [shown_default(item.flag, item.default), shown_default(other.flag, other.default)]
            default = (
                defaults[0]
                if defaults[0] == defaults[1]
                else f"{defaults[0]} ({first.name}), {defaults[1]} ({second.name})"
            )
            variable = item.env_name(first.env_prefix).replace(
                first.env_prefix, f"SPECDEC_{{{first.name.upper()},{second.name.upper()}}}"
            )
            rows.append(_row(item.flag, variable, default))
        helps = f"`python -m {_module(first)} --help`, `python -m {_module(second)} --help`"
        title = f"{first.name.title()} and {second.name} ({helps})"
        out += [f"### {title}", "", *_table(rows), ""]
    for service in services:
        own = shared is not None and service.name in shared
        rows = [
            _row(item.flag, item.env_name(service.env_prefix), shown_default(item.flag, item.default))
            for name, item in settings[service.name].items()
            if not (own and name in common)
        ]
        title = f"{service.name.title()} only" if own else service.name.title()
        out += [f"### {title} (`python -m {_module(service)} --help`)", "", *_table(rows), ""]
    out += _fixed_table(services)
    return "\n".join(out).rstrip() + "\n"


def _fixed_table(services: Sequence[Service]) -> list[str]:
    """The values that are no flag (`fixed`), with why: what a deployment cannot change."""
    rows = [
        f"| {service.name} | `{item.name}` | {item.default!r} | {item.metadata[_FIXED]} |".replace("\n", " ")
        for service in services
        for item in fields(service.config)
        if _FIXED in item.metadata
    ]
    if not rows:
        return []
    head = ["### Fixed values (no flag; code that builds a config, such as the tests, may set them)", ""]
    return [*head, "| Service | Field | Value | What it is, and why it is fixed |", "|---|---|---|---|", *rows, ""]


def _module(service: Service) -> str:
    return service.config.__module__.rsplit(".", 1)[0]
