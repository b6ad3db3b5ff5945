"""Wiring of a decode instance: config → engine → NATS → handler."""

from __future__ import annotations

import argparse
import asyncio

from services.decode.handler import Decoder
from shared import service
from shared.config import ClusterConfig, profile_path
from shared.instance import serve_engine
from shared.messages import DecodeRequest, decode_subject
from shared.predictor import load_predictor


def parser() -> argparse.ArgumentParser:
    return service.parser("decode", instance=True)


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    await serve_engine(
        "decode",
        config,
        args.instance_id,
        args.node,
        stop,
        decode_subject(args.instance_id),
        DecodeRequest,
        lambda instance, engine: Decoder(instance, engine, load_predictor(profile_path(config))).on_request,
    )
