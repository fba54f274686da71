"""Sampled output through the real services has the target's distribution.

A 12-token tiny pair lets us compute the target's exact distribution over whole 3-token
continuations by enumeration (1 + 12 + 144 forward passes), then compare thousands of
seeded speculative generations against it with a χ² test at a fixed bound. Each case
exercises one wire form of the draft distribution: dense (the draft samples its full
distribution), sparse (the draft truncates to its top-k, or its output head covers only part
of the vocabulary) and one-hot (greedy proposals, prompt lookup), plus a target whose top-k
gives most tokens probability 0, each drafter of the draft service, and the coordinator's
modes (pre-drafts, hedges, the K chooser, confidence stops) as the real services serve them.
Each coordinator mode's own high-power test, with a mutation check that it fails when that
mode's path is made inexact, is in test_mode_distributions.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service import batched, stepping, trees
from specdec.engine.costs import PassCosts
from specdec.engine.quantize import quantize_int8
from specdec.sampling import probs as probs_module
from specdec.sampling import together as together_module
from specdec.sampling import tree_sampling
from specdec.sampling.probs import RowSupport, SamplingParams, biased, logits_to_probs, penalized
from specdec.v1 import coordinator_pb2 as pb
from target_service import verification as verification_module
from tests.stack import inprocess_stack, local_stack
from tests.stats import MUTANT_P_VALUE, P_VALUE_FLOOR, chi_square_p_value, mutant_p_value

PROMPT = [3, 7]
LENGTH = 3
NUM_DRAFT = 2
SAMPLES = 3000
CONCURRENCY = 16
# Many concurrent requests in big batches: fewer tiny forward passes, which are most of these
# tests' time (hedges open forks beside each session, hence the session limit). Over the wire
# too: 42 -> 34 s for a case.
LOCAL_CONCURRENCY = 64
LOCAL_BATCH = {"max_batch_size": 32, "max_sessions": 256}

# A prompt whose tokens recur, so the prompt-lookup drafter proposes in most rounds.
REPEATING_PROMPT = [3, 7, 5, 3, 7]
T1 = SamplingParams(temperature=1.0)
LOGIT_BIAS = SamplingParams(temperature=1.0, logit_bias=((2, 3.0), (5, -100.0), (9, -2.0)))
PENALTIES = SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2)
PIPELINED = {"pipeline": True}


@dataclass(frozen=True)
class Case:
    draft: dict  # draft service overrides
    params: SamplingParams = T1
    prompt: tuple[int, ...] = tuple(PROMPT)
    coordinator: dict = field(default_factory=dict)  # coordinator overrides (modes)
    length: int = LENGTH
    k: int | None = NUM_DRAFT  # None: the coordinator chooses (adaptive K)
    target: dict = field(default_factory=dict)  # target service overrides
    # (draft ms per step, target ms per pass) set as the services' calibrated costs, so the
    # K chooser has figures to choose from: a cheap draft and a flat verify make it speculate.
    costs: tuple[float, float] | None = None
    tree: tuple[int, ...] = ()  # tree speculation with these widths (k must then be None)
    seeded: bool = True  # False: requests leave their seed unset (a seeded sampled one copies only from itself)
    # DraftRunner arguments that are no flags (proposal_mode, proposal_top_k; tests/stack.py).
    runner: dict = field(default_factory=dict)


# Drafts half as dear as a verify: the pipelined cases settle at K = 1, so rounds continue
# from pre-drafts.
PIPELINED_CHOOSER_COSTS = (20.0, 40.0)
# Both services keep prompt blocks of 2 tokens: every request after the first starts from
# 2 cached blocks of REPEATING_PROMPT.
PREFIX_CACHE = {"prefix_cache_bytes": 1 << 22, "prefix_block_tokens": 2}

CASES = {
    "dense_full_draft_distribution": Case({"quantize": "none"}, runner={"proposal_top_k": 0}),
    "dense_int8_draft": Case({"quantize": "int8"}, runner={"proposal_top_k": 0}),
    "sparse_draft_top_k": Case({}, runner={"proposal_top_k": 3}),
    "sparse_reduced_vocab_head": Case({"draft_vocab": 6}),
    "one_hot_greedy_proposals": Case({}, runner={"proposal_mode": "greedy"}),
    "one_hot_ngram_prompt_lookup": Case(
        {"drafter": "ngram", "ngram_min": 1, "ngram_max": 3}, prompt=tuple(REPEATING_PROMPT)
    ),
    # Lookup where the sequence's last n-gram recurs, the model elsewhere: both kinds of rows
    # in one generation, and the model's cache catching up on copied tokens.
    "hybrid_lookup_then_model": Case(
        {"drafter": "hybrid", "quantize": "none", "ngram_min": 1, "ngram_max": 3}, prompt=tuple(REPEATING_PROMPT)
    ),
    # The chooser with a hybrid draft: model drafts at the model's K (a draft half as dear as
    # a verify), copies at a length chosen apart, copy-only calls where the model's K is 0.
    "hybrid_copies_chosen_apart": Case(
        {"drafter": "hybrid", "quantize": "none", "ngram_min": 1, "ngram_max": 3},
        prompt=tuple(REPEATING_PROMPT),
        coordinator={},
        k=None,
        costs=PIPELINED_CHOOSER_COSTS,
    ),
    # Issue 37: cache hits on both services, and the suffix drafter copying from earlier
    # requests' outputs as well as from the request itself. Unseeded, so proposals come from
    # the store: a seeded sampled request copies only from its own sequence.
    "suffix_store_and_prefix_cache_hits": Case(
        {"drafter": "suffix", "quantize": "none", "ngram_min": 1, **PREFIX_CACHE},
        prompt=tuple(REPEATING_PROMPT),
        target=PREFIX_CACHE,
        seeded=False,
    ),
    "target_top_k_top_p_zeros": Case({}, SamplingParams(temperature=0.8, top_k=4, top_p=0.9)),
    # The target's biased logits, one token banned; the draft proposes unbiased.
    "target_logit_bias": Case({"quantize": "none"}, LOGIT_BIAS, length=2),
    # Each row penalised for the prompt, the output and the drafts before it.
    "target_penalties": Case({"quantize": "none"}, PENALTIES, length=2),
    # The coordinator's modes through the real services: branches forked and stepped together
    # in the real draft, sparse rows, confidence stops and the K chooser. Each mode's own
    # high-power test, with a mutation check, is in test_mode_distributions.py.
    # Without catch-up steps (the next case has them), so rounds after a miss draft afresh
    # and stale pre-drafts are cancelled within the 4 tokens.
    # K = 2: a pre-draft's first token is the draft's argmax (a guess, rarely unsure), so a
    # confidence stop comes after a drawn token, which K = 1 calls never reach.
    "pipelined_hedged_confidence_stops": Case(
        {"quantize": "none", "min_confidence": 0.3},
        coordinator={"pipeline": True, "hedges": 1, "catch_up": False},
        length=4,
        k=2,
    ),
    # Bonus guesses with hedges, at the default confidence, have their test with power:
    # test_powered_distribution.py's all_hedged_bonus_guesses.
    # Catch-up steps: target-only rounds while the pre-draft catches the draft session up.
    "pipelined_catch_up_steps": Case({"quantize": "none", "min_confidence": 0.3}, coordinator=PIPELINED, length=4, k=2),
    "adaptive_pipelined_top_k_top_p": Case(
        {},
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
        coordinator={"pipeline": True, "catch_up": False},
        length=4,
        k=None,
        costs=PIPELINED_CHOOSER_COSTS,
        runner={"proposal_top_k": 4},
    ),
    "confidence_stop_greedy_proposals": Case(
        {"min_confidence": 0.5}, length=4, k=3, runner={"proposal_mode": "greedy"}
    ),
    # An int8 target: the output is the int8 model's own distribution.
    "int8_target": Case({"quantize": "none"}, target={"quantize": "int8"}, length=3, k=2),
    # Token trees (issue 19): i.i.d. sampled children (siblings may repeat), the draft's top-b
    # tokens sent one-hot, and an int8 target scoring the tree with its row-wise attention.
    "tree_iid_sampled_children": Case({"quantize": "none"}, k=None, tree=(2, 2)),
    "tree_top_b_one_hot_children": Case({}, k=None, tree=(3, 1), runner={"proposal_mode": "greedy"}),
    "tree_int8_target": Case({"quantize": "none"}, target={"quantize": "int8"}, k=None, tree=(2, 2)),
    # The chooser weighing trees against chains, with flat costs (rows nearly free) where trees pay.
    "tree_chooser": Case({"quantize": "none"}, coordinator={"tree_chooser": True}, k=None, costs=(2.0, 10.0)),
}


# The end-to-end proof over loopback gRPC, one case per wire form of the draft distribution
# (dense, sparse, one-hot); the rest, the coordinator's modes included, run over in-process
# channels (tests/stack.py's local_stack: the same coordinator, servicers and runners, messages
# serialised and parsed, no sockets), which is twice as fast and tests the same math.
# tests/serial/test_processes.py runs pipelining with hedges across real processes.
OVER_THE_WIRE = frozenset({"dense_full_draft_distribution", "sparse_draft_top_k", "one_hot_ngram_prompt_lookup"})


def batch_invariant(draft: dict) -> bool:
    """Whether the draft proposes the same for a request whichever requests share its passes
    (up to float32 rounding): a float32 model or prompt lookup, not an int8 model."""
    return draft.get("quantize") == "none" or draft.get("drafter") == "ngram"


def exact_target_distribution(
    model_dir,
    params: SamplingParams,
    vocab: int,
    prompt: list[int] = PROMPT,
    length: int = LENGTH,
    int8: bool = False,
    eos_token_ids: tuple[int, ...] = (),
) -> dict[tuple[int, ...], float]:
    """Probability of every `length`-token continuation of `prompt` under the target (its int8
    form if `int8`), by enumeration; a continuation that reaches an EOS id ends there."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if int8:
        quantize_int8(model)
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            # Every live prefix of this length in one batched pass (same length: no padding).
            live = [prefix for prefix, p in probs.items() if p > 0.0 and not (prefix and prefix[-1] in eos_token_ids)]
            rows = {}
            for start in range(0, len(live), 512):
                chunk = live[start : start + 512]
                logits = model(torch.tensor([prompt + list(prefix) for prefix in chunk])).logits[:, -1]  # [N, V]
                biased_logits = biased(logits, params)  # [N, V]: the bias, then each row's penalties
                scored = torch.cat(
                    [
                        penalized(biased_logits[j : j + 1], params, prompt + list(prefix), len(prompt))
                        for j, prefix in enumerate(chunk)
                    ]
                )  # [N, V]
                rows.update(zip(chunk, logits_to_probs(scored, params)))
            extended = {}
            for prefix, prefix_prob in probs.items():
                if prefix and prefix[-1] in eos_token_ids:
                    extended[prefix] = prefix_prob  # generation ended at EOS
                    continue
                row = rows.get(prefix)
                for token in range(vocab):
                    extended[prefix + (token,)] = prefix_prob * float(row[token]) if row is not None else 0.0
            probs = extended
    return probs


