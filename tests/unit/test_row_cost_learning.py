"""The coordinator learns what each row of a branch call costs beyond the calibrated passes
(coordinator.overlap.RowCost) from its requests' calls, and prices the overlap and K of the
requests after them with it; never a seeded sampled request's, whose overlap and K, like its
output, depend on nothing but itself."""

from __future__ import annotations

from transformers import AutoTokenizer

from coordinator import choosers as coordinator_choosers
from coordinator import server as coordinator_server
from coordinator.config import CoordinatorConfig
from coordinator.requests import GenerationRequest
from specdec.engine.modeling import tokenizer_fingerprint
from tests.stack import configured
from tests.table_services import TableDraft, TableModel, TableTarget


async def test_branch_calls_teach_the_row_cost_that_prices_later_requests(word_pair, monkeypatch):
    table = TableModel(24, salt=1, logit_scale=1.5)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(word_pair.target))
    # Hedges set by hand: auto hedges greedy requests only, and the tables sample (temperature 1).
    draft = TableDraft(TableModel(24, salt=2, logit_scale=1.5), fingerprint, pass_ms=(5.0,) * 9, max_batch_size=32)
    target = TableTarget(table, fingerprint, pass_ms=(40.0,) * 9)
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=str(word_pair.target), metrics_port=-1
        ),
        {"pipeline": True, "hedges": 2},
    )
    priced = []  # the row cost of each request's overlap, as it starts
    choose = coordinator_choosers.choose_overlap

    def spy(costs, alpha, ks, pipeline, hedges, guesses, sampled=False):
        priced.append(costs.branch_row_ms)
        return choose(costs, alpha, ks, pipeline, hedges, guesses, sampled=sampled)

    monkeypatch.setattr(coordinator_choosers, "choose_overlap", spy)
    engine = await coordinator_server.connect(config, draft, target, rules)

    async def generate(**fields) -> int:
        """The request's hedges."""
        request = GenerationRequest(prompt_token_ids=(1, 0, 1), max_new_tokens=24, temperature=1.0, **fields)
        async for chunk in engine.generate(request):
            if chunk.stats is not None:
                return chunk.stats.hedges
        raise AssertionError("no stats")

    try:
        assert await generate(), "no hedges: the case is not exercised"
        row_cost = engine.choosers._row_cost
        assert row_cost.calls, "no branch call of several rows was timed"
        row_cost.ms = 0.25  # as if its calls had taken that much longer
        await generate()
        await generate(seed=7)
    finally:
        engine.close()
        await engine.wait_cleanup()
    assert priced == [0.0, 0.25, 0.0]  # the seeded request's: the calibrated costs alone
