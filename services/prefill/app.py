"""Wiring of a prefill instance: config → engine → NATS → handler."""

from __future__ import annotations

import argparse
import asyncio

from services.prefill.handler import Prefiller
from shared import service
from shared.config import ClusterConfig
from shared.instance import serve_engine
from shared.messages import PrefillRequest, prefill_subject


def parser() -> argparse.ArgumentParser:
    return service.parser("prefill", instance=True)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    await serve_engine(
        "prefill",
        config,
        args.instance_id,
        args.node,
        stop,
        prefill_subject(args.instance_id),
        PrefillRequest,
        lambda instance, engine: Prefiller(instance, engine).on_request,
    )