async def sample_continuations(
    stub,
    params: SamplingParams,
    seeds,
    prompt=PROMPT,
    length: int = LENGTH,
    k: int | None = NUM_DRAFT,
    stats=None,
    concurrency: int = CONCURRENCY,
    tree: tuple[int, ...] = (),
    seeded: bool = True,
):
    """Seeded generations of `length` tokens; `stats`, if given, collects each response's stats."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> tuple[int, ...]:
        async with semaphore:
            response = await stub.Generate(
                pb.GenerateRequest(
                    prompt_token_ids=list(prompt),
                    max_new_tokens=length,
                    num_speculative_tokens=k,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    logit_bias=dict(params.logit_bias),
                    presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty,
                    repetition_penalty=params.repetition_penalty,
                    seed=seed if seeded else None,
                    tree_widths=tree,
                ),
                timeout=60,
            )
            collected.append(response.stats)
            return tuple(response.token_ids)

    collected = [] if stats is None else stats
    samples = await asyncio.gather(*(one(seed) for seed in seeds))
    assert sum(s.proposed_tokens for s in collected) > 0, "the draft never proposed, so nothing was tested"
    return samples


@pytest.mark.parametrize("case", sorted(CASES))
async def test_sampled_output_has_target_distribution(word_pair, case):
    c = CASES[case]
    expected = exact_target_distribution(
        word_pair.target,
        c.params,
        word_pair.vocab_size,
        list(c.prompt),
        c.length,
        int8=c.target.get("quantize") == "int8",
    )

    def set_costs(draft_runner, target_runner) -> None:
        if c.costs is not None:
            draft_runner.pass_costs = PassCosts((c.costs[0],) * 9, context_tokens=128)
            target_runner.pass_costs = PassCosts((c.costs[1],) * 9, context_tokens=128)

    make_stack = inprocess_stack if case in OVER_THE_WIRE else local_stack
    draft, target = {**LOCAL_BATCH, **c.draft}, {**LOCAL_BATCH, **c.target}
    async with make_stack(
        word_pair,
        draft_overrides=draft,
        # Set costs stand for every round's, not the word pair's live passes.
        coordinator_overrides=c.coordinator if c.costs is None else {**c.coordinator, "live_costs": False},
        target_overrides=target,
        prepare_runners=set_costs,
        draft_runner_overrides=c.runner,
    ) as stack:
        stats: list = []
        samples = await sample_continuations(
            stack.stub, c.params, range(SAMPLES), c.prompt, c.length, c.k, stats, LOCAL_CONCURRENCY, c.tree, c.seeded
        )
        repeat = await sample_continuations(stack.stub, c.params, range(20), c.prompt, c.length, c.k, tree=c.tree)
        prefix_hits = stack.target_runner.sessions.prefix.hits if c.target.get("prefix_cache_bytes") else 0
    # The K chooser works from figures fixed at start-up, so a seed reproduces with it too.
    if batch_invariant(c.draft) and c.seeded:
        assert repeat == samples[:20], "the same seed must give the same output"
    if c.target.get("prefix_cache_bytes"):
        assert prefix_hits > SAMPLES // 2, f"only {prefix_hits} target sessions started from cached blocks"
    if c.costs is not None:
        assert any(len(set(s.k_per_round)) > 1 or 0 < s.proposed_tokens for s in stats), "the chooser never speculated"
    if c.draft.get("min_confidence"):
        assert stack.draft_runner.confidence_stops > 0, "no proposal stopped on confidence; the case tests nothing new"
    if c.draft.get("drafter") == "suffix":
        # Over 12 tokens the store of earlier outputs nearly always holds a continuation.
        assert sum(s.copied_rounds for s in stats) > SAMPLES // 2, "the suffix drafter rarely copied"
    if c.draft.get("drafter") == "hybrid":
        # Both kinds of row in the sample: copies and model drafts.
        copied = sum(s.copied_rounds for s in stats)
        drafted = sum(1 for s in stats for k in s.k_per_round if k) - copied
        assert copied > SAMPLES // 10 and drafted > SAMPLES // 10, (copied, drafted)
    assert all(len(s) == c.length for s in samples)
    if c.coordinator.get("tree_chooser"):
        assert sum(s.tree_rounds for s in stats) > SAMPLES // 2, "the chooser rarely chose a tree"
    if c.tree:
        # Every round is a tree but one with no room left for drafts (one token to go), and
        # any the draft could not serve in time (a fallback: one target-only step, exact too;
        # a loaded CI machine sees a few).
        odd = [s for s in stats if s.tree_rounds + s.fallback_rounds < s.rounds - 1]
        shown = [(s.rounds, s.tree_rounds, s.fallback_rounds, s.draft_failures, list(s.k_per_round)) for s in odd]
        assert not odd, f"(rounds, tree rounds, fallbacks, draft failures, K per round): {shown[:5]}"
        fallbacks = sum(s.fallback_rounds for s in stats)
        assert fallbacks < SAMPLES // 20, f"{fallbacks} fallback rounds; the draft barely served trees"
        accepted = sum(s.accepted_tokens for s in stats)
        assert accepted > SAMPLES // 2, f"only {accepted} tree nodes were accepted; the tree path is barely exercised"
    if c.coordinator.get("pipeline"):
        hits = sum(s.predraft_hits for s in stats)
        # With K=1 most requests pre-draft; adaptive K often fills the 4 tokens in one round.
        assert hits > (SAMPLES // 50 if c.k else 0), (
            f"only {hits} pre-drafts were used; the pipelined path is barely exercised"
        )
        if c.coordinator.get("catch_up", True):
            # The first round and any after a miss are catch-up steps, whose pre-drafts a
            # rejection cannot cancel (they carry no drafts).
            steps = sum(s.catch_up_rounds for s in stats)
            assert steps >= SAMPLES, f"only {steps} catch-up steps in {SAMPLES} requests"
        else:
            assert sum(s.predraft_cancelled for s in stats) > 0
    if c.coordinator.get("hedges"):
        hits = sum(s.hedge_hits for s in stats)
        assert hits > SAMPLES // 50, f"only {hits} hedges were used; the hedged path is barely exercised"
    zero = {seq for seq, p in expected.items() if p == 0.0}
    assert not zero.intersection(samples), "emitted a continuation the target gives probability 0"
    p_value = chi_square_p_value(samples, expected)
    assert p_value > P_VALUE_FLOOR, f"{case}: χ² p-value {p_value:.2e}; output is not the target's distribution"


async def test_distribution_test_detects_the_draft_distribution(word_pair):
    """Power check: the draft's own samples (K = 0 through a stack whose target is the draft
    model) must fail the same test against the target's distribution."""
    params = SamplingParams(temperature=1.0)
    expected = exact_target_distribution(word_pair.target, params, word_pair.vocab_size)
    swapped = type(word_pair)(
        target=word_pair.draft, draft=word_pair.draft, vocab_size=word_pair.vocab_size, eos_token_id=None
    )
    async with local_stack(swapped, draft_overrides=LOCAL_BATCH, target_overrides=LOCAL_BATCH) as stack:
        samples = await sample_continuations(stack.stub, params, range(SAMPLES), concurrency=LOCAL_CONCURRENCY)
    assert chi_square_p_value(samples, expected) < 1e-6


