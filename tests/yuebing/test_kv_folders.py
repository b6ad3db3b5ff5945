import mmap
import os

from yuebing import kv_folders


def test_a_folder_is_swept_only_once_its_launcher_let_go_of_it(tmp_path):
    folder, lock = kv_folders.make(tmp_path)
    assert folder.name.startswith(kv_folders.PREFIX)
    assert kv_folders.sweep(tmp_path) == [] and folder.is_dir()
    os.close(lock)  # what the launcher's death does
    assert kv_folders.sweep(tmp_path) == [folder] and not folder.exists()


def test_a_folder_whose_pool_a_process_still_maps_is_left(tmp_path):
    folder, lock = kv_folders.make(tmp_path)
    os.close(lock)
    pool = folder / "node-0.pool"
    pool.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(pool, "r+b") as f, mmap.mmap(f.fileno(), 0):  # a service that outlived its launcher
        assert kv_folders.sweep(tmp_path) == [] and pool.exists()
    assert kv_folders.sweep(tmp_path) == [folder]


def test_folders_without_a_lock_and_other_files_are_left(tmp_path):
    (tmp_path / f"{kv_folders.PREFIX}old").mkdir()  # nothing says whose it is
    (tmp_path / "unrelated").mkdir()
    assert kv_folders.sweep(tmp_path) == []
    assert {p.name for p in tmp_path.iterdir()} == {f"{kv_folders.PREFIX}old", "unrelated"}
