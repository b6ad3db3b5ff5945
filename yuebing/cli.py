"""The `yuebing` command: its parser is built from the command modules in
yuebing/commands/ (their protocol is in that package's docstring)."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from yuebing.commands import (
    bench_chaos,
    bench_conductor,
    bench_connector,
    bench_control_plane,
    bench_goodput,
    bench_ha,
    bench_hash,
    bench_long_context,
    bench_reuse,
    bench_soak,
    bench_tenants,
    bench_transfer,
    bench_ttft,
    compose,
    docs,
    model,
    profile,
    replay,
    secrets,
    sim,
    sim_long_context,
    sim_paper,
    sim_planner,
    sim_fleet,
    trace,
    up,
)

# In the order `yuebing --help` lists them.
COMMANDS: tuple[ModuleType, ...] = (
    model, up, secrets, compose, docs, profile, sim, sim_long_context, sim_paper, sim_planner, sim_fleet, bench_conductor, bench_control_plane, bench_hash, bench_transfer,
    bench_connector, bench_ttft, bench_reuse, bench_chaos, bench_ha, bench_soak, bench_goodput, bench_tenants, bench_long_context, replay,
    trace,
)
GROUPS = {"model": "model utilities", "bench": "benchmarks"}  # a command module's GROUP → the group's help


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless there is nothing to say (none,
    empty, a switch that is off) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, "") or (action.nargs == 0 and action.default is False) or "(default" in text:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; subparsers inherit the class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(commands: tuple[ModuleType, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = Parser(prog="yuebing", description="Yuebing: KVCache-centric disaggregated LLM serving")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for module in commands:
        group = getattr(module, "GROUP", None)
        if group is None:
            module.add_parser(top)
            continue
        if group not in groups:
            # `dest` per group, so that `yuebing bench` alone says which command it wants.
            groups[group] = top.add_parser(group, help=GROUPS[group]).add_subparsers(
                dest=f"{group}_command", required=True
            )
        module.add_parser(groups[group])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError) as e:
        print(f"yuebing: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
