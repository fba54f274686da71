"""The server-sent events of the HTTP API's streams (coordinator.openai_api): each choice's
chunks as OpenAI's chunk objects, relayed from its generation, and the stream's end."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any, cast

from aiohttp import web

from coordinator.requests import Chunk
from specdec.errors import SpecDecError

logger = logging.getLogger("coordinator.openai_api")  # the API's log, as the handlers'
# A comment line this often while a stream waits for its next chunk (a failover, a re-prefill):
# proxies cut connections idle for a minute or so (nginx's proxy_read_timeout: 60 s).
KEEPALIVE_S = 15.0


async def next_chunk(
    response: web.StreamResponse, queue: asyncio.Queue[tuple[int, Chunk | None]]
) -> tuple[int, Chunk | None]:
    """The queue's next item; while none comes, an SSE comment (`: keep-alive`) every
    KEEPALIVE_S, which clients skip, so that the stream is never idle that long."""
    getting = asyncio.ensure_future(queue.get())
    try:
        while not (await asyncio.wait({getting}, timeout=KEEPALIVE_S))[0]:
            await response.write(b": keep-alive\n\n")
        return getting.result()
    finally:
        getting.cancel()  # a no-op once done: only a stream that ended meanwhile leaves it waiting


async def end_stream(response: web.StreamResponse, error: dict | None) -> None:
    """A stream's last events: its error's, if it failed (logged already where it was the
    server's), then `[DONE]`. A client that goes away now has had every chunk it would get,
    and its generation is over: its leaving is no server error, and is not logged or counted
    as one."""
    try:
        if error is not None:
            await send_event(response, error)
        await send_event(response, "[DONE]")
        await response.write_eof()
    except ConnectionError:
        logger.info("HTTP client went away before the stream's end")


async def send_event(response: web.StreamResponse, payload: dict | str) -> None:
    """One server-sent event: a payload as JSON, or a string (`[DONE]`) as it is."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    await response.write(f"data: {data}\n\n".encode())


def stream_event(
    envelope: dict,
    chat: bool,
    index: int,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
    logprobs: dict | None = None,
) -> dict:
    """One choice's streamed chunk: chat's `delta` (the role in a choice's first), or a
    completion's `text`."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
    return {**envelope, "choices": [choice]}


async def relay_chunks(
    index: int,
    chunks: AsyncGenerator[Chunk, None],
    queue: asyncio.Queue[tuple[int, Chunk | None]],
    started: asyncio.Future[bool],
) -> None:
    """A choice's chunks onto the queue, tagged with its index, then None; its error stays
    with the task (`raise_if_failed`), as a chunk cannot carry it. `started` is True at its
    first chunk, False if it ends without one."""
    try:
        async for chunk in chunks:
            if not started.done():
                started.set_result(True)
            await queue.put((index, chunk))
    finally:
        if not started.done():
            started.set_result(False)
        await queue.put((index, None))


async def first_chunks(relays: list[asyncio.Task], started: list[asyncio.Future[bool]], timeout: float) -> None:
    """Waits until every choice has relayed its first chunk, or `timeout`; a choice that
    failed before its first chunk (refused) raises its error here. Every choice runs on
    while others wait: one waiting for the room another holds (n > 1 on a full replica)
    gets it when that one ends."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        for task, first in zip(relays, started):
            if first.done() and not first.result() and task.done() and not task.cancelled() and task.exception():
                raise cast(BaseException, task.exception())
        waiting = [future for future in started if not future.done()]
        left = deadline - asyncio.get_running_loop().time()
        if not waiting or left <= 0:
            return
        await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)


async def raise_if_failed(task: asyncio.Task, index: int) -> None:
    """Awaits a choice's ended relay and raises the choice's error where it failed. A relay
    cancelled while this request was not means the choice stopped before its end."""
    try:
        await task
    except asyncio.CancelledError:
        if (current := asyncio.current_task()) is not None and current.cancelling():
            raise  # the client went away
        raise SpecDecError(f"choice {index} stopped before its end") from None


async def stop_choices(relays: list[asyncio.Task], generations: list[AsyncGenerator[Chunk, None]]) -> None:
    """Ends every choice still running (their sessions end) and waits for it."""
    for task in relays:
        task.cancel()
    await asyncio.gather(*relays, return_exceptions=True)
    await asyncio.gather(*(chunks.aclose() for chunks in generations), return_exceptions=True)
