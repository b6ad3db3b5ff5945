"""yuebing/timeline.py: a request's lines gathered from every log, in time order."""

from __future__ import annotations

import json

import pytest

from yuebing.timeline import check_request_id, entries, render

RID = "0123456789abcdef0123456789abcdef"


def _log(folder, name, *records, noise=True):
    lines = ["INFO 11-27 vLLM's own plain line naming " + RID] if noise else []
    lines += [json.dumps(r) for r in records]
    (folder / f"{name}.log").write_text("\n".join(lines) + "\n{torn")


def _at(ms: int) -> str:
    return f"2026-11-27T03:46:20.{ms:03d}000Z"


def test_the_lines_of_one_request_from_every_process_in_time_order(tmp_path):
    _log(tmp_path, "gateway", {"event": "request", "request_id": RID, "timestamp": _at(0), "prompt_len": 62},
         {"event": "request done", "request_id": RID, "timestamp": _at(90)},
         {"event": "request", "request_id": "f" * 32, "timestamp": _at(5)})  # another request
    _log(tmp_path, "decode-0", {"event": "kv blocks claimed", "request_id": f"{RID}-0-abc", "timestamp": _at(50)})
    _log(tmp_path, "conductor", {"event": "scheduled", "request_id": RID, "timestamp": _at(2), "level": "warning"})
    found = entries(tmp_path, RID)
    assert [(e.process, e.event) for e in found] == [
        ("gateway", "request"), ("conductor", "scheduled"), ("decode-0", "kv blocks claimed"), ("gateway", "request done")]
    text = render(found, RID)
    assert "4 lines from 3 processes, 90.0 ms" in text
    assert "+50.0 ms  decode-0   kv blocks claimed" in text and "WARNING scheduled" in text
    assert "prompt_len=62" in text


def test_nothing_found_says_so(tmp_path):
    assert render(entries(tmp_path, RID), RID) == f"no log line names request {RID}"


@pytest.mark.parametrize("bad", ["", "xyz", "../../etc/passwd", RID + "-0", "A" * 32])
def test_a_request_id_is_checked_before_anything_is_read(bad):
    with pytest.raises(ValueError, match="is not a request id"):
        check_request_id(bad)


def test_a_missing_run_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="no run folder"):
        entries(tmp_path / "none", RID)
