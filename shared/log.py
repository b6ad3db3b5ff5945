"""structlog set-up: one JSON object a line, with the service, the instance and,
inside a request, its request id (bound with `structlog.contextvars`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import orjson
import structlog

# The set-up, for the processes a service spawns (vLLM's engine and workers).
LOG_ENV = "YUEBING_LOG"


def setup_logging(service: str, instance_id: str = "", level: str = "info") -> None:
    os.environ[LOG_ENV] = f"{service} {instance_id} {level}"
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.BytesLoggerFactory(file=sys.stderr.buffer),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **({"instance": instance_id} if instance_id else {}))


def _json(event: dict[str, Any], **kw: Any) -> bytes:
    """A log line's JSON: orjson's, a quarter of the standard library's time on every
    line; what it cannot write (an integer past 64 bits) by the standard library."""
    try:
        return orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS, **kw)
    except TypeError:
        return json.dumps(event, **kw).encode()


def inherit_logging() -> None:
    """vLLM spawns its engine and worker processes, where the KV connector runs and
    logs: a vLLM "general plugin" (pyproject.toml), this sets them up as the service
    that spawned them, so their lines too are JSON with service and instance."""
    setting = os.environ.get(LOG_ENV, "").split(" ")
    if len(setting) == 3 and not structlog.is_configured():
        setup_logging(*setting)
