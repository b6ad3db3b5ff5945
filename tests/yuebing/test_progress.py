"""Progress bars only on a terminal (yuebing/progress.py)."""

import io
import sys

from yuebing.progress import Quiet, progress


def test_not_a_terminal_gives_a_quiet_stand_in(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress(range(3), desc="x")
    assert isinstance(bar, Quiet) and list(bar) == [0, 1, 2]
    with progress(total=5) as manual:
        manual.update(2)
        manual.set_postfix(a=1)
    assert manual.n == 2 and sys.stderr.getvalue() == ""


def test_a_terminal_gets_tqdm_unless_disabled(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    assert type(progress(range(2))).__name__ == "tqdm"
    assert isinstance(progress(range(2), enabled=False), Quiet)
