"""A streaming HTTP client that goes away after its generation's last chunk, before `[DONE]`
(found by a soak: six clients at once, 8 of 600 requests): the generation is over and nothing
failed on the server, so it is no server error. It was logged as one with its traceback
(`HTTP POST /v1/completions failed`) and counted as a 500, while the same request counted OK
among the generations."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from aiohttp.test_utils import TestClient, TestServer

from coordinator import openai_api
from coordinator.metrics import GenerationStats
from coordinator.openai_api import OpenAIApi
from coordinator.requests import Chunk


class OneChunkEngine:
    """What the HTTP API reads of the coordinator, for one short generation."""

    tokenizer = None

    async def off_loop(self, function, *args):
        return function(*args)

    async def generate(self, request):
        yield Chunk(token_ids=[1], text="a")
        yield Chunk(token_ids=[2], text="b", finish_reason="length", stats=GenerationStats())


async def test_a_client_gone_before_done_is_no_server_error(monkeypatch, caplog):
    sent: list[str] = []
    plain = openai_api.send_event

    async def gone_at_done(response, payload):
        if payload == "[DONE]":
            raise ConnectionResetError("Cannot write to closing transport")  # as aiohttp raises it
        sent.append(str(payload))
        await plain(response, payload)

    monkeypatch.setattr(openai_api, "send_event", gone_at_done)
    api = OpenAIApi(cast(Any, OneChunkEngine()), "m")
    async with TestClient(TestServer(api.app())) as client:
        with caplog.at_level(logging.INFO, logger="coordinator.openai_api"):
            async with asyncio.timeout(10):  # before: the server never ended the response
                response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
                await response.read()
    assert response.status == 200 and len(sent) == 2  # both chunks went out
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
    assert "went away before the stream's end" in caplog.text
