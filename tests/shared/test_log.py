"""Logging set-up, in a service and in the processes vLLM spawns for it."""

import json
import os
import subprocess
import sys

LOG_LINE = """
import structlog
from shared.log import inherit_logging
inherit_logging()
structlog.get_logger("x").info("kv blocks claimed", request_id="r1")
"""


def run(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", LOG_LINE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, check=True)
    return (done.stderr + done.stdout).strip()


def test_a_spawned_process_logs_as_the_service_that_started_it():
    line = json.loads(run({"YUEBING_LOG": "decode decode-0 info"}))
    assert line["service"] == "decode" and line["instance"] == "decode-0"
    assert line["event"] == "kv blocks claimed" and line["request_id"] == "r1" and line["level"] == "info"


def test_a_process_no_service_started_keeps_structlogs_defaults():
    out = run({"YUEBING_LOG": ""})
    assert "kv blocks claimed" in out and not out.startswith("{")
