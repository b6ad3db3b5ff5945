"""/openapi.json: what the API accepts, generated from the same field tables the
requests are checked against (services/gateway/protocol.py), so the two cannot
drift apart."""

from __future__ import annotations

from typing import Any

from services.gateway import anthropic, responses
from services.gateway.fields import INT32_MAX, MAX_MESSAGES, Spec
from services.gateway.protocol import CHAT, COMPLETION, DETOKENIZE, ROLES, TOKENIZE

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, {"type": "null"}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
    },
}
TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}}
PROMPT = {"oneOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"oneOf": [{"type": "string"}, TOKEN_IDS]}}]}


def _request(table: dict[str, Spec], own: dict[str, Any], required: list[str]) -> dict[str, Any]:
    properties = {**own, **{name: spec.schema for name, spec in table.items()}}
    return {"type": "object", "required": required, "additionalProperties": False, "properties": properties,
            "description": "null stands for a missing field; a field not listed here is a 400"}


def _post(summary: str, schema: str, answer: str = "the completion (JSON, or an SSE stream with stream=true)"
          ) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": answer},
                      "400": {"description": "invalid request", **error}, "401": {"description": "missing or wrong API key", **error},
                      "404": {"description": "unknown model", **error}, "429": {"description": "overloaded", **error},
                      "503": {"description": "cluster unavailable", **error}},
    }}  # fmt: skip


def _messages(required: list[str]) -> dict[str, Any]:
    fields = {k: v for k, v in anthropic.FIELDS.items() if "max_tokens" in required or k in COUNT_FIELDS}
    return {"type": "object", "required": required, "properties": fields,
            "description": "a field not listed here is ignored, as vLLM's server ignores it"}


COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "output_config", "thinking")


def document() -> dict[str, Any]:
    chat_own = {"messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": MESSAGE}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Yuebing", "version": "1", "description": "OpenAI-compatible API of a Yuebing cluster"},
        "paths": {
            "/v1/chat/completions": _post("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": _post("Completion", "CompletionRequest"),
            "/v1/messages": _post("Anthropic's Messages API, onto the same chat pipeline (errors in Anthropic's shape)",
                                  "MessagesRequest", "the message (JSON, or Anthropic's SSE events with stream=true)"),
            "/v1/messages/count_tokens": _post("Anthropic's count_tokens: the prompt's tokens as chat renders it",
                                               "CountTokensRequest", "input_tokens"),
            "/v1/responses": _post("OpenAI's Responses API, onto the same chat pipeline", "ResponsesRequest",
                                   "the response (JSON, or the Responses SSE events with stream=true)"),
            "/v1/responses/{response_id}": {"get": {"summary": "A stored response of the caller's (else 404)"}},
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "As vLLM's: a 400 for a synchronous response (no background ones run here)"}},
            "/v1/models": {"get": {"summary": "The served model"}},
            "/tokenize": _post("Token ids of a prompt, or of messages as the chat template renders them",
                               "TokenizeRequest", "count, max_model_len, tokens (and token_strs)"),
            "/detokenize": _post("Text of token ids", "DetokenizeRequest", "prompt: the text"),
            "/health": {"get": {"summary": "200 when prefill and decode instances are alive, else 503"}},
            "/ping": {m: {"summary": "/health, as vLLM's server has it"} for m in ("get", "post")},
            "/version": {"get": {"summary": "version: the engines' vLLM; yuebing: this server's"}},
            "/metrics": {"get": {"summary": "Prometheus metrics"}},
        },
        "components": {"schemas": {
            "ChatCompletionRequest": _request(CHAT, chat_own, ["model", "messages"]),
            "CompletionRequest": _request(COMPLETION, {"prompt": PROMPT}, ["model", "prompt"]),
            "TokenizeRequest": _request(TOKENIZE, {"prompt": {"type": "string"}, **chat_own}, []),
            "DetokenizeRequest": _request(DETOKENIZE, {"tokens": {**TOKEN_IDS, "minItems": 0}}, ["tokens"]),
            "MessagesRequest": _messages(["model", "messages", "max_tokens"]),
            "CountTokensRequest": _messages(["model", "messages"]),
            "ResponsesRequest": {"type": "object", "required": ["model", "input"], "properties": responses.FIELDS,
                                 "description": "a field not listed here is ignored, as vLLM's server ignores it"},
            "Error": ERROR,
        }, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                          "description": "required on /v1/* when the server has an API key"},
                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                              "description": "the same key, as Anthropic's SDK sends it"}}},
    }
