"""The scaffolding every service's `__main__` shares: flags, logging, the event
loop, and a stop signal on SIGINT/SIGTERM for a graceful shutdown."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import structlog
import uvloop

from shared import tracing
from shared.config import ClusterConfig, check_id, load_config, profile_path
from shared.identity import NatsCredentials, load_credentials
from shared.log import setup_logging
from shared.model_identity import fingerprint
from shared.predictor import Predictor, default_decode_chunk_tokens, default_slos_ms, load_predictor

log = structlog.get_logger(__name__)
SLOW_GC_S = 0.05  # a collection this long shows in every stream's gaps

Main = Callable[[ClusterConfig, argparse.Namespace, asyncio.Event], Coroutine[Any, Any, None]]


def freeze_heap() -> None:
    """Collect what start-up left and move every object alive now out of the cyclic
    collector's way, for good: a service's big tables, made at start, are then never
    walked by a full collection again, however they grow. The whole process's heap:
    only a service's own process does it, never a test's."""
    gc.collect()
    gc.freeze()
    gc.callbacks.append(GcWatch().on_collection)


class GcWatch:
    """Logs a cyclic collection that held the process longer than `slow_s`: a
    stalled event loop (the gateway's `event loop stalled`) is then told apart from
    one starved of a core."""

    def __init__(self, slow_s: float = SLOW_GC_S) -> None:
        self.slow_s = slow_s
        self.started = 0.0

    def on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        held = time.perf_counter() - self.started
        if held > self.slow_s:
            log.warning("slow garbage collection", held_ms=round(held * 1e3, 1), generation=info["generation"],
                        collected=info["collected"], tracked=len(gc.get_objects(info["generation"])))


def parser(service: str, instance: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.{service}", description=f"Yuebing {service}")
    p.add_argument(
        "--config",
        default=os.environ.get("YUEBING_CONFIG"),
        help="cluster config JSON (default: $YUEBING_CONFIG)",
    )
    p.add_argument("--nats-url", help="override the config's nats_url")
    p.add_argument(
        "--nats-credentials",
        default=os.environ.get("YUEBING_NATS_CREDENTIALS"),
        help="this process's NATS credentials file, owner-only (default: $YUEBING_NATS_CREDENTIALS; "
        "none: a server without authentication)",
    )
    if instance:
        p.add_argument("--nats-token-file", help="instead of --nats-credentials: log in as --instance-id with the "
                       "Kubernetes ServiceAccount token in this file (the NATS auth callout checks it)")
        p.add_argument("--instance-id", required=True, help="unique id, [A-Za-z0-9_-]")
        p.add_argument("--node", default="node-0", help="the node (messenger) this instance belongs to")
    return p


def run(service: str, main: Main, args: argparse.Namespace) -> None:
    if not args.config:
        raise SystemExit(f"{service}: --config (or $YUEBING_CONFIG) is required")
    try:
        config = load_config(args.config)
        if args.nats_url:
            config = ClusterConfig(**{**_fields(config), "nats_url": args.nats_url})
        config = resolved(config)
        instance_id = check_id(args.instance_id, "instance id") if hasattr(args, "instance_id") else ""
        if hasattr(args, "node"):
            check_id(args.node, "node")
        # Read once, here: a missing or world-readable file stops the service before it starts.
        args.nats_credentials = nats_login(args, instance_id)
    except ValueError as e:
        raise SystemExit(f"{service}: {e}") from e
    setup_logging(service, instance_id, config.log_level)
    uvloop.run(_main(service, main, config, args))


def resolved(config: ClusterConfig) -> ClusterConfig:
    """The config with what it leaves to be derived filled in: SLOs from the profile,
    and the model's fingerprint where the model folder is here to compute it from
    (the messenger and the Conductor run without it and need none)."""
    if not config.slo_ttft_ms or not config.slo_tbt_ms or not config.decode_chunk_tokens:
        config = _profiled(config, load_predictor(profile_path(config)))
    if config.model_fingerprint or not (Path(config.model) / "config.json").is_file():
        return config
    return msgspec.structs.replace(config, model_fingerprint=fingerprint(config.model))


def _profiled(config: ClusterConfig, predictor: Predictor) -> ClusterConfig:
    """SLOs and the decode engines' chunk, where the config leaves them to the profile."""
    ttft, tbt = default_slos_ms(predictor, config.max_model_len)
    config = msgspec.structs.replace(config, slo_ttft_ms=config.slo_ttft_ms or ttft, slo_tbt_ms=config.slo_tbt_ms or tbt)
    chunk = config.decode_chunk_tokens or default_decode_chunk_tokens(
        predictor, config.slo_tbt_ms / 1e3, config.max_model_len, config.step_tokens, config.block_size)
    return msgspec.structs.replace(config, decode_chunk_tokens=chunk)


def nats_login(args: argparse.Namespace, instance_id: str) -> NatsCredentials | None:
    """Who the process logs in as: its credentials file's identity, or its instance id
    with a token file; None: a server without authentication."""
    token_file = getattr(args, "nats_token_file", None)
    if token_file and args.nats_credentials:
        raise ValueError("--nats-token-file or --nats-credentials, not both")
    if token_file:
        return NatsCredentials(user=instance_id, token_file=token_file)
    return load_credentials(args.nats_credentials) if args.nats_credentials else None


def _fields(config: ClusterConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__struct_fields__}


async def _main(service: str, main: Main, config: ClusterConfig, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    provider = tracing.setup(service, config.otlp_endpoint, config.otlp_sample)
    try:
        await main(config, args, stop)
    finally:
        if provider is not None:
            provider.shutdown()  # sends what is still queued
