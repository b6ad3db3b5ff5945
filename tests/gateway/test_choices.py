"""A request's choices at the edge: tokens in, text and JSON out, whole or streamed."""


from services.gateway.choices import Choice, completion_tokens
from services.gateway.text import TextStream, Tokenizer
from shared.messages import TokenChunk


def chunk(tokenizer: Tokenizer, text: str, index: int, finish: str | None = None) -> TokenChunk:
    return TokenChunk(request_id="r", seq=0, token_ids=tokenizer.encode(text, add_special_tokens=False), index=index,
                      finish_reason=finish)


def test_each_choice_keeps_its_own_text_and_ends_on_its_own(tokenizer):
    choices = [Choice(i, TextStream(tokenizer, stop=("!",))) for i in range(2)]
    assert choices[0].push(chunk(tokenizer, "hello", 0)) == "hello"
    assert choices[1].push(chunk(tokenizer, "bye!", 1)) == "bye" and choices[1].finish == "stop"
    assert choices[0].push(chunk(tokenizer, " there", 0, "length")) == " there" and choices[0].finish == "length"
    whole = [c.whole("completion", token_ids=False) for c in choices]
    assert [(w["index"], w["text"], w["finish_reason"]) for w in whole] == [(0, "hello there", "length"), (1, "bye", "stop")]
    assert completion_tokens(choices) == len(tokenizer.encode("hello there", add_special_tokens=False)) + len(
        tokenizer.encode("bye!", add_special_tokens=False))


def test_a_stream_part_carries_its_index_and_only_what_is_new(tokenizer):
    c = Choice(3, TextStream(tokenizer))
    text = c.push(chunk(tokenizer, "ab", 3))
    part = c.delta("chat", text, token_ids=True)
    assert part == {"index": 3, "finish_reason": None, "delta": {"content": "ab"},
                    "token_ids": tokenizer.encode("ab", add_special_tokens=False)}
    assert c.delta("chat", "", token_ids=False) is None  # nothing new: nothing to send
