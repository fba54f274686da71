"""The drafting seam (coordinator.drafting): each round kind has its source, and a source that is
not the draft service plugs in without touching the round. The one here drafts from the target's
own rows (what a head fed the target's features approximates): every draft it sends is then
accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from coordinator import server as coordinator_server
from coordinator.config import CoordinatorConfig
from coordinator.drafting import Drafted, Nothing, sources
from coordinator.requests import GenerationRequest
from coordinator.rounds import RoundKind
from coordinator.state import Round, Source
from specdec.engine.modeling import tokenizer_fingerprint
from specdec.rpc import wire
from specdec.v1 import common_pb2
from tests.stack import configured
from tests.table_services import TableDraft, TableModel, TableTarget

PROMPT = (1, 0, 1)


def test_every_round_kind_has_a_source_and_sourceless_kinds_say_why():
    table = sources(upstream=None)  # type: ignore[arg-type]  # no call is made
    assert set(table) == set(RoundKind)
    assert {kind: source.source for kind, source in table.items() if isinstance(source, Nothing)} == {
        RoundKind.CATCH_UP: Source.CATCH_UP,
        RoundKind.FALLBACK: Source.FALLBACK,
        RoundKind.TARGET_ONLY: Source.NONE,
    }


class FromTargetRows:
    """Drafts K tokens from the target's own rows with the round's draft seed, each sent dense
    with its row."""

    def __init__(self, target: TableModel) -> None:
        self.target = target
        self.calls = 0

    async def draft(self, state, plan, draws) -> Drafted:
        self.calls += 1
        generator = np.random.default_rng(draws.draft_seed)
        context, ids, probs, rows = tuple(state.sequence), [], [], []
        for _ in range(plan.k):
            row = self.target.probs(context)
            token = int(generator.choice(len(row), p=row))
            dense = common_pb2.ProposalDistribution(dense=wire.encode_dense(torch.tensor(row, dtype=torch.float32)))
            ids.append(token)
            probs.append(float(np.float32(row[token])))
            rows.append(dense)
            context += (token,)
        return Drafted(Round(Source.DRAFT, ids, probs, rows), took=True)


async def generate(word_pair, temperature: float, seeds: range) -> tuple[list[tuple[int, ...]], list, FromTargetRows]:
    target_model = TableModel(4, salt=1)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(word_pair.target))
    draft = TableDraft(TableModel(4, salt=2, base=target_model, noise=1.0), fingerprint)
    target = TableTarget(target_model, fingerprint)
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=str(word_pair.target), metrics_port=-1
        ),
        {},
    )
    engine = await coordinator_server.connect(config, draft, target, rules)
    source = FromTargetRows(target_model)
    engine.drafting.sources[RoundKind.DRAFT_CALL] = source
    outputs, stats = [], []
    try:
        for seed in seeds:
            request = GenerationRequest(
                prompt_token_ids=PROMPT, max_new_tokens=6, temperature=temperature, seed=seed, num_speculative_tokens=3
            )
            tokens: list[int] = []
            async for chunk in engine.generate(request):
                tokens += chunk.token_ids
                if chunk.stats is not None:
                    stats.append(chunk.stats)
            outputs.append(tuple(tokens))
    finally:
        engine.close()
        await engine.wait_cleanup()
    return outputs, stats, source


async def test_a_source_fed_by_the_target_plugs_in_and_every_draft_it_sends_is_accepted(word_pair):
    """The round asks the source in place of the draft service; its drafts come with the rows
    they were drawn from, which are the target's (p = q), so rejection sampling keeps every
    one (min(1, p/q) = 1), and a seed gives one output."""
    outputs, stats, source = await generate(word_pair, 1.0, range(40))
    proposed = sum(s.proposed_tokens for s in stats)
    assert source.calls >= 40 and proposed > 40 and sum(s.accepted_tokens for s in stats) == proposed
    assert len(set(outputs)) > 1, "sampled outputs must vary with the seed"
    again, _, _ = await generate(word_pair, 1.0, range(5))
    assert again == outputs[:5]


class UnannouncedCopies(TableDraft):
    """A draft that copies though its Info does not say so (a replica of a mixed pool, one
    restarted as prompt lookup): it marks its proposals copies wherever the call lets it, as
    a copying drafter does (max_copied_tokens unset: up to num_tokens; 0: none)."""

    def _propose(self, request):
        response = super()._propose(request)
        response.copied = not request.HasField("max_copied_tokens") or request.max_copied_tokens > 0
        return response


@pytest.mark.parametrize(
    "overlap", [{}, {"pipeline": True, "hedges": 1, "bonus_guesses": 2}], ids=["plain", "overlapped"]
)
async def test_a_draft_that_copies_unannounced_never_fails_a_request(word_pair, overlap):
    """The coordinator sent no max_copied_tokens to a draft whose Info said it did not copy,
    then checked its reply against a copy cap of 0: a copy of up to K tokens failed the
    request (INTERNAL, MalformedReply), and every request after it."""
    table = TableModel(4, salt=1)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(word_pair.target))
    draft, target = UnannouncedCopies(table, fingerprint), TableTarget(table, fingerprint)
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=str(word_pair.target), metrics_port=-1
        ),
        overlap,
    )
    engine = await coordinator_server.connect(config, draft, target, rules)
    try:
        assert not engine.pair.draft_copies
        request = GenerationRequest(
            prompt_token_ids=PROMPT, max_new_tokens=12, temperature=1.0, seed=3, num_speculative_tokens=3
        )
        chunks = [chunk async for chunk in engine.generate(request)]
        assert sum(len(chunk.token_ids) for chunk in chunks) == 12
        assert chunks[-1].stats.proposed_tokens > 0
        if not overlap:  # its draft calls say 0; branch calls may copy up to their K, as they always could
            assert chunks[-1].stats.copied_rounds == 0
    finally:
        engine.close()
        await engine.wait_cleanup()
