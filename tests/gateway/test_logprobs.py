"""Log probabilities at the edge: the engines' rows into OpenAI's chat and
completions shapes, with vLLM's token strings (a byte-level piece that completes a
character reads as vLLM's server reads it)."""

import pytest

from services.gateway.logprobs import Logprobs
from shared.messages import TokenLogprobs


def rows(token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """A row a token: the sampled one at rank 2 (so the top two hold another token
    first), made-up log probabilities."""
    out = []
    for i, t in enumerate(token_ids):
        other = (t + 1) % 256
        top_ids = [other, t, (t + 2) % 256][:top]
        out.append(TokenLogprobs(token_ids=[t, *top_ids], logprobs=[-1.0 - i, -0.5, -1.0 - i, -3.0][: top + 1], rank=2))
    return out


def test_chat_lists_each_token_with_vllms_top_order_and_bytes(tokenizer):
    ids = tokenizer.encode("héllo", add_special_tokens=False)
    lp = Logprobs(tokenizer.hf, top=2)
    lp.push(ids, rows(ids, 2))
    content = lp.chat()["content"]
    assert [c["logprob"] for c in content] == [-1.0 - i for i in range(len(ids))]
    assert "".join(c["token"] for c in content) == "héllo"  # "é"'s second byte carries the character
    first = content[0]
    assert first["bytes"] == list(first["token"].encode())
    # vLLM's order: the sampled token first, then the top ones (itself merged): two shown
    assert [t["logprob"] for t in first["top_logprobs"]] == [-1.0, -0.5]


def test_a_stream_gets_the_new_tokens_and_completions_offsets_run_on(tokenizer):
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    lp = Logprobs(tokenizer.hf, top=1)
    lp.push(ids[:2], rows(ids[:2], 1))
    first = lp.completion(0)
    lp.push(ids[2:], rows(ids[2:], 1))
    rest = lp.completion(2)
    tokens = first["tokens"] + rest["tokens"]
    assert "".join(tokens) == "ab cd"
    offsets = first["text_offset"] + rest["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert all(len(top) == 2 for top in first["top_logprobs"] + rest["top_logprobs"])  # the top 1, and the sampled


def test_rows_must_match_the_tokens(tokenizer):
    with pytest.raises(ValueError, match="2 tokens came with 1"):
        Logprobs(tokenizer.hf, top=0).push([1, 2], rows([1], 0))
