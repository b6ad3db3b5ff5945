import pytest

from services.gateway.protocol import ApiError, parse_body, parse_chat, parse_completion


def chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def error_of(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    return e.value


def test_valid_chat_parses_with_defaults():
    r = parse_chat(chat(max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert r.messages == ({"role": "user", "content": "hi"},)
    assert (r.options.max_tokens, r.options.temperature, r.options.stream, r.options.include_usage) == (5, 0.0, True, True)


def test_content_parts_and_max_completion_tokens():
    r = parse_chat(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                        max_completion_tokens=7))
    assert r.messages[0]["content"] == "a\nb" and r.options.max_tokens == 7  # joined as vLLM joins them


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
        (chat(model=None), "model"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=-3), "max_tokens"),
        (chat(max_tokens="ten"), "max_tokens"),
        (chat(n=17), "n"),
        (chat(temperature=3), "temperature"),
        (chat(stop=[""]), "stop"),
        (chat(logprobs=1), "logprobs"),
        (chat(top_logprobs=3), "top_logprobs"),  # without logprobs=true
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ],
)
def test_invalid_chat_names_the_parameter(body, param):
    assert error_of(parse_chat, body).param == param


def test_logprobs_ask_for_the_tokens_and_this_many_alternatives():
    assert parse_chat(chat()).options.logprobs is None
    assert parse_chat(chat(logprobs=True)).options.logprobs == 0
    assert parse_chat(chat(logprobs=True, top_logprobs=5)).options.logprobs == 5
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 3}).options.logprobs == 3
    assert parse_completion({"model": "m", "prompt": "x"}).options.logprobs is None


def test_malformed_json_and_non_objects():
    assert "JSON" in error_of(parse_body, b"{nope").message
    error_of(parse_body, b"[1, 2]")


def test_completion_prompts():
    assert parse_completion({"model": "m", "prompt": "hello"}).prompt == "hello"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == (1, 2, 3)
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"
    error_of(parse_completion, {"model": "m", "prompt": ""})
    batch = parse_completion({"model": "m", "prompt": ["a", "b", "c"], "n": 2, "temperature": 1})
    assert batch.prompts == ("a", "b", "c") and [r.prompts for r in batch.split()] == [("a",), ("b",), ("c",)]
    assert parse_completion({"model": "m", "prompt": [[5, 6], [7]]}).prompts == ((5, 6), (7,))
    assert "not both" in error_of(parse_completion, {"model": "m", "prompt": ["a", [5, 6]]}).message
    assert "prompt[1]" in error_of(parse_completion, {"model": "m", "prompt": ["a", ""]}).message
    assert "64" in error_of(parse_completion, {"model": "m", "prompt": ["a"] * 65}).message
    assert "choices" in error_of(parse_completion, {"model": "m", "prompt": ["a"] * 9, "n": 8, "temperature": 1}).message
    error_of(parse_completion, {"model": "m", "prompt": [1, -2]})
    for not_ids in ([1, True], [1, 2.0], [1, 2**31], [[]], [[1, "2"]]):  # a bool, a float, past int32, empty, a string
        assert "token ids" in error_of(parse_completion, {"model": "m", "prompt": not_ids}).message
    assert parse_completion({"model": "m", "prompt": "x", "echo": True}).options.echo
    error_of(parse_completion, {"model": "m", "prompt": "x", "prompt_logprobs": 2, "stream": True})
