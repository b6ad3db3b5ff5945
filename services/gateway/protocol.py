"""The OpenAI wire format: request bodies parsed into typed requests (with the
errors OpenAI clients expect), and response bodies built from results.

Which fields each endpoint takes, and how each is checked, is the tables below
(built from services/gateway/fields.py); /openapi.json is generated from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway import structured, tools
from services.gateway.errors import ApiError, invalid
from services.gateway.fields import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_TOKEN_IDS,
    MAX_USER_CHARS,
    MAX_WORD_CHARS,
    STOP,
    STREAM_OPTIONS,
    Spec,
    boolean,
    cache_salt,
    exactly,
    int_list,
    integer,
    is_int,
    number,
    refused,
    str_list,
    string,
)
from services.gateway.structured import ResponseFormat
from services.gateway.tools import ToolRequest

__all__ = ["ApiError", "invalid"]
GREEDY_TEMPERATURE = 1e-5  # below it vLLM samples greedily (its _SAMPLING_EPS)
MAX_BATCH_PROMPTS = 64  # prompts in one completions request (a cap of ours: vLLM has none), and choices of a batch


@dataclass(frozen=True)
class Options:
    """What a chat or completion request asks of generation, validated."""

    model: str
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    response_format: ResponseFormat = ResponseFormat()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    user: str | None = None
    logprobs: int | None = None  # each token's log probability and this many top alternatives' (None: not asked)
    n: int = 1  # choices, sampled from one prefill
    prompt_logprobs: int | None = None  # the prompt tokens' log probabilities, with this many alternatives
    echo: bool = False  # completions: the prompt leads the text (and the logprobs)
    cache_salt: str | None = None  # the client's own split of its tenant's cache (vLLM's field)
    priority: int = 0  # vLLM's: lower is served first, in the gateway's queue and the engines'

    def token_ids(self) -> dict[str, tuple[int, ...]]:
        """Every token id the request names, by field: checked against the vocabulary."""
        return {"logit_bias": tuple(t for t, _ in self.logit_bias), "stop_token_ids": self.stop_token_ids,
                "allowed_token_ids": self.allowed_token_ids or ()}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    options: Options
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: ToolRequest = ToolRequest()


Prompt = str | tuple[int, ...]  # text, or token ids


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]  # one, or a batch: each placed on its own, as vLLM runs each
    options: Options

    @property
    def prompt(self) -> Prompt:
        return self.prompts[0]

    def split(self) -> list[CompletionRequest]:
        """A batch as requests of one prompt each."""
        return [CompletionRequest((p,), self.options) for p in self.prompts]


COMMON: dict[str, Spec] = {
    "model": string(1024),
    "max_tokens": integer(1, INT64_MAX),
    "n": integer(1, MAX_CHOICES, 1),
    "temperature": number(0.0, 2.0, 1.0),
    "top_p": number(0.0, 1.0, 1.0, open_lo=True),
    "top_k": integer(-1, INT32_MAX, 0),
    "min_p": number(0.0, 1.0, 0.0),
    "seed": integer(INT64_MIN, INT64_MAX),
    "presence_penalty": number(-2.0, 2.0, 0.0),
    "frequency_penalty": number(-2.0, 2.0, 0.0),
    "repetition_penalty": number(0.0, float("inf"), 1.0, open_lo=True),
    "logit_bias": LOGIT_BIAS,
    "stop": STOP,
    "stop_token_ids": int_list(MAX_TOKEN_IDS),
    "ignore_eos": boolean(False),
    "min_tokens": integer(0, INT64_MAX, 0),
    "bad_words": str_list(MAX_BAD_WORDS, MAX_WORD_CHARS),
    "allowed_token_ids": int_list(MAX_TOKEN_IDS, min_items=1, default=None),
    "response_format": structured.SPEC,
    "include_stop_str_in_output": boolean(False),
    "skip_special_tokens": boolean(True),
    "stream": boolean(False),
    "stream_options": STREAM_OPTIONS,
    "return_token_ids": boolean(False),
    "user": string(MAX_USER_CHARS),
    # vLLM's, not implemented here: only their no-op values pass
    "use_beam_search": refused(False),
    "watermarking": refused(False),
    "length_penalty": refused(1.0, 1, note=" (it only affects beam search)"),
    "spaces_between_special_tokens": refused(True),
    "truncate_prompt_tokens": refused(),
    "truncation_side": refused(),
    "prompt_logprobs": integer(0, MAX_LOGPROBS),
    "logprob_token_ids": refused(),
    "structured_outputs": refused(note="; use response_format"),
    "priority": integer(INT64_MIN, INT64_MAX, 0),
    "request_id": refused(note="; send the x-request-id header"),
    "session_id": refused(),
    "return_tokens_as_token_ids": refused(False),
    "routed_experts_prompt_start": refused(0),
    "return_token_offsets": refused(False),
    "mm_payload": refused("tensors"),
    "return_mm_kwargs": refused(False),
    "cache_salt": cache_salt(),
    "kv_transfer_params": refused(),
    "ec_transfer_params": refused(),
    "vllm_xargs": refused(),
    "repetition_detection": refused(),
    "stream_interval": refused(),
    "thinking_token_budget": refused(),
}
CHAT: dict[str, Spec] = {
    **COMMON,
    "max_completion_tokens": integer(1, INT64_MAX),
    "add_generation_prompt": boolean(True),
    "continue_final_message": boolean(False),
    "add_special_tokens": boolean(False),
    "include_reasoning": boolean(True),  # this server runs no reasoning parser: nothing to include
    "echo": refused(False),
    "logprobs": boolean(False),
    "top_logprobs": integer(0, MAX_LOGPROBS),
    "tools": tools.TOOLS,
    "tool_choice": tools.TOOL_CHOICE,
    "parallel_tool_calls": tools.PARALLEL_TOOL_CALLS,
    "reasoning_effort": refused(),
    "documents": refused(),
    "chat_template": refused(),
    "chat_template_kwargs": refused(),
    "media_io_kwargs": refused(),
    "mm_processor_kwargs": refused(),
    "return_prompt_text": refused(False),
}
COMPLETION: dict[str, Spec] = {
    **COMMON,
    "max_tokens": integer(1, INT64_MAX, 16),  # vLLM's (and OpenAI's) completions default
    "add_special_tokens": boolean(True),
    "echo": boolean(False),
    "logprobs": integer(0, MAX_LOGPROBS),
    "suffix": refused(),
    "prompt_embeds": refused(),
    "best_of": exactly(1, "only best_of=1 is supported"),
}
TOKENIZE: dict[str, Spec] = {  # /tokenize with a prompt, or with messages as chat renders them
    "model": string(1024),
    "add_special_tokens": boolean(True),  # a prompt's default; messages' is false, as in chat
    "return_token_strs": boolean(False),
    "add_generation_prompt": boolean(True),
    "continue_final_message": boolean(False),
    "tools": tools.TOOLS,  # rendered into the prompt, as chat renders them
}
DETOKENIZE: dict[str, Spec] = {"model": string(1024)}
REQUIRED = {"chat": ("model", "messages"), "completion": ("model", "prompt")}


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None  # or messages
    messages: tuple[dict[str, str], ...]
    add_special_tokens: bool
    return_token_strs: bool
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[dict[str, Any], ...] = ()


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """vLLM's /tokenize: `prompt` (a string) or `messages`, not both."""
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise invalid("/tokenize takes either 'prompt' or 'messages'", "prompt")
    v = _fields(body, TOKENIZE, ("prompt", "messages"))
    if body.get("prompt") is not None:
        if not isinstance(body["prompt"], str):
            raise invalid("'prompt' must be a string", "prompt")
        return TokenizeRequest(v["model"], body["prompt"], (), v["add_special_tokens"], v["return_token_strs"])
    messages = body["messages"]
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise invalid(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    special = v["add_special_tokens"] if body.get("add_special_tokens") is not None else False
    return TokenizeRequest(v["model"], None, tuple(_message(m, i) for i, m in enumerate(messages)), special,
                           v["return_token_strs"], v["add_generation_prompt"], v["continue_final_message"],
                           v["tools"] or ())


def parse_detokenize(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...]]:
    """vLLM's /detokenize: (model, token ids)."""
    v = _fields(body, DETOKENIZE, ("tokens",))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or (tokens and not token_ids(tokens)):
        raise invalid("'tokens' must be a list of token ids", "tokens")
    return v["model"], tuple(tokens)


