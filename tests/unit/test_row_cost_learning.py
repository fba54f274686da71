"""The coordinator learns what each row of a branch call costs beyond the calibrated passes
(coordinator.overlap.RowCost) from its requests' calls, and prices the overlap and K of the
requests after them with it; never a seeded sampled request's, whose overlap and K, like its
output, depend on nothing but itself."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import AutoTokenizer

from coordinator import choosers as coordinator_choosers
from coordinator import server as coordinator_server
from coordinator.choosers import Choosers
from coordinator.config import CoordinatorConfig
from coordinator.drafting import Drafting
from coordinator.requests import GenerationRequest
from coordinator.round_costs import BatchCosts, RoundCosts
from specdec.engine.modeling import tokenizer_fingerprint
from tests.stack import configured
from tests.table_services import TableDraft, TableModel, TableTarget


async def test_branch_calls_are_timed_and_the_row_cost_prices_later_requests(word_pair, monkeypatch):
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
    priced = []  # the row cost of each request's overlap and of its K chooser, as it starts
    choose, chooser, settle = coordinator_choosers.choose_overlap, coordinator_choosers.AdaptiveK, Drafting.settle
    timings = []

    def spy_overlap(costs, *args, **kwargs):
        priced.append(("overlap", costs.branch_row_ms))
        return choose(costs, *args, **kwargs)

    def spy_chooser(**fields):
        priced.append(("K", fields["costs"].branch_row_ms))
        return chooser(**fields)

    async def spy_settle(self, state, call, result):
        settled = await settle(self, state, call, result)
        timings.append(settled.timing)
        return settled

    monkeypatch.setattr(coordinator_choosers, "choose_overlap", spy_overlap)
    monkeypatch.setattr(coordinator_choosers, "AdaptiveK", spy_chooser)
    monkeypatch.setattr(Drafting, "settle", spy_settle)
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
        # Calls of three rows (the pre-draft and two hedges), timed although in-process the reply
        # is in before the round reads it (a done callback ran after; none was timed).
        assert any(timing is not None and timing[0] == 3 for timing in timings)
        row_cost = engine.choosers._row_cost
        assert row_cost.calls == 0  # a sampled request's rows teach nothing
        row_cost.ms = 0.25  # as if greedy requests' calls had taken that much longer
        await generate()
        await generate(seed=7)
    finally:
        engine.close()
        await engine.wait_cleanup()
    unpriced, learned = [("overlap", 0.0), ("K", 0.0)], [("overlap", 0.25), ("K", 0.25)]
    assert priced == unpriced + learned + unpriced  # the seeded request's: the calibrated costs alone


def test_greedy_requests_teach_the_row_cost():
    choosers = Choosers(CoordinatorConfig(), rules=None)  # type: ignore[arg-type]

    # Calls of 5 rows and 6 steps on a draft whose batches of up to 16 cost a pass: 0.5 + 6 x 2.0 = 12.5 ms.
    draft = (2.0,) * 16
    costs = RoundCosts(draft, (20.0,) * 16, 0.5, 0.5, draft_batch=BatchCosts(draft, ((16, 1, 2.0),), 16))

    def finished(greedy: bool, call_ms: list[float]) -> SimpleNamespace:
        job = SimpleNamespace(params=SimpleNamespace(greedy=greedy), relaxed=None)
        calls = [(costs, 5, 6, ms) for ms in call_ms]
        return SimpleNamespace(job=job, branch_calls=calls, k_chooser=None, copy_chooser=None)

    choosers.learn(finished(False, [18.5, 18.5]))
    assert choosers._row_cost.calls == 0
    choosers.learn(finished(True, [15.5, 18.5]))  # 0.1 and 0.2 ms a row a step beyond the costs
    assert choosers._row_cost.calls == 2 and abs(choosers._row_cost.ms - 0.15) < 1e-9
