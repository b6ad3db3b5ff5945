"""The Bearer key every HTTP page of the cluster may require (the gateway's API, each
service's /metrics): one check, and one refusal, OpenAI's error shape."""

from __future__ import annotations

import hmac

from aiohttp import web

# The refusal's fields, as OpenAI's API answers a bad key.
UNAUTHORIZED = {"message": "invalid or missing API key", "type": "authentication_error", "code": "invalid_api_key"}


def bearer_key(request: web.Request) -> bytes:
    """The key of an `Authorization: Bearer <key>` header (b"": none), its bytes as
    they came (see bearer_matches)."""
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    scheme, _, key = given.partition(b" ")
    return key if scheme == b"Bearer" else b""


def client_key(request: web.Request) -> bytes:
    """The key a client sent: OpenAI's `Authorization: Bearer`, else Anthropic's
    `x-api-key` header (its SDK's default), as bytes as they came."""
    return bearer_key(request) or request.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")


def bearer_matches(request: web.Request, key: str) -> bool:
    """The request's Authorization header is `Bearer <key>` (compared in constant time).
    A header's bytes as they came (aiohttp keeps undecodable ones as surrogates):
    encoding with surrogateescape never fails, so odd bytes are a 401, never a 500."""
    return hmac.compare_digest(bearer_key(request), key.encode())
