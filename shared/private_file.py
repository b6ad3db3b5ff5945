"""Files and folders only their owner may read: credentials, keys, run folders.

Written with O_EXCL|O_NOFOLLOW so that a symlink or a file planted beforehand at
the path is never written through, and read back only when nobody else could have
read or changed them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create `path` (and its parents) owner-only, or accept it if it already is ours
    and owner-only; a folder of another user, or open to others, is refused."""
    p = Path(path)
    try:
        p.mkdir(mode=PRIVATE_DIR, parents=True)
    except FileExistsError:
        pass
    info = p.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{p} exists and is not a folder (a symlink is not followed)")
    _check_owner_only(p, info)
    return p


def write_private(path: str | os.PathLike[str], data: bytes) -> Path:
    """A new owner-only file; fails if anything (a file, a symlink) is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(path)


def read_private(path: str | os.PathLike[str]) -> bytes:
    """The bytes of an owner-only file of ours; anything else raises PermissionError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        _check_owner_only(Path(path), os.fstat(f.fileno()))
        return f.read()


def _check_owner_only(path: Path, info: os.stat_result) -> None:
    # root (a container's default user) reads secrets the host's user wrote.
    if info.st_uid != os.getuid() and os.getuid() != 0:
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise PermissionError(f"{path} is open to others (mode {stat.S_IMODE(info.st_mode):o}); chmod go-rwx it")
