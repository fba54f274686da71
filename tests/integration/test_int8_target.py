"""An int8 target through the real servers: speculative greedy output is the int8 target's
own one-token-at-a-time output, for every K and with confidence stops, because a token's
logits do not depend on the other tokens in its verify pass (specdec.engine.quantize)."""

from __future__ import annotations

from specdec.rpc.security import aio_channel
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import target_pb2_grpc
from specdec.v1.common_pb2 import InfoRequest
from tests.stack import inprocess_stack

PROMPTS = ["def add(a, b):", "The quick brown fox", "SELECT name, count(*) FROM"]


async def test_int8_target_speculative_greedy_equals_its_own_target_only_output(tiny_pair):
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "int8"}, target_overrides={"quantize": "int8"}
    ) as stack:
        async with aio_channel(f"127.0.0.1:{stack.target.port}", []) as channel:
            info = await target_pb2_grpc.TargetStub(channel).Info(InfoRequest())
        assert info.quantization.startswith("int8")
        for prompt in PROMPTS:
            alone = await stack.stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_new_tokens=40, num_speculative_tokens=0)
            )
            for k, confidence in ((1, 0.0), (4, 0.0), (8, 0.0), (6, 0.6)):
                speculative = await stack.stub.Generate(
                    pb.GenerateRequest(
                        prompt=prompt, max_new_tokens=40, num_speculative_tokens=k, draft_min_confidence=confidence
                    )
                )
                assert speculative.token_ids == alone.token_ids, (
                    f"K={k}, confidence {confidence}: diverged on {prompt!r}"
                )
                assert speculative.stats.accepted_tokens > 0
                assert speculative.stats.target_numerics == f"{info.quantization}, float32 elsewhere"
