"""A streaming HTTP client that goes away after its generation's last chunk, before `[DONE]`
(found by a soak: six clients at once, 8 of 600 requests): the generation is over and nothing
failed on the server, so it is no server error. It was logged as one with its traceback
(`HTTP POST /v1/completions failed`) and counted as a 500, while the same request counted OK
among the generations."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

from aiohttp.test_utils import TestClient, TestServer

from coordinator import openai_events
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
    plain = openai_events.send_event

    async def gone_at_done(response, payload):
        if payload == "[DONE]":
            raise ConnectionResetError("Cannot write to closing transport")  # as aiohttp raises it
        await plain(response, payload)

    monkeypatch.setattr(openai_events, "send_event", gone_at_done)
    api = OpenAIApi(cast(Any, OneChunkEngine()), "m")
    async with TestClient(TestServer(api.app())) as client:
        with caplog.at_level(logging.INFO, logger="coordinator.openai_api"):
            async with asyncio.timeout(10):  # before: the server never ended the response
                response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
                events = (await response.read()).decode().split("\n\n")
    texts = [json.loads(event[len("data: ") :])["choices"][0]["text"] for event in events if event]
    assert response.status == 200 and texts == ["a", "b"]  # both chunks went out, then no [DONE]
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text
    assert "went away before the stream's end" in caplog.text


class FailingEngine(OneChunkEngine):
    async def generate(self, request):
        yield Chunk(token_ids=[1], text="a")
        raise RuntimeError("a bug")


async def test_a_server_error_mid_stream_is_logged_and_sent_as_an_event(caplog):
    """The headers are out, so the error travels as the stream's last event before [DONE];
    the server's own error is logged with its traceback, as the middleware logs one."""
    api = OpenAIApi(cast(Any, FailingEngine()), "m")
    async with TestClient(TestServer(api.app())) as client:
        with caplog.at_level(logging.INFO, logger="coordinator.openai_api"):
            async with asyncio.timeout(10):
                response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
                events = [event for event in (await response.read()).decode().split("\n\n") if event]
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][len("data: ") :])
    failed = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(failed) == 1 and "failed mid-stream" in failed[0].getMessage() and failed[0].exc_info


class SlowEngine(OneChunkEngine):
    """A generation whose second chunk comes late (a failover, a re-prefill)."""

    async def generate(self, request):
        yield Chunk(token_ids=[1], text="a")
        await asyncio.sleep(0.3)
        yield Chunk(token_ids=[2], text="b", finish_reason="length", stats=GenerationStats())


async def test_a_stream_waiting_for_its_next_chunk_sends_comments_meanwhile(monkeypatch):
    """A soak froze the only target mid-stream: the stream sent nothing for 139 s, until the
    coordinator gave up; a proxy cutting connections idle for 60 s (nginx's default) would
    have cut it first. SSE comments, which clients skip, keep it from being idle that long."""
    monkeypatch.setattr(openai_events, "KEEPALIVE_S", 0.05)
    api = OpenAIApi(cast(Any, SlowEngine()), "m")
    async with TestClient(TestServer(api.app())) as client:
        async with asyncio.timeout(10):
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            events = [event for event in (await response.read()).decode().split("\n\n") if event]
    comments = [event for event in events if event.startswith(":")]
    data = [event[len("data: ") :] for event in events if event.startswith("data: ")]
    assert len(comments) >= 3 and set(comments) == {": keep-alive"}
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == ["a", "b"] and data[-1] == "[DONE]"
