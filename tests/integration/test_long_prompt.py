"""A verify's deadline grows with the tokens it prefills (`Upstream.verify_timeout_s`): a valid
long prompt whose prefill outlasts --target-timeout completes, where it used to fail
DEADLINE_EXCEEDED (a 32k-token prompt on a CPU takes minutes; the 60 s default was a hang
guard, not a limit on prompts)."""

from __future__ import annotations

import time

from specdec.engine.calibration import calibrate_costs
from specdec.engine.costs import CALIBRATION_MAX_TOKENS
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import inprocess_stack

PROMPT = [(7 * i + 3) % 40 + 1 for i in range(150)]
TIMEOUT_S = 0.5


def slowed(draft_runner, target_runner) -> None:
    """The target's passes 20 ms slower as calibrated (1 to 9 tokens), and a prefill 5 ms a
    token: 150 tokens take 0.75 s, past TIMEOUT_S, well within it plus 150 one-token passes."""
    plain = target_runner.model.forward

    def slow(*args, **kwargs):
        tokens = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[-1]
        time.sleep(0.02 if tokens <= CALIBRATION_MAX_TOKENS else 0.005 * tokens)
        return plain(*args, **kwargs)

    target_runner.model.forward = slow
    calibrate_costs(target_runner, keep_all_logits=True)


async def test_a_prompt_whose_prefill_outlasts_the_target_timeout_completes(tiny_pair):
    overrides = {"target_timeout_s": TIMEOUT_S}
    async with inprocess_stack(tiny_pair, coordinator_overrides=overrides, prepare_runners=slowed) as stack:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, num_speculative_tokens=0)
        started = time.monotonic()
        response = await stack.stub.Generate(request, timeout=60)
        assert time.monotonic() - started > TIMEOUT_S, "the prefill did not outlast the timeout: nothing tested"
        assert len(response.token_ids) == 4 and response.finish_reason == "length"
        assert response.stats.target_retries == 0 and response.stats.reprefills == 0
