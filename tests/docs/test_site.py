"""The docs site: it builds with `mkdocs build --strict` (a broken link, anchor or
missing page fails), its generated references equal what the code generates, and
every `yuebing` and `make` command in a bash block of the user pages parses."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from yuebing.cli import build_parser
from yuebing.reference import REFERENCE_DIR, pages

ROOT = Path(__file__).resolve().parents[2]
# The pages whose commands a new user types as shown.
USER_PAGES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/deploy.md", "docs/command.md"]


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


@pytest.mark.parametrize("name", sorted(pages()))
def test_the_generated_reference_is_current(name):
    committed = (REFERENCE_DIR / name).read_text()
    assert committed == pages()[name], f"docs/reference/{name} is stale: run `yuebing docs`"


def bash_commands(page: Path) -> list[str]:
    """The commands of a page's ```bash blocks, continuation lines joined, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.split(" #")[0].strip() for line in lines if line.strip() and not line.startswith("#")]


def _commands_of(kind: str) -> list[tuple[str, str]]:
    return [(page, c) for page in USER_PAGES for c in bash_commands(ROOT / page)
            if re.match(rf"(\S*/)?{kind}( |$)", c)]


@pytest.mark.parametrize(("page", "command"), _commands_of("yuebing"))
def test_every_yuebing_command_shown_parses(page, command):
    argv = shlex.split(command)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{command}` does not parse (exit {e.code})")


@pytest.mark.parametrize(("page", "command"), _commands_of("make"))
def test_every_make_target_shown_exists(page, command):
    done = subprocess.run(["make", "-n", *shlex.split(command)[1:]], cwd=ROOT, check=False, capture_output=True,
                          text=True)
    assert done.returncode == 0, f"{page}: `{command}`: {done.stderr}"


def test_readme_links_lead_to_files_that_exist():
    """README.md is outside the site, so `mkdocs build` does not check its links."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local and all((ROOT / link).exists() for link in local), [x for x in local if not (ROOT / x).exists()]
