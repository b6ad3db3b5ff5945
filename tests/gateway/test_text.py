"""Tokens back to text: incremental, UTF-8 safe, and never past a stop string."""

import pytest

from services.gateway.text import TextStream, Tokenizer
from yuebing.model import ModelSpec, default_model_dir, write_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = default_model_dir()
    if not (path / "config.json").exists():  # a tiny model is enough: only its tokenizer is used
        path = tmp_path_factory.mktemp("m") / "tiny"
        write_model(ModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=64), path)
    return Tokenizer(str(path))


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