def peek_priority(raw: bytes) -> int:
    """A body's `priority`, read before it is parsed in earnest (it orders the queue for
    a serving slot); 0 where it has none or a bad one (the full parse answers that)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return 0
    value = body.get("priority") if isinstance(body, dict) else None
    return value if is_int(value) and INT64_MIN <= value <= INT64_MAX else 0


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"request body is not valid UTF-8 JSON: {e}") from e
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def _fields(body: dict[str, Any], table: dict[str, Spec], own: tuple[str, ...]) -> dict[str, Any]:
    """Every field of `table`, checked (null or missing: its default); a field in
    neither `table` nor `own` is refused unless null."""
    for name, value in body.items():
        if name not in table and name not in own and value is not None:
            raise invalid(f"unknown field '{name[:64]}'", name[:64])
    return {name: spec.default if body.get(name) is None else spec.parse(name, body[name]) for name, spec in table.items()}


def _logprobs(v: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives each token's log probability comes with (None: none):
    chat's `logprobs` switch with its `top_logprobs`, or the completions' number."""
    if not chat:
        return v["logprobs"]
    if v["top_logprobs"] and not v["logprobs"]:  # vLLM's rule, and its words
        raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    return (v["top_logprobs"] or 0) if v["logprobs"] else None


def _options(body: dict[str, Any], v: dict[str, Any], max_tokens: int | None, chat: bool) -> Options:
    if not v["model"]:
        raise invalid("'model' is required", "model")
    if body.get("stream_options") and not v["stream"]:  # as vLLM: an empty object passes
        raise invalid("'stream_options' can only be set with stream=true", "stream_options")
    if v["prompt_logprobs"] and v["stream"]:  # vLLM's rule, and its words
        raise invalid("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if v["n"] > 1 and v["temperature"] < GREEDY_TEMPERATURE:  # vLLM's rule, and its words
        raise invalid(f"n must be 1 when using greedy sampling, got {v['n']}.", "n")
    if max_tokens is not None and v["min_tokens"] > max_tokens:
        raise invalid(f"'min_tokens' ({v['min_tokens']}) must be at most max_tokens ({max_tokens})", "min_tokens")
    return Options(
        model=v["model"], max_tokens=max_tokens, temperature=v["temperature"], top_p=v["top_p"],
        top_k=0 if v["top_k"] == -1 else v["top_k"], min_p=v["min_p"], seed=v["seed"], stop=v["stop"],
        stop_token_ids=v["stop_token_ids"], ignore_eos=v["ignore_eos"], min_tokens=v["min_tokens"],
        presence_penalty=v["presence_penalty"], frequency_penalty=v["frequency_penalty"],
        repetition_penalty=v["repetition_penalty"], logit_bias=v["logit_bias"], bad_words=v["bad_words"],
        allowed_token_ids=v["allowed_token_ids"], response_format=v["response_format"],
        include_stop_str_in_output=v["include_stop_str_in_output"], skip_special_tokens=v["skip_special_tokens"],
        add_special_tokens=v["add_special_tokens"], stream=v["stream"], include_usage=v["stream_options"][0],
        continuous_usage=v["stream_options"][1], return_token_ids=v["return_token_ids"], user=v["user"],
        logprobs=_logprobs(v, chat), n=v["n"], prompt_logprobs=v["prompt_logprobs"], echo=bool(v["echo"]),
        cache_salt=v["cache_salt"], priority=v["priority"],
    )  # fmt: skip


def _required(body: dict[str, Any], kind: str) -> None:
    for name in REQUIRED[kind]:
        if body.get(name) is None:
            raise invalid(f"'{name}' is required", name)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _required(body, "chat")
    messages = body["messages"]
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise invalid(f"'messages' must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    v = _fields(body, CHAT, ("messages",))
    if v["add_generation_prompt"] and v["continue_final_message"]:
        raise invalid("'continue_final_message' needs add_generation_prompt=false", "continue_final_message")
    max_tokens = v["max_completion_tokens"] if v["max_completion_tokens"] is not None else v["max_tokens"]
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    tool_request = ToolRequest(v["tools"] or (), v["tool_choice"], v["parallel_tool_calls"])
    return ChatRequest(parsed, _options(body, v, max_tokens, chat=True), v["add_generation_prompt"],
                       v["continue_final_message"], tool_request)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _required(body, "completion")
    v = _fields(body, COMPLETION, ("prompt",))
    options = _options(body, v, v["max_tokens"], chat=False)
    prompts = _prompts(body["prompt"])
    if len(prompts) > 1 and len(prompts) * options.n > MAX_BATCH_PROMPTS:
        raise invalid(f"a batch of {len(prompts)} prompts with n={options.n} asks for more than "
                      f"{MAX_BATCH_PROMPTS} choices", "prompt")
    return CompletionRequest(prompts, options)


def _prompts(prompt: Any) -> tuple[Prompt, ...]:
    """One prompt (text or token ids), or a batch of them (a list of either)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len({type(p) for p in prompt}) > 1:  # vLLM's types: a list of strings, or of token-id lists
            raise invalid("'prompt' must be a list of strings or a list of token-id lists, not both", "prompt")
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise invalid(f"a batch of at most {MAX_BATCH_PROMPTS} prompts", "prompt")
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_prompt(prompt, "prompt"),)


def _prompt(prompt: Any, param: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(f"'{param}' must not be empty", param)
        return prompt
    if isinstance(prompt, list) and token_ids(prompt):
        return tuple(prompt)
    raise invalid(f"'{param}' must be a non-empty string or a list of token ids", param)


def token_ids(items: list[Any]) -> bool:
    """Non-empty, every item a plain int (not a bool, not a float) in [0, INT32_MAX]:
    checked by C loops, not one Python test per item (a prompt is thousands of them,
    and a client flooding sends one every few milliseconds)."""
    return bool(items) and set(map(type, items)) == {int} and 0 <= min(items) and max(items) <= INT32_MAX


ROLES = ("system", "developer", "user", "assistant", "tool")
# What the chat template sees of a message besides its role and content, as vLLM's
# server passes it: these strings as they are, an assistant's reasoning under both
# of vLLM's names, and its earlier tool calls (services/gateway/tools.py).
MESSAGE_STRINGS = {"name": ("name",), "tool_call_id": ("tool_call_id",), "reasoning": ("reasoning", "reasoning_content"),
                   "reasoning_content": ("reasoning", "reasoning_content")}
MESSAGE_ROLES = {"tool_call_id": ("tool",), "reasoning": ("assistant",), "reasoning_content": ("assistant",),
                 "tool_calls": ("assistant",)}  # the only roles vLLM passes these for
MESSAGE_NOOPS = {"function_call": (), "refusal": ()}


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"{param} must be an object", param)
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"{param}.role must be one of {', '.join(ROLES)}", f"{param}.role")
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), role, param)}
    for key, value in m.items():
        if key in ("role", "content") or value is None:
            continue
        if role not in MESSAGE_ROLES.get(key, ROLES):
            raise invalid(f"{param}.{key} is only taken on {' and '.join(MESSAGE_ROLES[key])} messages", f"{param}.{key}")
        if key in MESSAGE_STRINGS and isinstance(value, str):
            out.update(dict.fromkeys(MESSAGE_STRINGS[key], value))
        elif key == "tool_calls":
            if calls := tools.tool_calls(value, f"{param}.tool_calls"):  # vLLM drops an empty list
                out["tool_calls"] = calls
        elif not (key in MESSAGE_NOOPS and value in MESSAGE_NOOPS[key]):
            raise invalid(f"{param}.{key[:64]} is not supported by this server", f"{param}.{key[:64]}")
    return out


def _content(content: Any, role: str, param: str) -> str:
    if isinstance(content, list):  # content parts: only text is meaningful to this model
        parts = []
        for part in content:
            if not isinstance(part, dict) or set(part) != {"type", "text"} or part["type"] != "text" or not isinstance(part["text"], str):
                raise invalid(f"{param}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                              f"{param}.content")
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins them for a template that takes string content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, str):
        raise invalid(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    return content


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
