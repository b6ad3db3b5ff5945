"""Owner-only files: never written through a planted link, never read when open to others."""

import os
import stat

import pytest

from shared.private_file import private_dir, read_private, write_private


def test_written_owner_only_and_read_back(tmp_path):
    path = write_private(tmp_path / "secret", b"s3cret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_private(path) == b"s3cret"


def test_an_existing_file_or_symlink_is_never_written_through(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(target)
    for path in (target, tmp_path / "link"):
        with pytest.raises(FileExistsError):
            write_private(path, b"overwrite")
    assert target.read_bytes() == b"keep"


def test_a_file_open_to_others_or_a_symlink_is_not_read(tmp_path):
    path = write_private(tmp_path / "secret", b"s")
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="open to others"):
        read_private(path)
    path.chmod(0o600)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(OSError):
        read_private(tmp_path / "link")


def test_private_dir_is_made_owner_only_and_a_loose_one_is_refused(tmp_path):
    made = private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(PermissionError):
        private_dir(loose)


def test_with_repair_a_loose_folder_of_ours_is_closed_to_others(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o755)
    assert stat.S_IMODE(private_dir(loose, repair=True).stat().st_mode) == 0o700
