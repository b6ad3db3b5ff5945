"""One streaming client for the OpenAI-compatible endpoints (the gateway's, or plain
vLLM's): every benchmark that measures a live server measures it through this.

API:
- `session(api_key=None, *, timeout_s=300.0, connections=100, headers=None)`: an
  `aiohttp.ClientSession` with JSON and bearer headers; use it as `async with`.
- `completion_body(model, prompt, max_tokens, **extra)`: a `/v1/completions` body
  (greedy, `ignore_eos`, `return_token_ids`); `extra` adds or overrides fields.
- `await stream(session, url, body, *, headers=None) -> Streamed`: posts `body` to
  `url` + `/v1/chat/completions` when it has `messages`, else `/v1/completions`,
  with `stream: true` and `stream_options.include_usage` set, and reads the SSE.
  It never raises for HTTP, connection or timeout errors: they come back in
  `Streamed.status` / `Streamed.error` (`Streamed.check()` raises them).
- `Streamed`: `sent_at` (monotonic, just before the request left), `token_times`
  (monotonic arrival of each generated token), `tokens`, `text`, `usage`,
  `yuebing` (the gateway's report: where the request ran, KV loaded),
  `cached_tokens`, `status` (0: no response), `error`, and `ok`, `rejected`,
  `ttft_s`, `check()`.

Tokens are counted by the chunks' `token_ids` where the server sends them (vLLM and
the gateway do with `return_token_ids`), else one per chunk with text: a chunk's
tokens all arrive at the chunk's time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Streamed:
    """What one streamed request saw; times are `time.monotonic()`."""

    sent_at: float
    status: int = 0  # HTTP status; 0 when no response came (connection error, timeout)
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # where the server sends them (`return_token_ids`)
    text: str = ""
    usage: dict[str, Any] | None = None
    yuebing: dict[str, Any] | None = None  # the gateway's extension; None from plain vLLM
    error: str = ""  # an HTTP error's body, an error event in the stream, or the exception

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def rejected(self) -> bool:
        """Turned away by admission control (429), as opposed to failed."""
        return self.status == 429

    @property
    def ttft_s(self) -> float | None:
        """From the send to the first token."""
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0

    def check(self) -> Streamed:
        """Itself, or a RuntimeError saying what went wrong."""
        if not self.ok:
            raise RuntimeError(f"HTTP {self.status}: {self.error}" if self.status else self.error)
        return self


def session(
    api_key: str | None = None, *, timeout_s: float = 300.0, connections: int = 100,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientSession:
    """A client session for `stream`. `connections` bounds the pool: set it to the
    caller's own concurrency limit, or requests queue unseen in aiohttp's pool."""
    merged = {"Content-Type": "application/json", **(headers or {})}
    if api_key:
        merged["Authorization"] = f"Bearer {api_key}"
    return aiohttp.ClientSession(
        headers=merged, timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=connections),
    )


def completion_body(model: str, prompt: list[int] | str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A streaming `/v1/completions` body that generates exactly `max_tokens`."""
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
) -> Streamed:
    """Send one streaming request to the server at `url` (no path) and read it out."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {**body.get("stream_options", {}), "include_usage": True}}
    result = Streamed(sent_at=time.monotonic())
    try:
        async with session.post(url.rstrip("/") + path, json=body, headers=headers) as response:
            result.status = response.status
            if response.status != 200:
                result.error = await response.text()
                return result
            async for line in response.content:
                if _take(result, line):
                    break
    except (aiohttp.ClientError, TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _take(result: Streamed, line: bytes) -> bool:
    """Fold one SSE line into `result`; True when the stream is over."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk:  # after the headers an error can only travel in the stream
        result.error = json.dumps(chunk["error"])
        return True
    now = time.monotonic()
    for choice in chunk.get("choices") or []:
        text, tokens, ids = _choice(choice)
        result.text += text
        result.token_times.extend([now] * tokens)
        result.token_ids.extend(ids)
    result.usage = chunk.get("usage") or result.usage
    result.yuebing = chunk.get("yuebing") or result.yuebing
    return False


def _choice(choice: dict[str, Any]) -> tuple[str, int, list[int]]:
    """A streamed choice's text (completions or chat), how many tokens it carries, and
    their ids when the server sends them."""
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    ids = choice.get("token_ids")
    return text, len(ids) if ids is not None else int(bool(text)), list(ids or [])
