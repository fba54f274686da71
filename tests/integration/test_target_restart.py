"""A lone target restarted mid-generation on its address serving other weights (a rolled-out
checkpoint, a wrong volume): the request must not go on with the new model's tokens after the
old one's. The lost session is re-sent only to a target that still serves the pool's model."""

from __future__ import annotations

import asyncio

import grpc

from specdec.rpc.model_thread import ModelThread
from specdec.v1 import coordinator_pb2 as pb
from target_service import server as target_server
from target_service.config import TargetConfig
from tests.stack import inprocess_stack, model_service_config, slow_down

PROMPT = "def add(a, b):"


async def test_a_target_restarted_with_other_weights_fails_the_request_and_mixes_nothing(tiny_pair):
    thread = ModelThread("restarted")
    try:
        async with inprocess_stack(tiny_pair, prepare_runners=lambda draft, target: slow_down(target, 0.03)) as stack:
            request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=80, num_speculative_tokens=3)
            stream = stack.stub.GenerateStream(request, timeout=90)
            await stream.read()
            port = stack.target.port
            await stack.target.stop(0)
            await asyncio.sleep(0.3)
            config = model_service_config(TargetConfig, tiny_pair.draft, port=port)  # same tokenizer, other weights
            stack.target = await target_server.build_server(config, target_server.load_runner(config), thread)
            try:
                while await stream.read() is not grpc.aio.EOF:
                    pass
                raise AssertionError("the generation finished on two models' tokens")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert "lost the session, and is refused now" in exc.details(), exc
                assert "weights_fingerprint" in exc.details(), exc
            await stack.target.stop(0)
    finally:
        thread.shutdown()


async def test_a_lost_session_is_re_sent_when_the_targets_info_is_slow_to_answer(tiny_pair, reference):
    """The model check before a re-send asks Info, which waits behind the model thread's pass
    (a long prefill): an answer that comes late refuses nothing, and the session is re-sent."""
    import time

    async with inprocess_stack(tiny_pair) as stack:
        request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=40, num_speculative_tokens=3)
        stream = stack.stub.GenerateStream(request, timeout=60)
        ids = list((await stream.read()).token_ids)
        describe = stack.target_runner.describe

        def slow() -> object:
            time.sleep(2.5)  # past the probe's deadline
            return describe()

        stack.target_runner.describe = slow
        for session_id in stack.target_runner.sessions.ids():
            stack.target_runner.end_session(session_id)  # evicted
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            ids += chunk.token_ids
        assert await stream.code() == grpc.StatusCode.OK and ids == reference(PROMPT, 40)
