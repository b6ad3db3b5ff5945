"""The services' scaffolding: what it adds to every service's process."""

from __future__ import annotations

import time

import pytest

from structlog.testing import capture_logs

from shared.service import GcWatch


def test_a_slow_collection_is_logged_with_its_generation_and_a_quick_one_is_not():
    watch = GcWatch(slow_s=0.01)
    with capture_logs() as logs:
        watch.on_collection("start", {"generation": 0})
        watch.on_collection("stop", {"generation": 0, "collected": 3, "uncollectable": 0})
        watch.on_collection("start", {"generation": 2})
        time.sleep(0.02)
        watch.on_collection("stop", {"generation": 2, "collected": 7, "uncollectable": 0})
    assert len(logs) == 1
    line = logs[0]
    assert line["event"] == "slow garbage collection" and line["generation"] == 2 and line["collected"] == 7
    assert line["held_ms"] >= 10 and line["tracked"] >= 0


def test_an_instance_logs_in_as_itself_with_a_token_file_or_with_its_credentials_file_not_both(tmp_path):
    import argparse

    from shared.identity import NatsCredentials
    from shared.service import nats_login

    token = tmp_path / "token"
    token.write_text("a-token\n")
    args = argparse.Namespace(nats_token_file=str(token), nats_credentials=None)
    login = nats_login(args, "decode-3")
    assert login == NatsCredentials(user="decode-3", token_file=str(token)) and login.secret()() == "a-token"
    with pytest.raises(ValueError, match="not both"):
        nats_login(argparse.Namespace(nats_token_file=str(token), nats_credentials="creds.json"), "decode-3")
    assert nats_login(argparse.Namespace(nats_credentials=None), "") is None  # a server without authentication
