"""Tool calling through vLLM's own parsers, as `vllm serve --enable-auto-tool-choice
--tool-call-parser NAME` does it: the cluster's `tool_call_parser` setting names the
parser. For a request with tools, vLLM's request model checks the tool fields (with
its words), the parser sets the grammar a forced call decodes under (a structural
tag or a JSON schema, which both engines then enforce) and whether special tokens
stay in the text, and then parses each choice's text into tool calls: whole at the
end, or delta by delta in a stream. The rules around the parser (which message
fields, which finish reason, parallel_tool_calls) are those of vLLM's chat server
(vllm/entrypoints/openai/chat_completion/serving.py), followed line by line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.errors import invalid
from services.gateway.structured import ResponseFormat
from services.gateway.tools import ToolRequest

VALUE_ERROR = "Value error, "  # pydantic's prefix to a validator's message


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, as vLLM sees them once its parser has adjusted the request."""

    request: Any  # vllm's ChatCompletionRequest: the parser reads tools and tool_choice off it
    template_tools: list[dict[str, Any]]  # what the chat template gets as `tools`
    parser_cls: Any  # vllm's Parser class, or None: the tools only reach the template
    tokenizer: Any
    response_format: ResponseFormat  # the output's format: the client's, or the parser's JSON schema
    structural_tag: str = ""  # or the grammar a forced call decodes under (vLLM's structural tag)
    skip_special_tokens: bool = True

    def choice(self, prompt: Sequence[int]) -> ChoiceTools | None:
        """One choice's parser (parsers keep state as a stream goes: one per choice)."""
        if self.parser_cls is None:
            return None
        return ChoiceTools(self, self.parser_cls(self.tokenizer, self.request.tools, model_config=None,
                                                 chat_template_kwargs={}), list(prompt))


def load() -> None:
    """Imports what tool calling uses of vLLM (seconds, the first time): the gateway
    does it at start, off the event loop, so that no request pays for it there."""
    import vllm.entrypoints.openai.chat_completion.protocol
    import vllm.parser
    import vllm.renderers.chat_utils  # noqa: F401


class ToolParsing:
    """The cluster's tool parser (vLLM's, by `tool_call_parser`), or none."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name, self.tokenizer, self.parser_cls = name, tokenizer, None
        if not name:
            return
        from vllm.parser import ParserManager

        try:  # both checks vllm serve makes at start: the name, and the tokenizer's fit
            self.parser_cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True)
            if self.parser_cls is not None:
                ParserManager.validate_parser_tokenizer(self.parser_cls, tokenizer, tool_parser_name=name)
        except (KeyError, TypeError) as e:
            raise ValueError(f"tool_call_parser {name!r}: {e}") from e

    def use(self, asked: ToolRequest, skip_special_tokens: bool, response_format: ResponseFormat) -> ToolUse | None:
        """What the request's tools mean here (None: none in play), or a 400."""
        if not asked.asked:
            return None
        request = _vllm_request(asked, skip_special_tokens, response_format)
        self._check_parser(request.tool_choice)
        if self.parser_cls is not None and request.tool_choice != "none":
            parser = self.parser_cls(self.tokenizer, request.tools, model_config=None, chat_template_kwargs={})
            try:
                request = parser.adjust_request(request)
            except ValueError as e:  # the grammar's own refusal (xgrammar: two tools of one name, forced): vLLM's 400
                raise invalid(str(e)[:300], "tool_choice") from e
        grammar = request.structured_outputs
        if grammar is None:  # the parser set none: the client's format holds
            return ToolUse(request, _dumped(request.tools), self.parser_cls, self.tokenizer, response_format,
                           skip_special_tokens=request.skip_special_tokens)
        _check_grammar(grammar)
        schema = ResponseFormat("json_schema", _schema_text(grammar.json)) if grammar.json is not None else ResponseFormat()
        return ToolUse(request, _dumped(request.tools), self.parser_cls, self.tokenizer, schema,
                       grammar.structural_tag or "", request.skip_special_tokens)

    def _check_parser(self, choice: Any) -> None:
        """vLLM's server's rule, in its words (its flags are this cluster's setting)."""
        if self.parser_cls is not None or choice in (None, "none"):
            return
        if choice == "auto":
            raise invalid('"auto" tool choice requires the tool_call_parser setting (vllm serve: '
                          "--enable-auto-tool-choice and --tool-call-parser)", "tool_choice")
        desc = f'function "{choice.function.name}"' if hasattr(choice, "function") else f'"{choice}"'
        raise invalid(f"tool_choice={desc} requires the tool_call_parser setting (vllm serve: --tool-call-parser)",
                      "tool_choice")


