"""A request's sessions are pending on their replicas (placed, not yet opened there) only
until the replica first answers a call on them, whichever call that is: a Propose or Verify,
or a pipelined request's catch-up ProposeBranches. Until then an Info from the replica does not
count them, and the coordinator counts them as its own, not another coordinator's
(`Replica.pending`). In process: the coordinator over lookup-table services."""

from __future__ import annotations

import dataclasses
import time

import pytest
from transformers import AutoTokenizer

from coordinator import engine as engine_module
from coordinator import server as coordinator_server
from coordinator.config import CoordinatorConfig
from coordinator.requests import GenerationRequest
from specdec.engine.modeling import tokenizer_fingerprint
from specdec.errors import InvalidArgument, ServiceRefused
from specdec.tools.testing import word_tokenizer
from tests.stack import configured
from tests.table_services import TableDraft, TableModel, TableTarget


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("words")
    word_tokenizer(24).save_pretrained(folder)
    return str(folder)


async def table_engine(tokenizer_dir: str, overrides: dict | None = None, draft_class=TableDraft, **draft_args):
    """The coordinator over lookup-table services, a draft that agrees with its target often."""
    target_model = TableModel(24, salt=1, logit_scale=1.5)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_dir))
    draft = draft_class(TableModel(24, salt=2, base=target_model, noise=1.0), fingerprint, **draft_args)
    target = TableTarget(target_model, fingerprint)
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=tokenizer_dir, metrics_port=-1
        ),
        overrides or {},
    )
    return await coordinator_server.connect(config, draft, target, rules)


@pytest.mark.parametrize("overrides", [{}, {"pipeline": True}], ids=["sequential", "pipelined"])
async def test_sessions_stop_pending_once_their_replica_answers(tokenizer_dir, overrides):
    engine = await table_engine(tokenizer_dir, overrides)
    (draft_replica,) = engine.upstream.drafts.replicas.values()
    (target_replica,) = engine.upstream.targets.replicas.values()
    try:
        request = GenerationRequest(
            prompt_token_ids=(1, 0, 1), max_new_tokens=12, temperature=1.0, seed=3, num_speculative_tokens=1
        )
        pending = []
        async for _ in engine.generate(request):
            pending.append((len(draft_replica.pending), len(target_replica.pending)))
        assert draft_replica.sessions == 0 and target_replica.sessions == 0
        # From its first chunk, after the first verify: both replicas have answered.
        assert set(pending) == {(0, 0)}, f"pending (draft, target) at each chunk: {pending}"
        assert not draft_replica.pending and not target_replica.pending
    finally:
        engine.close()
        await engine.wait_cleanup()


@pytest.mark.parametrize("refusal", ["top_k", "state"])
async def test_a_request_refused_before_its_first_round_holds_no_place(tokenizer_dir, monkeypatch, refusal):
    """A top_k past the wire's int32 is the caller's error, named; and whatever else fails
    while the request's state is built fails it before its sessions take places: a place is
    freed only at the request's end, which such a request never reaches, so each one used
    to keep a session and its KV reservation on both replicas until the coordinator restarted."""
    engine = await table_engine(tokenizer_dir)
    if refusal == "state":
        monkeypatch.setattr(engine_module.wire, "params_to_pb", _broken)
    replicas = [*engine.upstream.drafts.replicas.values(), *engine.upstream.targets.replicas.values()]
    try:
        request = GenerationRequest(prompt_token_ids=(1, 0, 1), max_new_tokens=4, temperature=1.0, top_k=2**31 - 1)
        if refusal == "top_k":
            request = dataclasses.replace(request, top_k=2**31)
        with pytest.raises(InvalidArgument if refusal == "top_k" else ValueError, match="top_k"):
            async for _ in engine.generate(request):
                pass
        assert [(replica.sessions, replica.reserved_bytes, len(replica.pending)) for replica in replicas] == [
            (0, 0, 0)
        ] * 2
    finally:
        engine.close()
        await engine.wait_cleanup()


def _broken(params):
    raise ValueError(f"Value out of range: top_k {params.top_k}")


