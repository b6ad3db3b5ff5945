"""One request's timeline across a cluster's processes, from the run folder's logs:
`yuebing trace REQUEST_ID`. Every service logs JSON lines carrying the request id it
is working for (shared/log.py); a retried request's attempts and vLLM's own request
ids start with it. No tracing backend needed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REQUEST_ID = re.compile(r"[0-9a-f]{8,64}")  # the gateway's ids: hex (uuid4().hex)
ID_FIELDS = ("request_id", "attempt", "attempt_id")
SHOWN_LEVEL = {"warning", "error", "critical"}
LEFT_OUT = {"event", "timestamp", "service", "instance", "level", "request_id", "client_request_id"}


@dataclass(frozen=True)
class Entry:
    at: datetime
    process: str  # the log file's name: gateway, conductor, prefill-0, ...
    event: str
    level: str = "info"
    fields: dict = field(default_factory=dict)


def check_request_id(request_id: str) -> str:
    if not REQUEST_ID.fullmatch(request_id):
        raise ValueError(f"{request_id!r} is not a request id: the gateway's are 8 to 64 hex digits "
                         "(the x-yuebing-request-id header of its response)")
    return request_id


def entries(run_dir: Path, request_id: str) -> list[Entry]:
    """Every logged line of the request, in time order."""
    if not run_dir.is_dir():
        raise ValueError(f"no run folder at {run_dir} (yuebing up prints where it logs; --run-dir chooses it)")
    found = [e for log in sorted(run_dir.glob("*.log")) for e in _matching(log, check_request_id(request_id))]
    return sorted(found, key=lambda e: e.at)


def _matching(log: Path, request_id: str) -> Iterator[Entry]:
    with log.open(errors="replace") as lines:
        for line in lines:
            if request_id not in line:  # cheap, before parsing
                continue
            record = log_record(line)
            if record is not None and any(str(record.get(f, "")).startswith(request_id) for f in ID_FIELDS):
                yield Entry(datetime.fromisoformat(record["timestamp"]), log.stem, str(record.get("event", "")),
                            str(record.get("level", "info")), {k: v for k, v in record.items() if k not in LEFT_OUT})


def log_record(line: str) -> dict | None:
    """A JSON log line with a timestamp, or None (vLLM's own plain lines, a torn line)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "timestamp" in record else None


def render(timeline: list[Entry], request_id: str) -> str:
    """A line per entry: milliseconds since the first, the process, what happened, its fields."""
    if not timeline:
        return f"no log line names request {request_id}"
    start = timeline[0].at
    width = max(len(e.process) for e in timeline)
    processes = len({e.process for e in timeline})
    span_ms = (timeline[-1].at - start).total_seconds() * 1e3
    lines = [f"request {request_id}: {len(timeline)} lines from {processes} processes, {span_ms:.1f} ms from first to last"]
    for e in timeline:
        level = f"{e.level.upper()} " if e.level in SHOWN_LEVEL else ""
        detail = " ".join(f"{k}={json.dumps(v)}" for k, v in e.fields.items() if v is not None)
        offset = (e.at - start).total_seconds() * 1e3
        lines.append(f"{offset:+10.1f} ms  {e.process:<{width}}  {level}{e.event}  {detail}".rstrip())
    return "\n".join(lines)
