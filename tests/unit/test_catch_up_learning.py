"""A pipelined request whose pre-drafts keep missing: its rounds catch up (a target-only step
while the draft drafts the next round), and the K chooser must learn from those steps' guesses,
or it never sees a draft evaluated and speculates on its prior for good.

On one H200 (random weights of the real pair's shapes, so no draft is accepted; a draft step 0.7
of the target's pass) the no-flag K chooser chose pipelining and then caught up in every round:
0.49x target-only (bench/results/gpu-h200-captured/). In-process table services here, costed
as that card measured them."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from coordinator import requests as coordinator_requests
from coordinator import server as coordinator_server
from coordinator.branches import Branches
from coordinator.config import CoordinatorConfig
from coordinator.requests import GenerationRequest
from specdec.engine.modeling import tokenizer_fingerprint
from tests.stack import configured
from tests.table_services import TableDraft, TableModel, TableTarget

CARD_MS = (3.1, 4.4)  # a draft step and a target pass on one H200 (bench/profiles/h200-captured-*)


async def test_a_chooser_whose_pre_drafts_all_miss_learns_to_stop_speculating(word_pair, monkeypatch):
    # Unseeded requests (K learned across them), their seeds drawn here from a fixed stream: one
    # whose third request verified one draft, then caught up in 44 of its 47 rounds while each
    # step needed only some draft verified before it, ever (since: one verified since the last).
    draws = random.Random(34)
    monkeypatch.setattr(coordinator_requests.secrets, "randbits", draws.getrandbits)
    target_model = TableModel(24, salt=1, logit_scale=4.0)
    draft_model = TableModel(24, salt=2, logit_scale=4.0)  # its own table: it agrees by chance alone
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(word_pair.target))
    draft = TableDraft(draft_model, fingerprint, pass_ms=(CARD_MS[0],) * 9)
    target = TableTarget(target_model, fingerprint, pass_ms=(CARD_MS[1],) * 9)
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=str(word_pair.target), metrics_port=-1
        ),
        {"pipeline": True},
    )
    engine = await coordinator_server.connect(config, draft, target, rules)
    stats = []
    try:
        for prompt in ((1, 0, 1), (2, 3), (5, 1, 4)):
            request = GenerationRequest(prompt_token_ids=prompt, max_new_tokens=48, temperature=1.0)  # unseeded
            async for chunk in engine.generate(request):
                if chunk.stats is not None:
                    stats.append(chunk.stats)
    finally:
        engine.close()
        await engine.wait_cleanup()
    rounds = sum(len(s.k_per_round) for s in stats)
    catch_ups = sum(s.catch_up_rounds for s in stats)
    assert catch_ups, "the request never caught up: the case is not exercised"
    # Learned from its verified drafts, the chooser settles at K = 0 (multi-step target-only
    # calls) and only probes: 6-11 catch-ups in 141-144 rounds over forty streams of seeds
    # (18-56, eight of them over a fifth, when a step needed one draft verified ever). Never
    # learning, it caught up in 43-125 of them.
    assert catch_ups < 0.2 * rounds, (catch_ups, rounds)


async def test_a_catch_ups_right_guess_that_stopped_on_confidence_counts_as_accepted(word_pair, monkeypatch):
    """A catch-up's pre-draft whose guess was the step's token is one accepted draft for the K
    chooser, also where it stopped on confidence right after its guess (so the next round
    cannot take it): it once counted as a rejection, dragging α down."""
    table = TableModel(24, salt=1, logit_scale=1.5)
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(word_pair.target))
    # The draft is the target; a confidence stop above any token's probability here: every
    # pre-draft stops at its guess.
    draft = TableDraft(table, fingerprint, pass_ms=(CARD_MS[0],) * 9, min_confidence=0.99)
    target = TableTarget(table, fingerprint, pass_ms=(CARD_MS[1],) * 9)
    config, rules = configured(
        CoordinatorConfig(
            draft_address=draft.address, target_address=target.address, tokenizer=str(word_pair.target), metrics_port=-1
        ),
        {"pipeline": True},
    )
    seen = []  # (the pre-draft's guess, the step's token, Settled.guessed) of each catch-up
    take = Branches._take

    def spy(self, call, reply, hit, outcome, proposed, *args):
        settled = take(self, call, reply, hit, outcome, proposed, *args)
        if settled.guessed is not None:
            guess = reply.results[call.branches.index(call.predraft)].proposal.token_ids[0]
            seen.append((guess, outcome.next_token_id, settled.guessed))
        return settled

    monkeypatch.setattr(Branches, "_take", spy)
    engine = await coordinator_server.connect(config, draft, target, rules)
    try:
        for seed in range(8):
            request = GenerationRequest(prompt_token_ids=(1, 0, 1), max_new_tokens=64, temperature=1.0, seed=seed)
            async for _ in engine.generate(request):
                pass
    finally:
        engine.close()
        await engine.wait_cleanup()
    assert any(guess == token for guess, token, _ in seen), f"no catch-up guessed right: not exercised ({seen})"
    assert all(guessed == (guess == token) for guess, token, guessed in seen), seen
