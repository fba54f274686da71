"""A verify's deadline grows with the tokens it prefills (`coordinator.upstream.prefill_allowance_s`): a valid
long prompt whose prefill outlasts --target-timeout completes, where it used to fail
DEADLINE_EXCEEDED (a 32k-token prompt on a CPU takes minutes; the 60 s default was a hang
guard, not a limit on prompts)."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from coordinator import server as coordinator_server
from coordinator.config import CoordinatorConfig
from coordinator.requests import GenerationRequest
from specdec.engine.calibration import calibrate_costs
from specdec.engine.costs import CALIBRATION_MAX_TOKENS
from specdec.engine.modeling import tokenizer_fingerprint
from specdec.tools.testing import word_tokenizer
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import configured, inprocess_stack
from tests.table_services import TableDraft, TableModel, TableTarget

PROMPT = [(7 * i + 3) % 40 + 1 for i in range(150)]
TIMEOUT_S = 0.5


def slow(runner) -> None:
    """The runner's passes 20 ms slower as calibrated (1 to 9 tokens), and a prefill 5 ms a
    token: 150 tokens take 0.75 s, past TIMEOUT_S, well within it plus 150 one-token passes."""
    plain = runner.model.forward

    def slowed(*args, **kwargs):
        tokens = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[-1]
        time.sleep(0.02 if tokens <= CALIBRATION_MAX_TOKENS else 0.005 * tokens)
        return plain(*args, **kwargs)

    runner.model.forward = slowed


def slowed(draft_runner, target_runner) -> None:
    slow(target_runner)
    calibrate_costs(target_runner, keep_all_logits=True)


def both_slowed(draft_runner, target_runner) -> None:
    for runner, keep_all_logits in ((draft_runner, False), (target_runner, True)):
        slow(runner)
        calibrate_costs(runner, keep_all_logits=keep_all_logits)


async def test_a_prompt_whose_prefill_outlasts_the_target_timeout_completes(tiny_pair):
    overrides = {"target_timeout_s": TIMEOUT_S}
    async with inprocess_stack(tiny_pair, coordinator_overrides=overrides, prepare_runners=slowed) as stack:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, num_speculative_tokens=0)
        started = time.monotonic()
        response = await stack.stub.Generate(request, timeout=60)
        assert time.monotonic() - started > TIMEOUT_S, "the prefill did not outlast the timeout: nothing tested"
        assert len(response.token_ids) == 4 and response.finish_reason == "length"
        assert response.stats.target_retries == 0 and response.stats.reprefills == 0


async def test_a_draft_whose_prefill_outlasts_the_draft_timeout_still_drafts(tiny_pair):
    """The draft's calls get the same allowance from its calibrated step: a given-up prefill
    stops, so under a flat deadline the draft would start it over each round and never draft."""
    overrides = {"draft_timeout_s": TIMEOUT_S}
    async with inprocess_stack(
        tiny_pair, draft_overrides={"quantize": "none"}, coordinator_overrides=overrides, prepare_runners=both_slowed
    ) as stack:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=6, num_speculative_tokens=2)
        response = await stack.stub.Generate(request, timeout=60)
        assert response.stats.draft_failures == 0 and response.stats.proposed_tokens > 0, response.stats


class TimedTarget(TableTarget):
    """A lookup-table target that notes the allowance each verify is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.allowances: list[float] = []

    async def verify(self, request, allowance_s=0.0):
        self.allowances.append(allowance_s)
        return await super().verify(request)


class TimedDraft(TableDraft):
    """A lookup-table draft that notes the allowance each Propose is given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.allowances: list[float] = []

    async def propose(self, request, allowance_s=0.0):
        self.allowances.append(allowance_s)
        return await super().propose(request)


async def test_each_replica_gives_its_own_calibrated_pass_to_the_allowance(tmp_path):
    """Replicas of a pool may run on machines of different speeds: a session on a replica
    whose pass is four times the first replica's is given four times the allowance. Before,
    every replica's calls were given the first replica's, too short for a long prompt's
    prefill on the slower one."""
    word_tokenizer(8).save_pretrained(tmp_path)
    model = TableModel(8, salt=1)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path))
    first = TimedTarget(model, fingerprint, pass_ms=(10.0,) * 9)
    slower = TimedTarget(model, fingerprint, pass_ms=(40.0,) * 9)
    slower.address = "table target 2"
    draft = TimedDraft(TableModel(8, salt=2, base=model), fingerprint, pass_ms=(5.0,) * 9)
    slower_draft = TimedDraft(TableModel(8, salt=2, base=model), fingerprint, pass_ms=(15.0,) * 9)
    slower_draft.address = "table draft 2"
    config = CoordinatorConfig(
        draft_address=draft.address, target_address=first.address, tokenizer=str(tmp_path), metrics_port=-1
    )
    config, rules = configured(config, {})
    engine = await coordinator_server.connect(config, draft, first, rules)  # type: ignore[arg-type]
    try:
        pool = engine.upstream.targets
        pool._apply(pool.add(slower.address, slower), await slower.info())
        pool.replicas[first.address].serving = False  # new sessions go to the slower one
        drafts = engine.upstream.drafts
        drafts._apply(drafts.add(slower_draft.address, slower_draft), await slower_draft.info())
        drafts.replicas[draft.address].serving = False
        prompt = tuple(i % 8 for i in range(100))
        request = GenerationRequest(
            prompt_token_ids=prompt, max_new_tokens=4, temperature=1.0, seed=1, num_speculative_tokens=2
        )
        assert len([token async for chunk in engine.generate(request) for token in chunk.token_ids]) == 4
    finally:
        engine.close()
        await engine.wait_cleanup()
    assert not first.allowances and slower.allowances[0] == pytest.approx(100 * 0.04)
    assert not draft.allowances and slower_draft.allowances[0] == pytest.approx(100 * 0.015)
