"""Flags generated from settings classes (yuebing/flags.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
import pytest
from msgspec import Meta

from yuebing.flags import Alias, add_flags, from_args, settings


class Config(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(description="a name")] = "x"
    pool_bytes: Annotated[int, Meta(description="a pool, bytes")] = 4 << 20
    rate: float = 1.5
    streaming: Annotated[bool, Meta(description="stream")] = True
    folder: str = ""
    owned: str = "not a flag"


@dataclass(frozen=True)
class Options:
    config: Config
    sizes: Annotated[tuple[int, ...], Meta(description="sizes")] = (1, 2)
    out: Annotated[Path | None, Meta(description="where")] = None
    home: Path = field(default_factory=Path.cwd)


ALIASES = {"pool_bytes": Alias("pool-mib", scale=1 << 20, help="a pool, MiB"), "folder": Alias(path=True),
           "name": Alias(choices=("x", "y"))}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, Config, ALIASES, skip=("owned",))
    add_flags(p, Options, skip=("config",))
    return p


def test_settings_read_types_defaults_and_descriptions():
    by_name = {s.name: s for s in settings(Options)}
    assert set(by_name) == {"sizes", "out", "home"}  # config has no default
    assert by_name["sizes"].type is int and by_name["sizes"].many and by_name["sizes"].help == "sizes"
    assert by_name["out"].type is Path and by_name["out"].default is None
    assert by_name["home"].default == Path.cwd()
    assert {s.name: s.help for s in settings(Config)}["pool_bytes"] == "a pool, bytes"


def test_defaults_give_back_the_classes_defaults():
    args = parser().parse_args([])
    config = from_args(Config, args, ALIASES, skip=("owned",))
    assert config == Config()
    assert from_args(Options, args, skip=("config",), config=config) == Options(config=Config())


def test_flags_are_kebab_case_with_aliases_units_bools_and_lists(tmp_path):
    argv = ["--name", "y", "--pool-mib", "64", "--rate", "2", "--no-streaming", "--folder", "rel",
            "--sizes", "3", "4", "--out", "o.json"]
    args = parser().parse_args(argv)
    config = from_args(Config, args, ALIASES, skip=("owned",))
    assert config == Config(name="y", pool_bytes=64 << 20, rate=2.0, streaming=False, folder=str(Path("rel").resolve()))
    options = from_args(Options, args, skip=("config",), config=config)
    assert options.sizes == (3, 4) and options.out == Path("o.json")


def test_skipped_fields_and_bad_choices_are_refused():
    with pytest.raises(SystemExit):
        parser().parse_args(["--owned", "z"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--name", "z"])


def test_help_shows_the_flag_in_its_own_unit():
    text = parser().format_help()
    assert "--pool-mib POOL_MIB" in text and "a pool, MiB" in text and "--streaming, --no-streaming" in text
