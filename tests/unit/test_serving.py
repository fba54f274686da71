"""specdec.rpc.serving's start-up path, without a server."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from coordinator.openai_api import start_http
from specdec.config.services import ServerSecurity
from specdec.rpc import serving, telemetry
from specdec.rpc.model_thread import ModelThread


class _Running:
    frozen_while_serving = -1

    async def serve_until_signal(self, grace_s: float) -> None:
        self.frozen_while_serving = gc.get_freeze_count()


def test_a_service_serves_with_what_start_up_made_out_of_the_collectors_sight(monkeypatch):
    """What `build` made (the model, the tokenizer, their modules) is frozen before the first
    call is served, so no full collection scans it; objects made while serving still are
    collected."""
    gc.unfreeze()
    running = _Running()

    async def build() -> _Running:
        build.made = [[object()] for _ in range(1000)]  # start-up's own objects, kept
        return running

    monkeypatch.setattr(serving.telemetry, "setup_tracing", lambda name: None)
    try:
        asyncio.run(serving.serve_forever(build, "WARNING", "specdec-test"))
        assert running.frozen_while_serving >= 1000
        garbage = []
        garbage.append(garbage)  # a cycle made while serving
        tracked = {id(o) for o in gc.get_objects()}
        assert id(garbage) in tracked, "an object made after start-up must stay in the collector's sight"
    finally:
        gc.unfreeze()
        serving.freeze_start_up_objects()  # as the test session had it (tests/conftest.py)


def test_a_services_message_limit_holds_a_calls_rows_over_its_vocabulary():
    """`model_message_bytes` replaces --max-message-bytes: it must hold MAX_ROWS rows in their
    largest wire form for the model's vocabulary, a context's ids, and never go under what every
    model was served with before, nor over gRPC's ceiling."""
    import torch

    from specdec.engine.rows import MAX_ROWS
    from specdec.rpc import wire

    vocab = 300_000  # larger than any served today, so the bound is above the floor
    half = torch.zeros(2, vocab)
    half[0, vocab - vocab // 2 :] = 1.0 / (vocab // 2)  # the largest sparse row: the highest ids
    half[1, :] = 1.0 / vocab  # a dense row
    rows = wire.encode_distributions(half, 2, deterministic=False)
    assert rows[0].HasField("sparse") and rows[1].HasField("dense")
    largest_row = max(row.ByteSize() for row in rows) + 8  # and its field header in the message
    context = 131_072
    limit = serving.model_message_bytes(vocab, context)
    assert MAX_ROWS * largest_row + 10 * context < limit < 2 * MAX_ROWS * largest_row
    assert serving.model_message_bytes(1000, 2048) == serving.DEFAULT_MAX_MESSAGE_BYTES
    assert serving.model_message_bytes(10**8, 1 << 20) == serving.GRPC_MAX_MESSAGE_BYTES


def test_a_verify_reply_with_a_whole_prompts_features_fits_the_targets_limit():
    """An EAGLE head's target returns the features of every position a call ran: a prompt as long
    as the context, three layers wide (EAGLE-3's), fits the limit the target serves with, as its
    draft's request forwarding them fits the draft's (here 12,000 positions of 3 x 1,024 values
    in bfloat16: 74 MB, over the 64 MiB floor)."""
    import torch
    from transformers import Qwen2Config

    from specdec.rpc import wire
    from specdec.v1 import target_pb2

    config = Qwen2Config(vocab_size=1000, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8)
    target = SimpleNamespace(model=SimpleNamespace(config=config))
    context = 12_000
    reply = target_pb2.VerifyResponse(
        features=wire.features_to_pb(0, torch.zeros(context, 3 * config.hidden_size), torch.bfloat16)
    )
    per_position = serving.feature_bytes_per_position(target, "specdec.v1.Target")
    assert reply.ByteSize() <= serving.model_message_bytes(config.vocab_size, context, per_position)
    head = SimpleNamespace(feature_width=3 * config.hidden_size)  # an EAGLE-3 draft
    assert serving.feature_bytes_per_position(head, "specdec.v1.Draft") == per_position
    assert serving.feature_bytes_per_position(SimpleNamespace(), "specdec.v1.Draft") == 0  # a model draft


async def test_a_port_another_server_holds_is_a_one_line_start_up_error():
    """gRPC raises where it cannot bind (a RuntimeError, once a traceback after the model had
    loaded), and by default lets a second server share a port another holds (SO_REUSEPORT), so
    a stale service kept taking some of the connections: both are refused by name."""
    first = serving.create_server(1 << 20)
    port = serving.bind(first, "127.0.0.1", 0)
    await first.start()
    try:
        with pytest.raises(SystemExit, match=rf"could not listen on 127.0.0.1:{port} \(another process holds"):
            serving.bind(serving.create_server(1 << 20), "127.0.0.1", port)
        with pytest.raises(SystemExit, match=rf"--metrics-port: could not listen on 127.0.0.1:{port}"):
            telemetry.start_metrics_server(CollectorRegistry(), "127.0.0.1", port)
        with pytest.raises(SystemExit, match=rf"--http-port: could not listen on 127.0.0.1:{port}"):
            await start_http(None, "m", "127.0.0.1", port, ServerSecurity())  # type: ignore[arg-type]
    finally:
        await first.stop(0)


async def test_a_failed_expiry_round_is_logged_and_the_next_one_runs(caplog):
    """One round raising (a prefix-cache block copied out of device memory) ended the task:
    idle sessions were then held until a new session's opening expired them."""
    rounds = []

    def expire() -> int:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("CUDA out of memory")
        return 0

    thread = ModelThread("test-expiry")
    task = asyncio.ensure_future(serving.expire_sessions_periodically(thread, expire, 0.01))
    try:
        async with asyncio.timeout(5):
            while len(rounds) < 3:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        thread.shutdown()
    assert "expiring idle sessions failed" in caplog.text
