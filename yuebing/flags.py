"""Command-line flags generated from a settings class, so that a setting is declared
once: its name, type, default and description live on the class (a msgspec Struct
such as shared.config.ClusterConfig, or a dataclass such as launcher.UpOptions).

- `add_flags(parser, cls, aliases={}, skip=())`: one `--kebab-case` flag per field,
  its help the field's description (`Annotated[T, msgspec.Meta(description=...)]`)
  and its default the field's. Types: str, int, float, Path, `X | None` (default
  None), `tuple[X, ...]` (one or more values), bool (`--x/--no-x`).
- `from_args(cls, args, aliases={}, skip=(), **given)`: the instance back from the
  parsed flags; `given` fills the fields that are not flags.
- `Alias`: where the flag a user types differs from the field (another name, MiB for
  bytes, a list of choices, a path made absolute, a default computed at start).

Each flag's `dest` is its field's name, so two classes given to one parser must not
share field names (argparse refuses a flag added twice).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

NO_DEFAULT: Any = object()  # an Alias that keeps the field's default


@dataclass(frozen=True)
class Alias:
    flag: str = ""  # the flag without "--" (default: the field's name in kebab case)
    scale: int = 1  # field value = flag value × scale (MiB → bytes: 1 << 20)
    choices: tuple[str, ...] = ()
    path: bool = False  # a file or folder: made absolute (an empty one stays empty)
    help: str = ""  # instead of the field's description (say the flag's unit when it is scaled)
    default: Any = NO_DEFAULT  # instead of the field's default (e.g. one read from the environment)


@dataclass(frozen=True)
class Setting:
    """One field of a settings class, as a flag sees it."""

    name: str
    type: Any  # the bare type (int, str, Path, ...): optional and annotated wrappers removed
    default: Any
    help: str
    many: bool = False  # tuple[X, ...]


def settings(cls: type) -> list[Setting]:
    """The fields of a msgspec Struct or a dataclass that have a default (or a default factory)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    if dataclasses.is_dataclass(cls):
        fields = [(f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)]
        missing: Any = dataclasses.MISSING
    else:
        fields = [(f.name, f.default, f.default_factory) for f in msgspec.structs.fields(cls)]
        missing = msgspec.NODEFAULT
    found = []
    for name, default, factory in fields:
        if default is missing and factory is not missing:
            default = factory()
        if default is not missing:
            found.append(_setting(name, hints[name], default))
    return found


def _setting(name: str, hint: Any, default: Any) -> Setting:
    help_text = ""
    if typing.get_origin(hint) is typing.Annotated:
        hint, *extras = typing.get_args(hint)
        help_text = next((m.description for m in extras if isinstance(m, msgspec.Meta) and m.description), "")
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))  # X | None: the flag is an X
    many = typing.get_origin(hint) is tuple
    if many:
        hint = typing.get_args(hint)[0]
    return Setting(name, hint, default, help_text, many)


def add_flags(
    parser: argparse.ArgumentParser, cls: type, aliases: Mapping[str, Alias] | None = None, skip: Collection[str] = (),
) -> None:
    """A flag for each field of `cls` but those in `skip`."""
    aliases = aliases or {}
    for s in settings(cls):
        if s.name not in skip:
            _add(parser, s, aliases.get(s.name, Alias()))


def _add(parser: argparse.ArgumentParser, s: Setting, alias: Alias) -> None:
    name = alias.flag or s.name.replace("_", "-")
    default = s.default if alias.default is NO_DEFAULT else alias.default
    # argparse formats help with %: a description's own "%" must not read as a format.
    kwargs: dict[str, Any] = {"dest": s.name, "help": (alias.help or s.help).replace("%", "%%")}
    if s.type is bool:
        parser.add_argument("--" + name, action=argparse.BooleanOptionalAction, default=default, **kwargs)
        return
    # Named after the flag, not the field (--pool-mib POOL_MIB); choices show themselves.
    kwargs["metavar"] = None if alias.choices else name.replace("-", "_").upper()
    if alias.scale != 1 and default is not None:
        default //= alias.scale
    if alias.choices:
        kwargs["choices"] = alias.choices
    if s.many:
        kwargs["nargs"] = "+"
        default = list(default)
    parser.add_argument("--" + name, type=s.type, default=default, **kwargs)


def from_args(
    cls: type, args: argparse.Namespace, aliases: Mapping[str, Alias] | None = None, skip: Collection[str] = (),
    **given: Any,
) -> Any:
    """`cls` from the flags `add_flags` added (with the same aliases and skip)."""
    aliases = aliases or {}
    values = dict(given)
    for s in settings(cls):
        if s.name not in skip and s.name not in given:
            values[s.name] = _value(s, aliases.get(s.name, Alias()), getattr(args, s.name))
    return cls(**values)


def _value(s: Setting, alias: Alias, value: Any) -> Any:
    if value is None:
        return None
    if s.many:
        return tuple(value)
    if alias.path and value:
        return s.type(Path(value).resolve())
    return value * alias.scale if alias.scale != 1 else value
