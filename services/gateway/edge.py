"""The HTTP edge below the routes: reading a body (compressed or not), the API key
(from the environment or an owner-only file, never argv), and the server's own
low-level errors (aiohttp's parser refusing a bad request line or header) answered
as OpenAI-style JSON like every other error."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from services.gateway.errors import ApiError, invalid
from shared.bearer import UNAUTHORIZED
from shared.private_file import read_private

log = structlog.get_logger(__name__)
API_KEY_ENV = "YUEBING_API_KEY"
API_KEY_FILE_ENV = "YUEBING_API_KEY_FILE"


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, decompressed as its Content-Encoding says; a body that
    cannot be read (bad gzip, a broken chunked encoding) is the client's 400, one that
    takes longer than `timeout_s` to arrive a 408 (a slow body holds no connection)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except (HttpProcessingError, RequestPayloadError) as e:  # the latter wraps a bad gzip/deflate stream
        raise invalid(f"request body could not be read: {type(e).__name__}") from e
    except TimeoutError as e:
        raise ApiError(408, f"request body not received within {timeout_s:g} s", code="body_timeout") from e


def load_api_key(path: str | None) -> str | None:
    """The key clients must send: $YUEBING_API_KEY, else the first line of `path`
    (owner-only, like every secret file here); None: the API is open."""
    key = os.environ.get(API_KEY_ENV)
    if not key and path:
        key = read_private(path).decode("utf-8").strip()
        if not key:
            raise ValueError(f"API key file {path} is empty")
    return key or None


def unauthorized() -> ApiError:
    return ApiError(401, **UNAUTHORIZED)


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors (400 for a request it
    cannot parse, 500 for a handler that raised) with an OpenAI-style body."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if a response already began
        if status >= 500:
            error = ApiError(status, "internal server error", type="server_error")
        else:
            error = ApiError(status, f"malformed HTTP request ({type(exc).__name__ if exc else 'bad request'})")
        response = web.Response(status=status, body=error.json(), content_type="application/json")
        response.force_close()
        return response


class JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)
