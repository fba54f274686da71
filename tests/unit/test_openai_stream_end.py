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
from specdec.errors import SpecDecError


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


class LongPrefillEngine(OneChunkEngine):
    """A generation whose first chunk waits for `go` (a long prompt's prefill), then, where
    `refuse`, fails as a service refusing it would."""

    def __init__(self, refuse: bool = False):
        self.go = asyncio.Event()
        self.refuse = refuse
        self.closed = False

    async def generate(self, request):
        try:
            await self.go.wait()
            if self.refuse:
                raise SpecDecError("the target's KV budget is full")
            yield Chunk(token_ids=[1], text="a")
            yield Chunk(token_ids=[2], text="b", finish_reason="length", stats=GenerationStats())
        finally:
            self.closed = True


async def test_a_long_prefill_gets_its_headers_and_keep_alives_before_the_first_chunk(monkeypatch):
    """The headers waited for the first chunk, so a prompt whose prefill outlasted a proxy's
    read timeout (nginx: 60 s; a 32k prompt on CPU takes minutes) was cut before any keep-alive
    could be sent. Past KEEPALIVE_S they go out, then keep-alives; the chunks follow."""
    monkeypatch.setattr(openai_events, "KEEPALIVE_S", 0.05)
    engine = LongPrefillEngine()
    api = OpenAIApi(cast(Any, engine), "m")
    async with TestClient(TestServer(api.app())) as client:
        async with asyncio.timeout(10):  # before: no headers until `go`, which comes after them
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            assert response.status == 200
            assert await response.content.readuntil(b"\n\n") == b": keep-alive\n\n"
            engine.go.set()
            events = [event for event in (await response.read()).decode().split("\n\n") if event]
    data = [event[len("data: ") :] for event in events if event.startswith("data: ")]
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == ["a", "b"] and data[-1] == "[DONE]"


async def test_a_refusal_after_the_headers_is_an_error_event_and_one_before_a_status(monkeypatch):
    """A refusal within KEEPALIVE_S keeps its HTTP status; one after the headers went out
    ends the stream with its error event, and the generation is closed either way."""
    monkeypatch.setattr(openai_events, "KEEPALIVE_S", 0.05)
    for late in (False, True):
        engine = LongPrefillEngine(refuse=True)
        api = OpenAIApi(cast(Any, engine), "m")
        async with TestClient(TestServer(api.app())) as client:
            async with asyncio.timeout(10):
                if not late:
                    engine.go.set()
                response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
                if late:
                    engine.go.set()
                body = (await response.read()).decode()
        if late:
            events = [event for event in body.split("\n\n") if event.startswith("data: ")]
            assert response.status == 200 and events[-1] == "data: [DONE]"
            assert "KV budget" in json.loads(events[-2][len("data: ") :])["error"]["message"]
        else:
            assert response.status != 200 and "KV budget" in json.loads(body)["error"]["message"]
        assert engine.closed


class OneRoomEngine(OneChunkEngine):
    """A replica with room for one session: each generation holds it from its first chunk to
    its end, and the next waits for it (the pool's queue)."""

    def __init__(self):
        self.room = asyncio.Semaphore(1)

    async def generate(self, request):
        async with self.room:
            yield Chunk(token_ids=[1], text="a")
            yield Chunk(token_ids=[2], text="b", finish_reason="length", stats=GenerationStats())


async def test_a_streamed_request_of_two_choices_with_room_for_one_gets_both(monkeypatch):
    """A soak on the real pair (a target with --max-sessions 1): n = 2 without streaming came
    back in 0.8 s; streamed, the first choice held the only session while its stream waited for
    the second's first chunk, which waited for that session: nothing came until the queue gave
    up (429 as an error event at 25 s). Each choice now runs on while the headers wait."""
    monkeypatch.setattr(openai_events, "KEEPALIVE_S", 0.05)
    api = OpenAIApi(cast(Any, OneRoomEngine()), "m")
    async with TestClient(TestServer(api.app())) as client:
        async with asyncio.timeout(10):  # before: the second choice never started
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True, "n": 2})
            events = [event for event in (await response.read()).decode().split("\n\n") if event.startswith("data: {")]
    texts: dict[int, str] = {}
    for event in events:
        choice = json.loads(event[len("data: ") :])["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert response.status == 200 and texts == {0: "ab", 1: "ab"}
