"""Completions with a list of prompts, as vLLM's server serves them: each prompt a run
of its own through the one pipeline (placed on its own), all at once; their choices
in one response or one stream, numbered prompt after prompt (prompt k's choice j is
k * n + j), usage summed. One run failing fails the request and cancels the others."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from services.gateway import protocol, server
from services.gateway.choices import Choice, completion_tokens
from services.gateway.errors import ApiError
from services.gateway.pipeline import Report

if TYPE_CHECKING:
    from services.gateway.app import Batch, Gateway, Prepared

DONE = None  # a run's end, in the stream's queue


async def respond(gw: Gateway, request: web.Request, batch: Batch) -> web.StreamResponse:
    gw.metrics.in_flight.inc()
    try:
        return await (_stream(gw, request, batch) if batch.options.stream else _whole(gw, batch))
    finally:
        gw.metrics.in_flight.dec()


async def _whole(gw: Gateway, batch: Batch) -> web.Response:
    results = await _together([gw._whole(p) for p in batch.parts])
    bodies, reports = [body for body, _, _ in results], [report for _, report, _ in results]
    body = {**bodies[0], "choices": [c for b in bodies for c in b["choices"]],
            "usage": summed([b["usage"] for b in bodies]), "yuebing": [b["yuebing"] for b in bodies]}
    if "prompt_token_ids" in body:  # each choice's own prompt, in a batch
        del body["prompt_token_ids"]
        for b, p in zip(bodies, batch.parts, strict=True):
            for c in b["choices"]:
                c["prompt_token_ids"] = p.prompt
    return web.Response(body=orjson.dumps(body), content_type="application/json",
                        headers={**batch.parts[0].headers(), **_limits(reports)})


async def _together(runs: list[Awaitable[Any]]) -> list[Any]:
    """The runs' results; the first failure raised as itself, the other runs cancelled."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(run) for run in runs]  # type: ignore[arg-type]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = lambda key: sum(u[key] for u in usages)  # noqa: E731
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return protocol.usage(total("prompt_tokens"), total("completion_tokens"), cached)


def _limits(reports: list[Report]) -> dict[str, str]:
    from services.gateway.app import rate_limit_headers

    return rate_limit_headers(reports[-1].limits)  # the latest count the Conductors gave


class Runs:
    """The batch's runs feeding one queue: (prepared, choice, text), DONE at each
    run's end, or the exception that ended it."""

    def __init__(self, gw: Gateway, batch: Batch, choices: list[list[Choice]]) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.reports = [Report() for _ in batch.parts]
        self.choices = choices
        self.left = len(batch.parts)
        self.tasks = [asyncio.create_task(self._feed(gw, p, c, r))
                      for p, c, r in zip(batch.parts, choices, self.reports, strict=True)]

    async def _feed(self, gw: Gateway, p: Prepared, choices: list[Choice], report: Report) -> None:
        try:
            async for choice, text in gw._events(p, choices, report):
                self.queue.put_nowait((p, choice, text))
        except Exception as e:  # noqa: BLE001 - handed to the writer, which answers it
            self.queue.put_nowait(e)
            return
        self.queue.put_nowait(DONE)

    async def next(self) -> tuple[Prepared, Choice, str] | None:
        """The next delta of any run (None: every run has ended); a run's failure raised."""
        while self.left:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            if item is not DONE:
                return item
            self.left -= 1
        return None

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _stream(gw: Gateway, request: web.Request, batch: Batch) -> web.StreamResponse:
    runs = Runs(gw, batch, [await gw._choices(p) for p in batch.parts])
    try:
        first = await runs.next()  # before the headers: a refusal is still a real 429
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **batch.parts[0].headers(), **_limits(runs.reports)})
        try:
            await gw._bounded(response.prepare(request))
            await _stream_body(gw, request, response, batch, runs, first)
        except server.WriteTimeout as e:  # the client stopped reading: every run cancelled, the connection dropped
            await runs.close()
            server.abort(request)
            e.response = response
            raise
        return response
    finally:
        await runs.close()


async def _stream_body(gw: Gateway, request: web.Request, response: web.StreamResponse, batch: Batch, runs: Runs,
                       item: tuple[Prepared, Choice, str] | None) -> None:
    head = gw._chunk_head(batch.parts[0])
    usage = {p.request_id: gw._running_usage(p, c, r) for p, c, r in zip(batch.parts, runs.choices, runs.reports)}
    try:
        while item is not None:
            p, choice, text = item
            await gw._send_delta(request, response, p, head, choice, text, usage[p.request_id]())
            item = await runs.next()
    except ApiError as e:  # headers are gone: the error travels in the stream, and [DONE] never comes
        await gw._bounded(response.write(b"data: " + e.json() + b"\n\n"))
        await gw._bounded(response.write_eof())
        raise
    if batch.options.include_usage:
        await gw._bounded(response.write(b"data: " + orjson.dumps(_usage_chunk(gw, batch, runs)) + b"\n\n"))
    await gw._bounded(response.write(b"data: [DONE]\n\n"))
    await gw._bounded(response.write_eof())


def _usage_chunk(gw: Gateway, batch: Batch, runs: Runs) -> dict[str, Any]:
    from services.gateway.app import yuebing_field

    usages = [protocol.usage(len(p.prompt), completion_tokens(c), r.cached_tokens)
              for p, c, r in zip(batch.parts, runs.choices, runs.reports)]
    where = [yuebing_field(r, len(p.prompt), decoded=completion_tokens(c) > 1)
             for p, c, r in zip(batch.parts, runs.choices, runs.reports)]
    return {**gw._envelope(batch.parts[0], chunk=True), "choices": [], "usage": summed(usages), "yuebing": where}
