"""Progress bars for a person watching, silence for logs and pipes.

`progress(iterable=None, *, total=None, desc=None, unit="it", leave=True, enabled=True)`
is tqdm when `enabled` and stderr is a terminal, else a quiet stand-in with the
same small surface: iterate it, `update(n)`, `set_postfix(...)`, `close()`, and
use it as a context manager. A bar's redraws written to a file or a pipe are
thousands of lines of noise, which is why nothing else in yuebing imports tqdm.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any


class Quiet:
    """tqdm's surface, doing nothing."""

    def __init__(self, iterable: Iterable[Any] | None = None) -> None:
        self.iterable = iterable
        self.n = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            self.n += 1
            yield item

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(
    iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str | None = None, unit: str = "it",
    leave: bool = True, enabled: bool = True,
) -> Any:
    """A tqdm bar on a terminal, else `Quiet`."""
    if not (enabled and sys.stderr.isatty()):
        return Quiet(iterable)
    from tqdm import tqdm  # only where a bar is drawn

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave)
