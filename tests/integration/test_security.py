"""TLS, mutual TLS and bearer tokens through real servers: coordinator → draft/target over mutual
TLS with a shared token, and clients → coordinator over mutual TLS with a token."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

import draft_service.server
from specdec.config.services import ClientSecurity, ServerSecurity
from specdec.errors import ServiceRefused
from specdec.rpc.security import ChannelSecurity, aio_channel, load_client_security
from specdec.tools import client as client_cli
from specdec.tools.client import CoordinatorClient
from specdec.v1 import common_pb2, coordinator_pb2_grpc, draft_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

PROMPT = "def add(a, b):"


def internal(tls_files) -> ServerSecurity:
    """Draft and target: mutual TLS and the shared token."""
    return ServerSecurity(tls_files.server_cert, tls_files.server_key, tls_files.ca, tls_files.tokens)


def upstream(tls_files, token_file: str | None = None) -> ClientSecurity:
    """The coordinator's side of `internal`: the server certificate doubles as its client one."""
    return ClientSecurity(
        tls_files.ca, tls_files.server_cert, tls_files.server_key, None, token_file or tls_files.tokens
    )


def public_client(tls_files, token_file: str | None = None, **changes) -> ClientSecurity:
    """A caller of the coordinator with a client certificate (the coordinator requires one)."""
    settings = dict(
        tls_ca=tls_files.ca, tls_cert=tls_files.client_cert, tls_key=tls_files.client_key, auth_token_file=token_file
    )
    settings.update(changes)
    return ClientSecurity(**settings)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def secure_stack(tiny_pair, tls_files):
    """Every hop on mutual TLS with a token: client → coordinator → draft/target."""
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"security": internal(tls_files)},
        target_overrides={"security": internal(tls_files)},
        coordinator_overrides={
            "security": ServerSecurity(tls_files.server_cert, tls_files.server_key, tls_files.ca, tls_files.tokens),
            "upstream": upstream(tls_files),
            "pipeline": True,  # cancelled pre-drafts go through the token interceptor too
        },
        client_security=public_client(tls_files, tls_files.tokens),
    ) as running:
        yield running


async def call_generate(
    address: str, security: ChannelSecurity | None, stream: bool = False, metadata=()
) -> pb.GenerateResponse:
    async with aio_channel(address, [], security) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=8)
        if stream:
            return [chunk async for chunk in stub.GenerateStream(request, timeout=30, metadata=metadata)][-1]
        return await stub.Generate(request, timeout=30, metadata=metadata)


def coordinator_address(stack) -> str:
    return f"127.0.0.1:{stack.coordinator.port}"


async def test_generation_over_mutual_tls_with_tokens_matches_the_target(secure_stack, reference):
    response = await secure_stack.stub.Generate(
        pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24, num_speculative_tokens=3), timeout=60
    )
    assert list(response.token_ids) == reference(PROMPT, 24)
    assert response.stats.accepted_tokens > 0 and response.stats.predrafts > 0, "the draft was reached, pre-drafts too"
    chunks = [
        chunk
        async for chunk in secure_stack.stub.GenerateStream(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=60
        )
    ]
    assert "".join(chunk.text for chunk in chunks) == response.text


