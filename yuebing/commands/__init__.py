"""The `yuebing` subcommands, one module each; yuebing/cli.py builds the parser from
the modules listed in its `COMMANDS` tuple, in the order `yuebing --help` shows them.

The protocol every command module follows:
- `GROUP`: None for a top-level command (`yuebing up`), else the group the command
  belongs to: "bench" (`yuebing bench ttft`) or "model" (`yuebing model init`);
  cli.GROUPS names the groups and their help.
- `add_parser(subparsers) -> None`: adds the command's subparser to `subparsers`
  (its group's, or `yuebing`'s own), with its help and flags, and sets
  `func=run` with `set_defaults`. A module may add several related commands
  (commands/replay.py: `bench replay` and `bench fidelity`), each with its `func`.
- `run(args) -> int`: carries the command out; returns the exit status.

Imports that take seconds (vLLM, torch, the simulator, matplotlib) go inside `run`,
so that `yuebing --help` stays quick. Settings that a dataclass or msgspec Struct
already declares become flags through yuebing/flags.py rather than by hand.

Helpers for the modules: `add_json_flag(parser)`, `write_json(result, path)`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """--model and --work-dir, for a benchmark that starts its own cluster."""
    parser.add_argument("--model", default="", help="model folder (default: yuebing's)")
    parser.add_argument("--work-dir", help="where the cluster's logs go (default: a temp folder)")


def cluster_paths(args: argparse.Namespace, name: str) -> tuple[Path, Path]:
    """(the model folder, the work folder, made) from `add_cluster_flags`' flags."""
    from yuebing.model import default_model_dir

    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"yuebing-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    return Path(args.model or default_model_dir()), work


def positive_int(text: str) -> int:
    """An argparse type: a whole number, at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the result here")


def write_json(result: Any, path: str | Path | None) -> None:
    """Write `result` as indented JSON when a path is given (`--json`)."""
    if path:
        Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def text_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A titled table of right-aligned columns, for a terminal."""
    widths = [max(len(c) for c in column) for column in zip(header, *rows)]
    lines = [f"\n{title}", "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
