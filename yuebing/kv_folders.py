"""The launcher's KV folders (node pools and sockets, in /dev/shm where there is one):
each holds a lock file its launcher keeps locked while it runs. A launcher killed
before it could remove its folder leaves pools that hold memory until reboot (tmpfs is
memory), so each new launcher removes the folders whose lock nobody holds and whose
pools no process maps (a killed launcher's services may outlive it a while)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "yuebing-kv-"
LOCK = "launcher.lock"


def make(parent: Path) -> tuple[Path, int]:
    """A new KV folder under `parent`, and the open file that holds its lock (closing it,
    or the launcher's death, lets it go)."""
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return folder, fd


def sweep(parent: Path) -> list[Path]:
    """Remove the KV folders under `parent` whose launcher is gone; the ones removed.
    A folder without a lock file is left alone: nothing says whose it is."""
    removed = []
    for folder in parent.glob(f"{PREFIX}*"):
        if folder.is_dir() and not folder.is_symlink() and _abandoned(folder / LOCK) and not _mapped(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _abandoned(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _mapped(folder: Path, proc: Path = Path("/proc")) -> bool:
    """Whether a live process maps a file of `folder` (a pool)."""
    inside = f"{folder}/"
    for maps in proc.glob("[0-9]*/maps"):
        try:
            if inside in maps.read_text(errors="replace"):
                return True
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return False