def _vllm_request(asked: ToolRequest, skip_special_tokens: bool, response_format: ResponseFormat) -> Any:
    """vLLM's request model over the tool fields: its validators are the rules."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    body: dict[str, Any] = {"model": "-", "messages": [], "tools": list(asked.tools) or None,
                            "parallel_tool_calls": asked.parallel, "skip_special_tokens": skip_special_tokens}
    if asked.choice is not None:
        body["tool_choice"] = asked.choice
    if response_format.type != "text":
        body["response_format"] = _response_format(response_format)
    try:
        return ChatCompletionRequest.model_validate(body)
    except VLLMValidationError as e:
        raise invalid(e.args[0][:500], e.parameter or "tools") from None
    except ValidationError as e:
        first = e.errors()[0]
        message = str(first.get("msg", "invalid tool fields")).removeprefix(VALUE_ERROR)
        param = ".".join(str(p) for p in first.get("loc", ())) or "tools"
        raise invalid(message[:500], param if param.startswith(("tool", "parallel")) else "tools") from None


def template_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as the chat template gets them, for a request that renders them without
    a call (/tokenize): through vLLM's request model, as with a call."""
    if not tools:
        return []
    return _dumped(_vllm_request(ToolRequest(tuple(tools), "none"), True, ResponseFormat()).tools)


def _dumped(tools: Any) -> list[dict[str, Any]]:
    """vLLM's tool models as the chat template gets them (every field, defaults filled in)."""
    return [t.model_dump() for t in tools or ()]


def _check_grammar(grammar: Any) -> None:
    """The grammar checked as the engines will check it (a tool's bad schema is a 400
    here, not a failed prefill)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=grammar))
    except (VLLMValidationError, ValueError) as e:
        cause = f": {str(e.__cause__).strip()}" if e.__cause__ else ""
        raise invalid(f"the tools' parameters are not a schema this server can enforce ({e.args[0]}{cause})"[:500],
                      "tools") from None


def _response_format(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": orjson.loads(rf.json_schema)}}


def _schema_text(schema: Any) -> str:
    return schema if isinstance(schema, str) else orjson.dumps(schema).decode()


class ChoiceTools:
    """One choice's text, parsed into content and tool calls by vLLM's parser."""

    def __init__(self, use: ToolUse, parser: Any, prompt: list[int]) -> None:
        self.parser, self.prompt = parser, prompt
        self.request = use.request
        self.streamed = False  # a stream has sent a tool call delta

    @property
    def named(self) -> bool:
        return hasattr(self.request.tool_choice, "function")

    def message(self, text: str, token_ids: Sequence[int], finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole response's message and finish reason (serving.py's full generator)."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage
        from vllm.renderers.chat_utils import make_tool_call_id

        _reasoning, content, calls = self.parser.parse(text, self.request, enable_auto_tools=True,
                                                       model_output_token_ids=list(token_ids))
        calls = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls or ()]
        required = self.request.tool_choice == "required"
        if self.named or required:
            message = ChatMessage(role="assistant", content=content or "", tool_calls=calls)
        elif self.request.tool_choice == "auto" and calls:
            message = ChatMessage(role="assistant", content=content, tool_calls=calls)
        else:
            message = ChatMessage(role="assistant", content=content)
        if self.request.parallel_tool_calls is False:  # vLLM's maybe_filter_parallel_tool_calls
            message.tool_calls = message.tool_calls[:1]
        called = (self.request.tool_choice == "auto" and bool(calls)) or (required and finish == "stop")
        return message.model_dump(mode="json", exclude={"refusal", "annotations", "audio", "function_call",
                                                        "reasoning"}), "tool_calls" if called else finish

    def delta(self, text: str, token_ids: Sequence[int], finish: str | None) -> dict[str, Any] | None:
        """A stream's delta for this text (None: nothing to send for it), as
        serving.py's stream generator makes it."""
        message = self.parser.parse_delta(text, list(token_ids), self.request, self.prompt, finished=finish is not None)
        if message is None:
            return None
        if message.tool_calls:
            self.streamed = True
            if self.request.parallel_tool_calls is False:
                message.tool_calls = [c for c in message.tool_calls if c.index == 0]
        return message.model_dump(mode="json", exclude_unset=True)

    def finish_reason(self, finish: str | None) -> str | None:
        """A stream's last finish reason: "tool_calls" once a call has streamed
        (auto or required; a named call ends with "stop", as in OpenAI's API)."""
        return "tool_calls" if self.streamed and not self.named and finish == "stop" else finish
