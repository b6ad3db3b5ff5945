"""Files and folders only their owner may read: credentials, keys, run folders.

Written with O_EXCL|O_NOFOLLOW so that a symlink or a file planted beforehand at
the path is never written through, and read back only when nobody else could have
read or changed them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: str | os.PathLike[str], repair: bool = False) -> Path:
    """Create `path` (and its parents) owner-only, or accept it if it already is ours
    and owner-only. A folder of another user, or a symlink, is refused; one of ours
    open to others is refused too, or with `repair` closed (made before this check)."""
    p = Path(path)
    try:
        p.mkdir(mode=PRIVATE_DIR, parents=True)
    except FileExistsError:
        pass
    info = p.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{p} exists and is not a folder (a symlink is not followed)")
    if repair and info.st_uid == os.getuid() and info.st_mode & 0o077:
        _close_to_others(p, info)
        return p
    _check_owner_only(p, info)
    return p


def _close_to_others(path: Path, info: os.stat_result) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, PRIVATE_DIR)  # O_NOFOLLOW: never the target of a symlink put there since
    finally:
        os.close(fd)
    log.warning("folder was open to others: made owner-only", path=str(path), mode=oct(stat.S_IMODE(info.st_mode)))


def new_private_file(path: str | os.PathLike[str], flags: int = os.O_RDWR) -> int:
    """A new owner-only file at `path`, open (a descriptor). What was there goes first,
    and is never truncated: engines may still map an old pool file, and they keep its
    inode, unharmed. A symlink or file planted after the unlink fails the open."""
    try:
        os.unlink(path)  # a symlink itself goes, not its target
    except FileNotFoundError:
        pass
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)


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