async def test_tree_distribution_test_detects_siblings_tried_against_the_target_itself(word_pair, monkeypatch):
    """Power check for trees through the services: a target that tries every sibling against
    its own distribution (no residual between siblings; the recovered token from p) must fail."""
    monkeypatch.setattr(tree_sampling, "residual_probs", lambda target_probs, draft_probs: target_probs)
    params = SamplingParams(temperature=1.0)
    expected = exact_target_distribution(word_pair.target, params, word_pair.vocab_size)
    draft = {**LOCAL_BATCH, "quantize": "none"}
    async with local_stack(word_pair, draft_overrides=draft, target_overrides=LOCAL_BATCH) as stack:
        p_value, _ = await mutant_p_value(
            lambda seeds: sample_continuations(
                stack.stub, params, seeds, k=None, concurrency=LOCAL_CONCURRENCY, tree=(3, 1)
            ),
            expected,
            SAMPLES,
        )
    assert p_value < MUTANT_P_VALUE


async def two_token_p_value(word_pair, params: SamplingParams) -> float:
    """A mutant check's χ² p-value (tests/stats.py, `mutant_p_value`: up to SAMPLES two-token
    continuations through the services, an unquantised model draft) against the target's
    exact distribution under `params`."""
    expected = exact_target_distribution(word_pair.target, params, word_pair.vocab_size, length=2)
    draft = {**LOCAL_BATCH, "quantize": "none"}
    async with local_stack(word_pair, draft_overrides=draft, target_overrides=LOCAL_BATCH) as stack:
        p_value, _ = await mutant_p_value(
            lambda seeds: sample_continuations(stack.stub, params, seeds, length=2, concurrency=LOCAL_CONCURRENCY),
            expected,
            SAMPLES,
        )
    return p_value


