"""What the HTTP API reads before its token check is bounded as gRPC's metadata is: 1 MiB in
all. aiohttp's own limits (128 headers of up to 1 MiB each, the bound once passed per header)
let a caller without a token pin 128 MiB a connection by never finishing its headers."""

from __future__ import annotations

import asyncio

from specdec.config.services import ServerSecurity
from tests.stack import inprocess_stack


async def status_of(port: int, headers: list[tuple[str, str]]) -> bytes:
    """The status line of a GET /v1/models sent with `headers`, over a raw connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    writer.write(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{head}\r\n".encode())
    await writer.drain()
    status = await reader.readline()
    writer.close()
    return status


async def test_headers_are_bounded_in_number_and_size_and_a_long_token_gets_a_401(tiny_pair, tmp_path, caplog):
    tokens = tmp_path / "tokens"
    tokens.write_text("the-token\n")
    overrides = {"http_port": 0, "security": ServerSecurity(auth_token_file=str(tokens))}
    async with inprocess_stack(tiny_pair, coordinator_overrides=overrides) as stack:
        port = stack.coordinator.http_port
        token = [("Authorization", "Bearer the-token")]
        assert b" 200 " in await status_of(port, token + [(f"X-Extra-{i}", "v" * 8_000) for i in range(50)])
        assert b" 401 " in await status_of(port, [("Authorization", "Bearer " + "x" * 12_000)])
        assert b" 400 " in await status_of(port, [("Authorization", "Bearer " + "x" * 20_000)])  # past 16 KiB
        assert b" 400 " in await status_of(port, token + [(f"X-Extra-{i}", "v") for i in range(70)])
    # The caller's fault, refused before any handler: no ERROR traceback for anyone to flood the log with.
    assert not [record for record in caplog.records if record.exc_info], caplog.text
