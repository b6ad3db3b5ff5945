"""The one shape of every error the gateway answers: OpenAI's
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class ApiError(Exception):
    """An error answered to the client as an OpenAI-style body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        # A message or param may quote client text; a lone surrogate must not break the encoder.
        error = {k: _clean(v) for k, v in self.body()["error"].items()}
        return orjson.dumps({"error": error})


def _clean(v: str | None) -> str | None:
    return v.encode("utf-8", "replace").decode("utf-8") if isinstance(v, str) else v


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