@pytest.mark.parametrize("stream", [False, True], ids=["Generate", "GenerateStream"])
async def test_missing_or_wrong_token_is_unauthenticated(secure_stack, tls_files, stream):
    address = coordinator_address(secure_stack)
    cases = [
        (
            load_client_security(public_client(tls_files)),
            (),
            "missing credentials: this server requires `authorization: Bearer <token>`",
        ),
        (load_client_security(public_client(tls_files, tls_files.other_token)), (), "invalid bearer token"),
        (
            load_client_security(public_client(tls_files)),
            (("authorization", "Basic dXNlcjpwYXNz"),),
            "expected `Bearer <token>`",
        ),
    ]
    for security, metadata, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call_generate(address, security, stream, metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert message in refused.value.details()
    # Either accepted token works; the second is preceded by a blank line in the file.
    for token in ("first-token-0123456789", "second-token-abcdef"):
        response = await call_generate(
            address, load_client_security(public_client(tls_files)), stream, (("authorization", f"Bearer {token}"),)
        )
        assert response.finish_reason


async def test_health_and_reflection_need_no_token(secure_stack, tls_files):
    for port in (secure_stack.coordinator.port, secure_stack.draft.port, secure_stack.target.port):
        async with aio_channel(f"127.0.0.1:{port}", [], load_client_security(public_client(tls_files))) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_mutual_tls_refuses_clients_without_a_trusted_certificate(secure_stack, tls_files):
    cases = {
        "no client certificate": load_client_security(
            ClientSecurity(tls_ca=tls_files.ca, auth_token_file=tls_files.tokens)
        ),
        "a certificate from another CA": load_client_security(
            public_client(
                tls_files, tls_files.tokens, tls_cert=tls_files.rogue_client_cert, tls_key=tls_files.rogue_client_key
            )
        ),
        "plaintext": load_client_security(ClientSecurity(auth_token_file=tls_files.tokens)),
    }
    for port in (secure_stack.coordinator.port, secure_stack.draft.port):
        for case, security in cases.items():
            async with aio_channel(f"127.0.0.1:{port}", [], security) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, f"port {port}, {case}"


async def test_client_refuses_a_server_its_ca_did_not_sign(secure_stack, tls_files):
    security = load_client_security(public_client(tls_files, tls_files.tokens, tls_ca=tls_files.rogue_ca))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call_generate(coordinator_address(secure_stack), security)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_internal_services_require_the_shared_token(secure_stack, tls_files):
    address = f"127.0.0.1:{secure_stack.draft.port}"
    without_token = load_client_security(ClientSecurity(tls_files.ca, tls_files.server_cert, tls_files.server_key))
    async with aio_channel(address, [], without_token) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await draft_pb2_grpc.DraftStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with aio_channel(address, [], load_client_security(upstream(tls_files))) as channel:
        info = await draft_pb2_grpc.DraftStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
    assert info.model_id


async def test_python_client_helper_speaks_tls_with_a_token(secure_stack, tls_files, reference, capsys):
    address = coordinator_address(secure_stack)

    def generate() -> pb.GenerateResponse:
        with CoordinatorClient(address, security=public_client(tls_files, tls_files.tokens)) as client:
            return client.generate(PROMPT, max_new_tokens=12)

    # Blocking calls run on a thread: the servers share this test's event loop.
    assert list((await asyncio.to_thread(generate)).token_ids) == reference(PROMPT, 12)
    args = [
        "--address",
        address,
        "--tls-ca",
        tls_files.ca,
        "--tls-cert",
        tls_files.client_cert,
        "--tls-key",
        tls_files.client_key,
    ]
    assert (
        await asyncio.to_thread(
            client_cli.main, [*args, "--auth-token-file", tls_files.tokens, PROMPT, "--max-new-tokens", "4"]
        )
        == 0
    )
    assert await asyncio.to_thread(client_cli.main, [*args, PROMPT, "--max-new-tokens", "4"]) == 1
    assert "error: UNAUTHENTICATED: missing credentials" in capsys.readouterr().err


async def test_coordinator_with_the_wrong_internal_token_fails_start_up_naming_the_draft(tiny_pair, tls_files):
    started = time.monotonic()
    with pytest.raises(
        ServiceRefused,
        match=r"draft service at 127\.0\.0\.1:\d+ refused the coordinator \(UNAUTHENTICATED\): invalid bearer token",
    ):
        async with inprocess_stack(
            tiny_pair,
            draft_overrides={"security": internal(tls_files)},
            # The target takes no token, so only the draft can refuse.
            target_overrides={"security": ServerSecurity(tls_files.server_cert, tls_files.server_key, tls_files.ca)},
            coordinator_overrides={"upstream": upstream(tls_files, tls_files.other_token), "connect_timeout_s": 60.0},
        ):
            pass
    assert time.monotonic() - started < 30, "a refused token is final: start-up must not wait out --connect-timeout"


def test_a_missing_certificate_stops_start_up_with_status_2_naming_the_flag(tiny_pair, tls_files, caplog):
    """Before any model loads: the message names the flag and the file."""
    missing = str(tls_files.folder / "missing.crt")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stopped:
        draft_service.server.main(
            ["--model", str(tiny_pair.draft), "--port", "0", "--tls-cert", missing, "--tls-key", tls_files.server_key]
        )
    assert stopped.value.code == 2
    assert f"--tls-cert {missing}" in caplog.text
