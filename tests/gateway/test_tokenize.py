"""/tokenize and /detokenize, as vLLM's server has them, behind the API key."""

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.access import Access
from services.gateway.app import Gateway
from shared.config import ClusterConfig

AUTH = {"Authorization": "Bearer sesame"}


@pytest.fixture
async def client(tokenizer):
    gateway = Gateway(ClusterConfig(model="/models/tiny", max_model_len=512), tokenizer=tokenizer, pipeline=None,
                      access=Access.single("sesame"))
    async with TestClient(TestServer(gateway.app())) as c:
        yield c


async def test_a_prompt_is_tokenized_with_its_special_tokens_and_token_strings(client, tokenizer):
    r = await client.post("/tokenize", json={"model": "tiny", "prompt": "héllo there", "return_token_strs": True},
                          headers=AUTH)
    assert r.status == 200
    body = await r.json()
    ids = tokenizer.encode("héllo there", add_special_tokens=True)
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                    "token_strs": tokenizer.hf.convert_ids_to_tokens(ids)}


async def test_messages_are_tokenized_as_chat_renders_them(client, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    r = await client.post("/tokenize", json={"messages": messages}, headers=AUTH)
    body = await r.json()
    assert body["tokens"] == tokenizer.encode(tokenizer.chat_text(messages), add_special_tokens=False)
    assert body["token_strs"] is None


async def test_messages_with_tools_are_tokenized_as_chat_renders_them(client, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = await client.post("/tokenize", json={"messages": messages, "tools": [tool]}, headers=AUTH)
    dumped = {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
    with_tools = tokenizer.chat_text(messages, tools=[dumped])  # as vLLM's model dumps it
    assert (await r.json())["tokens"] == tokenizer.encode(with_tools, add_special_tokens=False)


async def test_detokenize_gives_the_text_back_special_tokens_included(client, tokenizer):
    ids = tokenizer.encode("héllo", add_special_tokens=True)
    r = await client.post("/detokenize", json={"tokens": ids}, headers=AUTH)
    assert (await r.json()) == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])  # fmt: skip
async def test_bad_bodies_are_400s_naming_the_field(client, path, body, param):
    r = await client.post(path, json=body, headers=AUTH)
    assert r.status == 400 and (await r.json())["error"]["param"] == param


async def test_both_need_the_key_and_the_served_model(client):
    assert (await client.post("/tokenize", json={"prompt": "x"})).status == 401
    r = await client.post("/detokenize", json={"model": "other", "tokens": [1]}, headers=AUTH)
    assert r.status == 404
