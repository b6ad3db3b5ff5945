"""Where the suite's time went, printed at the end of every run (after pytest's own
slowest-tests list):

- wall time per module: its tests' setup, call and teardown, so the clusters its
  fixtures started count where they were started;
- every cluster the suite started (a `yuebing up`, plain `vllm serve`, the compose
  cluster): its layout, its engines, its start-up seconds, the modules that used it;
- the total time spent starting them.

Fixtures say what they started with `suite_report(config).started(...)`; a module
used a cluster when one of its tests had that cluster among its fixtures' values."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

SHOWN_MODULES = 25  # the slowest ones by name; the rest summed in one line


@dataclass
class Start:
    """One cluster the suite started."""

    name: str
    layout: str
    engines: int
    seconds: float
    handle: object  # the fixture value tests receive: how their use is seen
    users: set[str] = field(default_factory=set)


@dataclass(eq=False)  # a plugin: hashed by identity
class SuiteReport:
    modules: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    starts: list[Start] = field(default_factory=list)

    def started(self, name: str, layout: str, engines: int, seconds: float, handle: object) -> None:
        self.starts.append(Start(name, layout, engines, seconds, handle))

    def used(self, module: str, values: list[object]) -> None:
        """`module` used every started cluster among `values` (or inside a tuple of them)."""
        seen = {id(v) for v in values} | {id(x) for v in values if isinstance(v, tuple) for x in v}
        for start in self.starts:
            if id(start.handle) in seen:
                start.users.add(module)

    def lines(self) -> list[str]:
        modules = sorted(self.modules.items(), key=lambda kv: -kv[1])
        out = [f"wall time per module ({sum(self.modules.values()) / 60:.1f} min in all):"]
        out += [f"  {s:7.1f} s  {m}" for m, s in modules[:SHOWN_MODULES]]
        if rest := modules[SHOWN_MODULES:]:
            out.append(f"  {sum(s for _, s in rest):7.1f} s  the other {len(rest)} modules")
        total = sum(s.seconds for s in self.starts)
        out.append(f"clusters started: {len(self.starts)}, {total:.0f} s starting them, "
                   f"{sum(s.engines for s in self.starts)} engines in all:")
        for s in self.starts:
            users = ", ".join(sorted(u.rsplit("/", 1)[-1] for u in s.users)) or "-"
            out.append(f"  {s.seconds:6.1f} s  {s.engines} engines  {s.name}: {s.layout}  used by {users}")
        return out

    # pytest's hooks: the report is registered as a plugin of its own (`pytest_configure`).
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.modules[report.nodeid.split("::", 1)[0]] += report.duration

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self.used(item.nodeid.split("::", 1)[0], list(getattr(item, "funcargs", {}).values()))
        yield

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.modules:  # nothing ran (--collect-only)
            return
        terminalreporter.write_sep("=", "suite report")
        for line in self.lines():
            terminalreporter.write_line(line)


NAME = "suite-report"


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteReport(), NAME)


def suite_report(config: pytest.Config) -> SuiteReport:
    return config.pluginmanager.get_plugin(NAME)
