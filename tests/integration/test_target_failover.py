"""A target that fails UNAVAILABLE late in a long request: the call is retried for
--connect-timeout from its first failure (a restart), or moves to another serving replica at
once, however long the request has run. The window once ran from the request's start, so a
generation older than --connect-timeout failed at the first reset. In process: the coordinator
over lookup-table services (tests/table_services.py), their outputs exact, compared with the
same seeded request that met no failure."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from coordinator import server as coordinator_server
from coordinator.config import CoordinatorConfig
from coordinator.requests import GenerationRequest
from specdec.engine.modeling import tokenizer_fingerprint
from specdec.errors import Unavailable
from specdec.tools.testing import word_tokenizer
from tests.stack import configured
from tests.table_services import TableDraft, TableModel, TableTarget

CONNECT_TIMEOUT_S = 0.3


class FlakyTarget(TableTarget):
    """The request's `fail_at`-th verify, on whichever replica holds its session, fails
    UNAVAILABLE after twice --connect-timeout: the connection reset once the request had run
    longer than that."""

    def __init__(self, *args, verifies: list[int], fail_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verifies, self.fail_at = verifies, fail_at  # verifies: [count], shared by the replicas

    async def verify(self, request, allowance_s=0.0):
        self.verifies[0] += 1
        if self.verifies[0] == self.fail_at:
            await asyncio.sleep(2 * CONNECT_TIMEOUT_S)
            raise Unavailable(f"{self.address} is unavailable (UNAVAILABLE): connection reset")
        return await super().verify(request)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("words")
    word_tokenizer(24).save_pretrained(folder)
    return str(folder)


async def generate(tokenizer_dir: str, fail_at: int, second_replica: bool) -> list[int]:
    target_model = TableModel(24, salt=1, logit_scale=1.5)
    draft_model = TableModel(24, salt=2, base=target_model, noise=1.0)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_dir))
    verifies = [0]
    draft = TableDraft(draft_model, fingerprint)
    target = FlakyTarget(target_model, fingerprint, verifies=verifies, fail_at=fail_at)
    config = CoordinatorConfig(
        draft_address=draft.address, target_address=target.address, tokenizer=tokenizer_dir, metrics_port=-1
    )
    config, rules = configured(config, {"connect_timeout_s": CONNECT_TIMEOUT_S})
    engine = await coordinator_server.connect(config, draft, target, rules)
    try:
        if second_replica:
            other = FlakyTarget(target_model, fingerprint, verifies=verifies, fail_at=fail_at)
            other.address = "table target 2"
            replica = engine.upstream.targets.add(other.address, other)
            engine.upstream.targets._apply(replica, await other.info())
        request = GenerationRequest(
            prompt_token_ids=(1, 0, 1), max_new_tokens=30, temperature=1.0, seed=7, num_speculative_tokens=3
        )
        tokens = [token for chunk in [c async for c in engine.generate(request)] for token in chunk.token_ids]
        assert verifies[0] > fail_at, "the failure was not met"
        return tokens
    finally:
        engine.close()
        await engine.wait_cleanup()


@pytest.mark.parametrize("second_replica", [False, True], ids=["retried", "moved"])
async def test_a_target_failing_late_in_a_long_request_is_retried_or_left(tokenizer_dir, second_replica):
    reference = await generate(tokenizer_dir, fail_at=0, second_replica=False)
    assert len(reference) == 30
    assert await generate(tokenizer_dir, fail_at=4, second_replica=second_replica) == reference