class TokenChangedDraft(TableDraft):
    """A draft restarted with another --auth-token-file after `serves` proposals: it refuses
    the coordinator (UNAUTHENTICATED), as ServiceClient translates it."""

    def __init__(self, *args, serves: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.serves = serves

    async def propose(self, request, allowance_s=0.0):
        self.serves -= 1
        if self.serves < 0:
            raise ServiceRefused(f"draft service at {self.address} refused the coordinator (UNAUTHENTICATED)")
        return await super().propose(request, allowance_s)


async def test_a_draft_that_refuses_the_coordinator_mid_request_leaves_it_target_only(tokenizer_dir):
    """The draft only ever speeds a request up: one restarted with another token failed every
    request whose session it held at its next draft call (INTERNAL); now such a request runs
    on target-only rounds, its session moving where another replica serves."""
    engine = await table_engine(tokenizer_dir, draft_class=TokenChangedDraft, serves=2)
    try:
        request = GenerationRequest(
            prompt_token_ids=(1, 0, 1), max_new_tokens=16, temperature=1.0, seed=5, num_speculative_tokens=2
        )
        chunks = [chunk async for chunk in engine.generate(request)]
    finally:
        engine.close()
        await engine.wait_cleanup()
    stats = chunks[-1].stats
    assert sum(len(chunk.token_ids) for chunk in chunks) == 16 and chunks[-1].finish_reason == "length"
    assert stats is not None and stats.draft_failures >= 1 and stats.fallback_rounds >= 1


async def test_a_requests_clock_and_deadline_run_from_its_receipt(tokenizer_dir, monkeypatch):
    """Preparing a request (templating, tokenising) runs in turn on one thread, behind other
    requests' long prompts: its time counts in time_to_first_token_ms and total_ms, and comes
    off the client's deadline before the queue and retry windows are cut from it."""
    engine = await table_engine(tokenizer_dir)
    prepare, windows = engine.prepare, []

    def slow_prepare(*args):
        time.sleep(0.3)
        return prepare(*args)

    async def place(draft_view, target_view, prompt_ids, max_new_tokens, wait_s):
        windows.append(wait_s)
        return await upstream_place(draft_view, target_view, prompt_ids, max_new_tokens, wait_s)

    upstream_place = engine.upstream.place
    monkeypatch.setattr(engine, "prepare", slow_prepare)
    monkeypatch.setattr(engine.upstream, "place", place)
    try:
        request = GenerationRequest(prompt_token_ids=(1, 0, 1), max_new_tokens=4, temperature=1.0, seed=1)
        chunks = [chunk async for chunk in engine.generate(request, time_remaining_s=1.0)]
    finally:
        engine.close()
        await engine.wait_cleanup()
    stats = chunks[-1].stats
    assert stats is not None and stats.time_to_first_token_ms >= 300 and stats.total_ms >= 300
    assert windows and windows[0] <= 0.7 * 0.7  # 0.7 of the 0.7 s left after preparing, at most


async def test_a_draft_session_moved_with_a_pre_draft_ready_is_opened_afresh(tokenizer_dir):
    """A pipelined request's draft session moves to another replica (its breaker tripped)
    while a pre-draft from the old one waits to be verified: the round uses it, but the new
    replica holds none of the session. The round counted it synced there all the same, so a
    branch call forked from nothing and the next Propose sent only a tail: both NOT_FOUND, a
    re-prefill and a branch failure counted where no service lost anything. Now the round
    starts no branch there and the next call opens the session with the whole sequence."""

    async def run(move: bool):
        table = TableModel(24, salt=1, logit_scale=4.0)  # draft and target alike: pre-drafts are used
        fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_dir))
        first, other, target = (
            TableDraft(table, fingerprint),
            TableDraft(table, fingerprint),
            TableTarget(table, fingerprint),
        )
        config, rules = configured(
            CoordinatorConfig(
                draft_address=first.address, target_address=target.address, tokenizer=tokenizer_dir, metrics_port=-1
            ),
            {"pipeline": True},
        )
        engine = await coordinator_server.connect(config, first, target, rules)
        replica = engine.upstream.drafts.add("draft-b", other)
        replica.serving, replica.info = True, await other.info()
        calls, allowed = [0], engine.upstream.draft_allowed

        def trip_on_the_fourth(view, unused):
            calls[0] += 1
            if move and calls[0] == 4 and view.replica is not None:
                view.replica.breaker.trip()
            return allowed(view, unused)

        engine.upstream.draft_allowed = trip_on_the_fourth
        try:
            request = GenerationRequest(
                prompt_token_ids=(1, 0, 1), max_new_tokens=30, temperature=1.0, seed=1, num_speculative_tokens=3
            )
            tokens, stats = [], None
            async for chunk in engine.generate(request):
                tokens += chunk.token_ids
                stats = chunk.stats or stats
            return tokens, stats
        finally:
            engine.close()
            await engine.wait_cleanup()

    (moved_tokens, moved), (tokens, _) = await run(True), await run(False)
    assert moved.replica_moves == 1 and moved.ready_rounds > 0
    assert (moved.reprefills, moved.branch_failures) == (0, 0) and len(moved_tokens) == len(tokens) == 30
