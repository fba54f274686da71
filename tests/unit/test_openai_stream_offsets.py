"""A streamed completion's logprobs give each token the text_offset the whole response gives
it, also where text was held back (a possible stop string): offsets count the tokens' texts,
not the characters sent so far."""

from __future__ import annotations

import json
from typing import Any, cast

from aiohttp.test_utils import TestClient, TestServer

from coordinator.metrics import GenerationStats
from coordinator.openai_api import OpenAIApi
from coordinator.requests import Chunk
from specdec.tools.testing import byte_level_tokenizer
from specdec.v1 import common_pb2


class HeldBackEngine:
    """Tokens a, X, Z where a stop string "XY" held X back: "a" first, then "XZ"."""

    def __init__(self) -> None:
        self.tokenizer = byte_level_tokenizer()

    async def off_loop(self, function, *args):
        return function(*args)

    async def generate(self, request):
        a, x, z = self.tokenizer.convert_tokens_to_ids(["a", "X", "Z"])
        entries = [common_pb2.TokenLogprobs(logprob=-0.5) for _ in range(3)]
        yield Chunk(token_ids=[a, x], text="a", logprobs=entries[:2])
        yield Chunk(token_ids=[z], text="XZ", finish_reason="length", stats=GenerationStats(), logprobs=entries[2:])


async def _logprobs(client: TestClient, stream: bool) -> tuple[str, list[str], list[int]]:
    body = {"model": "m", "prompt": "x", "logprobs": 0, "stream": stream}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200, await response.text()
    if not stream:
        choice = (await response.json())["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    text, tokens, offsets = "", [], []
    for event in (await response.read()).decode().split("\n\n"):
        if event and event != "data: [DONE]":
            choice = json.loads(event[len("data: ") :])["choices"][0]
            text += choice["text"]
            tokens += choice["logprobs"]["tokens"] if choice["logprobs"] else []
            offsets += choice["logprobs"]["text_offset"] if choice["logprobs"] else []
    return text, tokens, offsets


async def test_streamed_offsets_are_the_whole_responses_where_text_was_held_back():
    api = OpenAIApi(cast(Any, HeldBackEngine()), "m")
    async with TestClient(TestServer(api.app())) as client:
        whole = await _logprobs(client, stream=False)
        streamed = await _logprobs(client, stream=True)
    assert whole == ("aXZ", ["a", "X", "Z"], [0, 1, 2])
    assert streamed == whole  # before: Z at 1, counted from the one character sent
