"""A service's Prometheus page on a port of its own: /metrics from the service's
registry, served by aiohttp in the service's own event loop (a collector reads the
service's state between its handlers, never while one is changing it), behind a
Bearer key when one is given (the gateway's API key)."""

from __future__ import annotations

import argparse

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shared.bearer import UNAUTHORIZED, bearer_matches
from shared.private_file import read_private

# A histogram of times that mostly stay under a millisecond (a scheduling decision).
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


def page(registry: CollectorRegistry, key: str | None = None) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        if key and not bearer_matches(request, key):
            return web.json_response({"error": {**UNAUTHORIZED, "param": None}}, status=401)
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve(registry: CollectorRegistry, host: str, port: int, key: str | None = None) -> web.AppRunner:
    """Start the page; the caller cleans the runner up on shutdown."""
    runner = web.AppRunner(page(registry, key), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A service's flags for its page (the messenger's and gateway's have their own)."""
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="the address /metrics listens on")
    # Never the key itself on the command line: argv is readable by every local user.
    p.add_argument("--metrics-key-file", default=None,
                   help="owner-only file holding the Bearer key /metrics requires (the gateway's API key; "
                        "none: /metrics is open)")


async def serve_for(args: argparse.Namespace, registry: CollectorRegistry, service: str) -> web.AppRunner | None:
    """The page `add_arguments`' flags ask for (None: --metrics-port 0)."""
    if not args.metrics_port:
        return None
    try:
        key = read_private(args.metrics_key_file).decode("utf-8").strip() if args.metrics_key_file else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"{service}: metrics key: {e}") from e
    return await serve(registry, args.metrics_host, args.metrics_port, key or None)
