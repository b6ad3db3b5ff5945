"""Tokens back to text: incremental, UTF-8 safe, never past a stop string, and equal
to what vLLM's own detokenizer makes of them."""

import random

from services.gateway.text import TextStream, Tokenizer


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_text_arrives_whole_even_when_a_character_spans_tokens(tokenizer):
    stream = TextStream(tokenizer)
    pieces = [stream.push([t]) for t in ids(tokenizer, "héllo 月饼!")]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == "héllo 月饼!"
    assert pieces[1] == ""  # the first byte of "é" alone is held back


def test_stop_string_ends_the_text_before_it_even_across_tokens(tokenizer):
    stream = TextStream(tokenizer, stop=("STOP",))
    out = ""
    for t in ids(tokenizer, "say it STOP and more"):
        out += stream.push([t])
        assert "S" not in out  # the start of a possible stop string is held back, never sent
        if stream.stopped:
            break
    assert stream.stopped and out + stream.flush() == "say it "
    assert stream.push(ids(tokenizer, "x")) == ""  # nothing after the stop


def test_without_a_stop_match_held_back_text_is_released_at_the_end(tokenizer):
    stream = TextStream(tokenizer, stop=("STOP",))
    out = "".join(stream.push([t]) for t in ids(tokenizer, "almost ST"))
    assert out == "almost " and not stream.stopped
    assert stream.flush() == "ST"


def test_bytes_that_never_become_a_character_are_dropped_at_the_end_as_vllm_drops_them(tokenizer):
    stray = tokenizer.hf.convert_tokens_to_ids(["Ł"])  # a lone UTF-8 continuation byte
    stream = TextStream(tokenizer)
    assert stream.push(stray * 5) == "" and stream.flush() == ""


def test_stuck_bytes_then_a_character_come_out_replaced_then_the_character(tokenizer):
    stray = tokenizer.hf.convert_tokens_to_ids(["Ł"])
    stream = TextStream(tokenizer)
    assert stream.push(stray * 2) == ""
    assert stream.push(ids(tokenizer, "D")) == "\ufffd\ufffdD"


def vllm_text(model_dir: str, prompt: list[int], output: list[int], **params) -> str:
    """What vLLM's own detokenizer makes of `output` after `prompt`."""
    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = EngineCoreRequest("r", prompt, None, SamplingParams(max_tokens=len(output), **params), None, 0.0, None,
                                None, None)
    detokenizer = IncrementalDetokenizer.from_new_request(get_tokenizer(model_dir), request)
    for token_id in output:
        if detokenizer.update([token_id], False) is not None:
            break  # a stop string
    return detokenizer.get_next_output_text(True, False)


def test_text_equals_vllms_detokenizer_on_random_tokens(tokenizer):
    # Byte tokens that rarely make characters, the prompt's tail included, with and
    # without special tokens and stop strings.
    rnd = random.Random(7)
    vocab = len(tokenizer.hf)
    for case in range(300):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 6))]
        output = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 40))]
        skip = rnd.random() < 0.7
        stop = ("ab", "e") if case % 3 == 0 else ()
        stream = TextStream(tokenizer, stop=stop, skip_special_tokens=skip, prompt=prompt)
        text = "".join(stream.push([t]) for t in output) + stream.flush()
        expected = vllm_text(tokenizer.hf.name_or_path, prompt, output, skip_special_tokens=skip, stop=list(stop))
        assert text == expected, (prompt, output, skip, stop)


def test_a_stuck_tail_is_released_after_a_bound_so_decoding_stays_linear(tokenizer):
    from services.gateway.text import MAX_PENDING_TOKENS

    stray = tokenizer.hf.convert_tokens_to_ids(["Ł"])
    stream = TextStream(tokenizer)
    out = stream.push(stray * (MAX_PENDING_TOKENS + 1))
    assert out == "\ufffd" * (MAX_PENDING_TOKENS + 1)


def test_tools_and_earlier_calls_reach_the_chat_template(tokenizer):
    """The tiny model's template renders tools and calls in Hermes' format; a call's
    JSON arguments reach it as an object (vLLM's step), whatever their spacing."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tokenizer.chat_text(messages, tools=[tool])
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert call["function"]["arguments"] == '{"city":"Paris"}'  # the request's own messages are left as they were
    assert "<tools>" not in tokenizer.chat_text(messages[:1])
