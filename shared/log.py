"""structlog set-up: one JSON object a line, with the service, the instance and,
inside a request, its request id (bound with `structlog.contextvars`)."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(service: str, instance_id: str = "", level: str = "info") -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, **({"instance": instance_id} if instance_id else {}))
