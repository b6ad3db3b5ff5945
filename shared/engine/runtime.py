"""The one runtime of an engine instance, prefill or decode: build the engine,
connect to NATS, announce the instance with heartbeats, hand each request of the
role's subject to the role's handler, and shut down in order on `stop`: take
nothing new, let the requests running finish (within drain_timeout_s), hand the rest
on, then close.

A role is a handler class (services/prefill/handler.py, services/decode/handler.py)
that says which subject and message it serves; everything else is the same. An
instance may serve several on its one engine: a prefill instance also takes decode
orders, which the Conductor sends it only when no decode instance can serve (it then
prefills and decodes, as a colocated instance does)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import structlog
from nats.aio.msg import Msg

from shared import bus, metrics_page
from shared.config import ClusterConfig
from shared.engine.metrics import instance_registry
from shared.instance import EngineLoad, Instance
from shared.messages import Role
from shared.service import Main, freeze_heap

log = structlog.get_logger(__name__)


class Handler:
    """One role's request handler, built once the engine and the instance exist; a
    role names its subject and message and serves `on_request`."""

    ROLE: ClassVar[Role]
    REQUEST: ClassVar[type[bus.Message]]
    subject: ClassVar[Callable[[str], str]]  # the role's subject, by instance id

    def __init__(self, instance: Instance, engine: Any) -> None:
        self.instance = instance
        self.engine = engine

    async def on_request(self, request: Any, msg: Msg) -> None:
        raise NotImplementedError


def serving(*handlers: type[Handler]) -> Main:
    """The service main of an engine instance whose requests `handlers` serve (the
    first names its role)."""

    async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
        await serve(handlers, config, args, stop)

    return main


ENGINE_DEAD_EXIT = 3  # the service's exit status when its engine died under it


async def serve(handlers: Sequence[type[Handler]], config: ClusterConfig, args: argparse.Namespace,
                stop: asyncio.Event) -> None:
    """Run an engine instance until `stop`, or until its engine dies: then the
    instance stops beating at once (the Conductor sends it nothing more) and the
    service exits with ENGINE_DEAD_EXIT, for its supervisor to start it again."""
    from shared.engine.llm import build_engine  # vLLM is heavy; only engine services pay for it

    instance_id, node, role = args.instance_id, args.node, handlers[0].ROLE
    stages = getattr(args, "stages", 1)  # only prefill's parser has --stages: a CPP group is a prefill instance
    # Colocated, nothing ever reaches a node pool: the engine is plain vLLM, without
    # the connector's hooks in every step and layer.
    engine, load = build_engine(config, None if config.mode == "colocated" else node, stages, role) \
        if not config.fake_engine_step_ms else fake_engine(config)
    reconnected = bus.Reconnected()
    nc = await bus.connect(config.nats_url, instance_id, args.nats_credentials, on_event=reconnected)
    instance = Instance(role, instance_id, node, config, nc, load, stages, reconnected)
    for handler in handlers:
        await bus.subscribe(nc, handler.subject(instance_id), handler.REQUEST, handler(instance, engine).on_request)
    # vLLM and torch leave hundreds of thousands of objects: frozen before the heartbeats
    # start, a full collection never pauses the engine's outputs to walk them.
    freeze_heap()
    await instance.start()
    page = await metrics_page.serve_for(args, instance_registry(instance), role)
    log.info(f"{role} ready", model=config.model, node=node, serves=[h.ROLE for h in handlers])
    died = await engine_died_before(stop, engine, config.heartbeat_interval_s)
    log.info(f"{role} stopping", in_flight=len(instance.requests), engine_died=died)
    if not died:  # a dead engine finishes nothing: its requests go elsewhere at once
        left = await instance.drain(config.drain_timeout_s)
        log.info(f"{role} drained", handed_on=left)
    await instance.close()
    await bus.close(nc)
    if page is not None:
        await page.cleanup()
    engine.shutdown()
    if died:
        raise SystemExit(ENGINE_DEAD_EXIT)


def fake_engine(config: ClusterConfig) -> tuple[Any, EngineLoad]:
    from shared.engine.fake import FakeEngine
    from shared.engine.llm import sampling_params
    from shared.messages import Sampling

    sampling_params(Sampling(max_tokens=1), 1)  # vLLM's imports, now rather than on the first request's turn
    return FakeEngine(config.fake_engine_step_ms / 1e3), EngineLoad()


async def engine_died_before(stop: asyncio.Event, engine: Any, interval_s: float) -> bool:
    """Wait for `stop`; True as soon as the engine is found dead instead. A service's
    loop outlives its engine-core process, so heartbeats alone would keep announcing
    an instance that can only fail what it is sent."""
    while not stop.is_set():
        if engine.errored:
            log.error("engine died: this instance stops taking requests", error=repr(engine.dead_error))
            return True
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    return False
