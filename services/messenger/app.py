"""Wiring of a messenger. For now it registers and heartbeats, so the cluster knows
its nodes; the KV block pool and node-to-node transfers come with the KV transfer
work and hang off this same process."""

from __future__ import annotations

import argparse
import asyncio

import structlog

from shared import bus, service
from shared.config import ClusterConfig
from shared.instance import Instance

log = structlog.get_logger(__name__)


def parser() -> argparse.ArgumentParser:
    return service.parser("messenger", instance=True)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    nc = await bus.connect(config.nats_url, name=args.instance_id)
    instance = Instance("messenger", args.instance_id, args.node, config, nc)
    await instance.start()
    log.info("messenger ready", node=args.node)
    await stop.wait()
    await instance.close()
    await bus.close(nc)