async def test_distribution_test_detects_a_target_that_samples_without_its_logit_bias(word_pair, monkeypatch):
    """Mutant for the logit_bias case: the target biases nothing (its argmax and its rows
    alike, alone or with the other calls of its pass), so the banned token comes back and the
    χ² test must fail."""
    for module in (verification_module, together_module):
        monkeypatch.setattr(module, "biased", lambda logits, params: logits)
    assert await two_token_p_value(word_pair, LOGIT_BIAS) < MUTANT_P_VALUE


async def test_distribution_test_detects_a_target_that_penalises_rows_without_their_drafts(word_pair, monkeypatch):
    """Mutant for the penalties case: each row is penalised for the sequence before the round
    only, not for the drafts before it, as a target that counted the session's committed tokens
    would; the χ² test must fail."""
    plain = verification_module.penalized
    monkeypatch.setattr(
        verification_module,
        "penalized",
        lambda logits, params, history, start, drafts=(): plain(logits, params, history, start),
    )
    assert await two_token_p_value(word_pair, PENALTIES) < MUTANT_P_VALUE


async def test_distribution_test_detects_a_draft_that_sends_other_entries_than_it_drew_from(word_pair, monkeypatch):
    """Mutant for the sampled rows' entries, which the wire sends without reading the rows
    (probs.RowSupport, fetched with each step's token): each row's entries half flattened over
    its support, still summing to one, so the target takes them and only the χ² test can tell."""
    plain = probs_module.support_of

    def flattened(parts: list[float]) -> RowSupport | None:
        support = plain(parts)
        return support and RowSupport(support.ids, 0.5 * support.values + 0.5 / len(support.ids))

    for module in (stepping, batched, trees):
        monkeypatch.setattr(module, "support_of", flattened)
    case = CASES["sparse_draft_top_k"]
    expected = exact_target_distribution(word_pair.target, case.params, word_pair.vocab_size, list(case.prompt))
    draft = {**LOCAL_BATCH, **case.draft}
    async with local_stack(word_pair, draft, target_overrides=LOCAL_BATCH, draft_runner_overrides=case.runner) as stack:
        p_value, _ = await mutant_p_value(
            lambda seeds: sample_continuations(stack.stub, case.params, seeds, concurrency=LOCAL_CONCURRENCY),
            expected,
            SAMPLES,
        )
    assert p_value < MUTANT_P_VALUE
