"""The K chooser: Leviathan's expected tokens over the round time built from measured pass
costs, K = 0 included; pure functions."""

from __future__ import annotations

import dataclasses
import random

import pytest

from coordinator.adaptive import LOAD_GAIN, AdaptiveK
from coordinator.round_costs import BatchCosts, RoundCosts, best_k, expected_tokens, expected_tree_tokens

# Shapes of the cost curves measured on real machines (ms per pass over 1..9 new tokens).
FLAT_TARGET = tuple(150.0 + 5.0 * n for n in range(9))  # int8 1.5B on 2 AVX2 cores: ~flat to 5
STEEP_TARGET = tuple(300.0 * (n + 1) for n in range(9))  # bf16 on AVX2: a 5-token pass ≈ 3-5× one
CHEAP_DRAFT = (20.0,) * 9
DEAR_DRAFT = (100.0,) * 9  # a draft two thirds as slow as the target


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.7, 0) == 1.0


def test_round_costs_add_draft_steps_verify_pass_and_rpcs():
    costs = RoundCosts(CHEAP_DRAFT, FLAT_TARGET, draft_rpc_ms=2.0, target_rpc_ms=3.0)
    assert costs.round_ms(0, 0.5, pipelined=False) == pytest.approx(3.0 + 150.0)  # no draft call at all
    assert costs.round_ms(4, 0.5, pipelined=False) == pytest.approx(2.0 + 4 * 20.0 + 3.0 + FLAT_TARGET[4])
    # Pipelined, the draft is paid only when its pre-draft is not used (prob ≈ 1 − α^(K+1)).
    assert costs.round_ms(4, 1.0, pipelined=True) == pytest.approx(3.0 + FLAT_TARGET[4])
    # Past the calibrated sizes, costs are extrapolated from the curve's slope.
    assert costs.verify_ms(12) == pytest.approx(3.0 + FLAT_TARGET[-1] + 5.0 * 4)


def test_best_k_is_zero_when_verifying_more_tokens_costs_several_times_one():
    costs = RoundCosts(CHEAP_DRAFT, STEEP_TARGET)
    for alpha in (0.3, 0.6, 0.8):
        assert best_k(alpha, costs, 8, pipelined=False) == 0


def test_batched_passes_interpolate_between_measured_sizes_and_split_past_the_largest():
    batch = BatchCosts((10.0, 11.0, 12.0), ((2, 1, 14.0), (2, 3, 20.0), (4, 1, 18.0), (4, 3, 30.0)), max_batch=4)
    assert batch.pass_ms(1, 2) == 11.0  # one session: its own curve
    assert batch.pass_ms(2, 2) == pytest.approx(17.0)  # between 1 and 3 new tokens
    assert batch.pass_ms(3, 1) == pytest.approx(16.0)  # between 2 and 4 sessions
    assert batch.load_ms(8, 1) == pytest.approx(2 * 18.0)  # two passes of four
    assert BatchCosts((10.0, 20.0, 30.0)).pass_ms(3, 1) == 30.0  # unmeasured: one pass over all tokens


def test_under_load_speculation_stops_where_a_batch_of_every_sessions_drafts_costs_more_than_it_commits():
    """A CPU-like target whose batched passes cost by the token: K > 0 alone, K = 0 at eight
    sessions. An accelerator-like one, flat in the batch: speculation still pays at eight."""
    single = tuple(50.0 + 10.0 * n for n in range(9))
    cpu = BatchCosts(single, tuple((b, n, 40.0 + 12.0 * b * n) for b in (2, 4, 8) for n in (1, 9)), max_batch=8)
    gpu = BatchCosts(single, tuple((b, n, 55.0 + 0.2 * b * n) for b in (2, 4, 8) for n in (1, 9)), max_batch=8)
    draft = BatchCosts((5.0,) * 9, tuple((b, n, 5.0 + b) for b in (2, 4, 8) for n in (1, 9)), max_batch=8)
    for target, at_eight in ((cpu, 0), (gpu, None)):
        costs = RoundCosts((5.0,) * 9, single, draft_batch=draft, target_batch=target)
        assert best_k(0.7, costs, 8, pipelined=False) > 0
        loaded = best_k(0.7, costs.at_load(8, 8), 8, pipelined=False)
        assert loaded == at_eight if at_eight is not None else loaded > 0
        # The K chosen never commits fewer tokens per millisecond than target-only steps.
        assert costs.at_load(8, 8).tokens_per_ms(loaded, 0.7, False) >= costs.at_load(8, 8).tokens_per_ms(0, 0.7, False)


def test_best_k_is_zero_when_the_draft_is_dear_and_acceptance_is_low():
    assert best_k(0.3, RoundCosts(DEAR_DRAFT, FLAT_TARGET), 8, pipelined=False) == 0
    # ... but not when acceptance is high.
    assert best_k(0.95, RoundCosts(DEAR_DRAFT, FLAT_TARGET), 8, pipelined=False) >= 1


def test_best_k_grows_with_acceptance_and_cheaper_drafts():
    cheap = RoundCosts(CHEAP_DRAFT, FLAT_TARGET)
    dear = RoundCosts(tuple(60.0 for _ in range(9)), FLAT_TARGET)
    assert best_k(0.9, cheap, 8, pipelined=False) >= 5
    assert best_k(0.5, cheap, 8, pipelined=False) < best_k(0.9, cheap, 8, pipelined=False)
    assert best_k(0.8, dear, 8, pipelined=False) < best_k(0.8, cheap, 8, pipelined=False)
    # Hiding the draft behind the verify makes longer drafts pay.
    assert best_k(0.8, dear, 8, pipelined=True) >= best_k(0.8, dear, 8, pipelined=False)


def test_chooser_settles_at_zero_and_probes_now_and_then():
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=RoundCosts(CHEAP_DRAFT, STEEP_TARGET), probe_every=4)
    ks = [chooser.choose() for _ in range(15)]
    assert ks == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_chooser_learns_acceptance_and_leaves_zero_when_speculation_pays_again():
    # A dear draft: speculation pays only at high acceptance. Low acceptance → K = 0 ...
    chooser = AdaptiveK(
        k_max=8, pipelined=False, costs=RoundCosts(DEAR_DRAFT, FLAT_TARGET), alpha_prior=0.2, probe_every=2
    )
    assert chooser.choose() == 0
    # ... then every probe is accepted in full (a code block the draft knows by heart).
    for _ in range(12):
        k = chooser.choose()
        if k:
            chooser.observe_round(k, k)
    assert chooser.alpha > 0.75
    assert chooser.history[-2:] == [1, 1]  # no longer waiting for probes
    assert chooser.choose() >= 1


# Measured at start-up on the AVX-512 machine (int8 pair, 2 threads): a draft step is 0.65 of
# a one-token target pass, so speculation pays only at high acceptance.
MEASURED_DRAFT = (35.5,) * 9
MEASURED_TARGET = (55.0, 60.0, 65.0, 71.0, 77.0, 86.0, 94.0, 109.0, 114.0)


@pytest.mark.parametrize("drafts_good", [True, False])
def test_an_early_rejection_does_not_park_a_request_for_the_full_probe_interval(drafts_good):
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=RoundCosts(MEASURED_DRAFT, MEASURED_TARGET, 0.7, 0.7))
    for round_index in range(40):
        k = chooser.choose()
        if k:  # the first round's draft is rejected; then every draft is accepted, or none
            chooser.observe_round(k, k if drafts_good and round_index else 0)
    ks = chooser.history
    assert ks[:4] == [1, 0, 0, 1], ks  # probed again after two K = 0 rounds, not eight
    if drafts_good:
        assert all(ks[3:]), ks
    else:  # once the estimate is sure, probes are as rare as ever
        assert sum(1 for k in ks[16:] if k) <= 3, ks


# One H200's captured passes (bench/profiles/h200-captured-*.json, 1.5B target, 0.5B draft):
# a draft step is 0.73 of a one-token target pass, and verifying 9 tokens costs 1.11 of one.
CAPTURED_TARGET = (4.2, 4.6, 4.61, 4.62, 4.63, 4.64, 4.65, 4.66, 4.67)
CAPTURED_DRAFT = (3.09,) * 9


def test_a_hunch_drafts_the_best_k_for_the_estimate_not_one_draft():
    """Target-only wins at α 0.9 here, and K > 0 would pay an α one standard error higher, so
    the round drafts on a hunch: at K = 3, the best K > 0 at 0.9 (0.98 of target-only's rate),
    not one draft (0.90, the worst)."""
    costs = RoundCosts(CAPTURED_DRAFT, CAPTURED_TARGET, 0.8, 0.8, target_only_steps=4)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.9)
    assert best_k(chooser.alpha, costs, 8, pipelined=False) == 0
    assert best_k(chooser.optimistic_alpha, costs, 8, pipelined=False) > 0
    assert chooser.pick() == 3
    assert chooser.gain(3, 0.9) > 0.97 > 0.91 > chooser.gain(1, 0.9)


def test_chooser_history_depends_only_on_outcomes():
    """No clocks: the same outcomes give the same Ks (a seed's output is reproducible)."""

    def run() -> list[int]:
        chooser = AdaptiveK(k_max=8, pipelined=False, costs=RoundCosts(CHEAP_DRAFT, FLAT_TARGET))
        for round_index in range(20):
            k = chooser.choose()
            chooser.observe_round(k, min(k, round_index % 3))
        return chooser.history

    assert run() == run()


def test_a_width_one_tree_is_the_chain():
    for alpha in (0.2, 0.74, 0.95):
        for depth in (1, 3, 5):
            assert expected_tree_tokens(alpha, 0.5, 1, depth) == pytest.approx(expected_tokens(alpha, depth))
    # A second root candidate adds its chance after the first's rejection, times the chain below.
    assert expected_tree_tokens(0.5, 0.4, 2, 2) == pytest.approx(1 + (0.5 + 0.5 * 0.4) * (1 + 0.5))


def test_trees_are_chosen_only_where_they_pay():
    """This machine's measured costs (a node costs a verify row, a level a draft pass) and the
    measured acceptance: chains. Rows nearly free and a cheap batched draft (a GPU) with a
    draft whose runner-up is often right: a tree."""
    measured = RoundCosts(MEASURED_DRAFT, MEASURED_TARGET, 0.7, 0.7)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=measured, alpha_prior=0.74, trees=True)
    assert chooser.choose_shape()[1] == ()
    gpu_like = RoundCosts((2.0,) * 9, (10.0,) * 8 + (10.5,), 0.3, 0.3)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=gpu_like, alpha_prior=0.6, beta_prior=0.5, trees=True)
    k, widths = chooser.choose_shape()
    assert k == 0 and widths[0] in (2, 3) and set(widths[1:]) <= {1}
    # Pipelined coordinators never get a tree (it cannot be pre-drafted).
    chooser = AdaptiveK(k_max=8, pipelined=True, costs=gpu_like, alpha_prior=0.6, beta_prior=0.5, trees=True)
    assert chooser.choose_shape()[1] == ()
    # Under load a tree's one-session price would be weighed against a chain's at the load,
    # where four sessions' verifies cost four passes: chains only.
    batch = BatchCosts((10.0,) * 8 + (10.5,), ((4, 1, 40.0), (4, 9, 60.0)), 8)
    loaded = dataclasses.replace(gpu_like, target_batch=batch).at_load(4, 1)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=loaded, alpha_prior=0.6, beta_prior=0.5, trees=True)
    assert chooser.choose_shape()[1] == ()


def test_tree_rounds_teach_alpha_and_beta():
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=RoundCosts(MEASURED_DRAFT, MEASURED_TARGET), trees=True)
    alpha_before, beta_before = chooser.alpha, chooser.beta
    for _ in range(20):  # (2, 1, 1): the first candidate always rejected, the runner-up and its chain accepted
        chooser.observe_tree((2, 1, 1), [2, 4, 6])
    assert chooser.beta > beta_before + 0.3
    assert chooser.alpha < alpha_before + 0.15  # 20 rejections of the first child against 40 chain acceptances
    for _ in range(20):  # every candidate rejected: β trials fail
        chooser.observe_tree((3, 1), [])
    assert chooser.beta < 0.6


def test_a_pipelined_round_waits_for_drafts_that_outlast_the_verify_and_hedges_cut_misses():
    """Pipelined, the next round's K + 1 draft steps run during the verify and are on the
    critical path only past its end; a miss (probability 1 − α^(K+1) − (1 − α^K)·ρ, ρ the hedges'
    hit rate given a rejection) pays a fresh draft."""
    costs = RoundCosts(CHEAP_DRAFT, FLAT_TARGET, draft_rpc_ms=2.0, target_rpc_ms=3.0)
    verify, draft = costs.verify_ms(4), costs.draft_ms(4)
    assert costs.round_ms(4, 0.8, pipelined=True) == pytest.approx(verify + (1 - 0.8**5) * draft)
    rescued = costs.round_ms(4, 0.8, pipelined=True, rescue=0.6)
    assert rescued == pytest.approx(verify + (1 - 0.8**5 - (1 - 0.8**4) * 0.6) * draft)
    slow = RoundCosts(tuple(60.0 for _ in range(9)), FLAT_TARGET)  # 5 steps: 300 ms against a 150 ms verify
    assert slow.round_ms(4, 1.0, pipelined=True) == pytest.approx(slow.draft_ms(5))
    assert best_k(0.8, slow, 8, pipelined=True) <= 2, "drafts past the verify's end are not hidden"
    assert best_k(0.8, costs, 8, pipelined=True, rescue=0.8) >= best_k(0.8, costs, 8, pipelined=True)


def test_a_pipelined_round_overlaps_only_alone_on_its_target():
    """Beside other sessions on its target, a pipelined round is costed as a sequential one:
    their verifies fill the target while one session drafts, so hiding that draft saves no
    target time (emulated: pipelined 0.93-0.97x sequential at 8-32 sessions a replica). A draft
    shared with sessions on other targets still overlaps (1.10x, one session a target)."""
    costs = RoundCosts(CHEAP_DRAFT, FLAT_TARGET, draft_rpc_ms=2.0, target_rpc_ms=3.0)
    assert costs.round_ms(4, 0.8, pipelined=True) < costs.round_ms(4, 0.8, pipelined=False)
    shared = costs.at_load(2, 1)
    assert shared.round_ms(4, 0.8, pipelined=True) == shared.round_ms(4, 0.8, pipelined=False)
    draft_shared = dataclasses.replace(costs, draft_batch=BatchCosts(CHEAP_DRAFT, max_batch=8)).at_load(1, 8)
    assert draft_shared.round_ms(4, 0.8, pipelined=True) < draft_shared.round_ms(4, 0.8, pipelined=False)
    chooser = AdaptiveK(k_max=8, pipelined=True, costs=costs)
    assert chooser.overlaps
    chooser.costs = costs.at_load(2, 2)
    assert not chooser.overlaps
    assert not AdaptiveK(k_max=8, pipelined=False, costs=costs).overlaps


def test_the_chooser_learns_how_often_hedges_rescue_a_rejection():
    costs = RoundCosts(CHEAP_DRAFT, FLAT_TARGET)
    assert AdaptiveK(k_max=8, pipelined=True, costs=costs).rescue == 0.0, "no hedges, no rescue"
    chooser = AdaptiveK(k_max=8, pipelined=True, costs=costs, hedged=True)
    assert chooser.rescue == pytest.approx(0.5)
    for hit in (True, True, True, False):
        chooser.observe_rescue(hit)
    assert chooser.rescue == pytest.approx((1 + 3) / (2 + 4))


def test_under_load_a_near_tie_stays_target_only_without_hunches_or_probes():
    """Alone, the chooser drafts on a hunch where K > 0 would pay at a plausibly higher α, and
    probes after K = 0 rounds. Sharing the target, it speculates only for a clear gain
    (LOAD_GAIN): a near tie in the lockstep model was 0.3x target-only on 2 shared cores."""
    single = tuple(50.0 + 2.0 * n for n in range(9))
    target = BatchCosts(single, tuple((b, n, 40.0 + 12.0 * b * n) for b in (2, 4, 8) for n in (1, 9)), max_batch=8)
    draft = BatchCosts((20.0,) * 9, tuple((b, n, 20.0 + 3.0 * b) for b in (2, 4, 8) for n in (1, 9)), max_batch=8)
    costs = RoundCosts((20.0,) * 9, single, draft_batch=draft, target_batch=target)
    loaded = AdaptiveK(k_max=8, pipelined=False, costs=costs.at_load(4, 4), alpha_prior=0.75)
    assert 0.95 < max(loaded.gain(k, 0.999) for k in range(1, 9)) < 1.1  # a near tie at the best acceptance
    ks = []
    for _ in range(30):
        ks.append(loaded.choose())
        loaded.observe_round(ks[-1], ks[-1])
    assert ks == [0] * 30
    alone = AdaptiveK(k_max=8, pipelined=False, costs=costs, alpha_prior=0.75)
    assert alone.choose() > 0


# Passes measured on 2 shared AVX-512 cores (int8 Qwen2.5-Coder 1.5B target, 0.5B draft): one
# session over 1..9 new tokens, and (sessions, new tokens each, ms) batched.
HOST_TARGET = (46.3, 51.6, 51.6, 51.6, 54.5, 57.1, 59.3, 63.6, 69.9)
HOST_DRAFT = (21.2, 24.1, 24.1, 24.1, 24.8, 25.8, 26.4, 26.7, 27.7)
HOST_TARGET_BATCH = BatchCosts(
    HOST_TARGET, ((2, 1, 58.5), (2, 9, 90.9), (4, 1, 60.8), (4, 9, 146.9), (8, 1, 79.4), (8, 9, 440.2)), 8
)
HOST_DRAFT_BATCH = BatchCosts(
    HOST_DRAFT, ((2, 1, 26.4), (2, 9, 37.5), (4, 1, 30.1), (4, 9, 54.6), (8, 1, 39.3), (8, 9, 91.7)), 8
)


def host_costs(shared_host: bool) -> RoundCosts:
    return RoundCosts(HOST_DRAFT, HOST_TARGET, 1.0, 1.0, HOST_DRAFT_BATCH, HOST_TARGET_BATCH, shared_host=shared_host)


def test_on_a_shared_host_the_host_is_costed_as_one_server():
    """C / S_C at K = 0; (C − 1 + E(K)) / (S_{C−1} + V(K) + D(K)) where one session drafts:
    the others step without it, and its draft call and verify run alone. Alone, the
    sequential round."""
    costs = host_costs(shared_host=True)
    loaded = costs.at_load(4, 4)
    assert loaded.tokens_per_ms(0, 0.8, False) == pytest.approx(4 / (1.0 + 60.8))
    others = 1.0 + HOST_TARGET_BATCH.pass_ms(3, 1)
    own = 1.0 + HOST_TARGET[3] + 1.0 + 3 * 21.2
    assert loaded.tokens_per_ms(3, 0.8, False) == pytest.approx((3 + expected_tokens(0.8, 3)) / (others + own))
    assert loaded.tokens_per_ms(3, 0.8, True) == loaded.tokens_per_ms(3, 0.8, False), "nothing overlaps on one CPU"
    alone, apart = costs, host_costs(shared_host=False)
    for k in range(9):
        assert alone.tokens_per_ms(k, 0.8, False) == apart.tokens_per_ms(k, 0.8, False)


def test_on_a_shared_host_under_load_even_drafts_that_are_always_accepted_stay_target_only():
    """What the lockstep model got wrong on 2 shared cores: at 4 sessions it let a session
    whose drafts were all accepted draft 8 tokens a round (a 1.42x gain on paper), while the
    host ran at 0.3-0.4x target-only. Counting the drafts as time taken from every other
    session's pass, the draft pays nowhere near LOAD_GAIN from 2 sessions on. Copies, which
    run no draft pass, still pay where they are nearly always right."""
    apart, shared = host_costs(shared_host=False), host_costs(shared_host=True)
    assert best_k(0.999, apart.at_load(4, 4), 8, pipelined=False) == 8
    for sessions in (2, 4, 8):
        for alpha in (0.7, 0.9, 0.999):
            loaded = shared.at_load(sessions, sessions)
            k = best_k(alpha, loaded, 8, pipelined=False)
            assert loaded.tokens_per_ms(k, alpha, False) < LOAD_GAIN * loaded.tokens_per_ms(0, alpha, False)
    copies = dataclasses.replace(shared, draft_pass_ms=(0.0,) * 9, draft_batch=None).at_load(4, 4)
    assert best_k(0.6, copies, 8, pipelined=False) == 0
    assert copies.tokens_per_ms(8, 0.999, False) > LOAD_GAIN * copies.tokens_per_ms(0, 0.999, False)
    chooser = AdaptiveK(k_max=8, pipelined=False, costs=shared.at_load(4, 4), alpha_prior=0.99)
    ks = []
    for _ in range(30):
        ks.append(chooser.choose())
        chooser.observe_round(ks[-1], ks[-1])
    assert ks == [0] * 30, "no probes either"
    # A draft so cheap that a plausible α would clear the bar: the lockstep model probes, the
    # shared host does not.
    cheap = RoundCosts(
        (1.0,) * 9,
        (50.0,) * 9,
        target_batch=BatchCosts((50.0,) * 9, ((2, 1, 55.0), (2, 9, 60.0)), 2),
        target_sessions=2,
    )
    for shared_host, probes in ((False, True), (True, False)):
        low = AdaptiveK(k_max=8, pipelined=False, costs=dataclasses.replace(cheap, shared_host=shared_host))
        low.accepted, low.reached = 0.6, 2.0  # α 0.3 over two positions: K = 0 for now
        assert any(low.choose() for _ in range(30)) is probes
    copier = AdaptiveK(k_max=8, pipelined=False, costs=copies, alpha_prior=0.6)
    assert [copier.choose() for _ in range(30)] == [0] * 30, "copies neither, until learned alone"


@pytest.mark.parametrize(
    ("draft", "target", "shared"),
    [
        ({}, {}, True),
        ({"host_id": "b"}, {}, False),  # another machine
        ({"device": "cuda:0"}, {"device": "cuda:1"}, False),  # accelerators of one machine
        ({}, {"pass_cost_profile": "70B TP4 on H100"}, False),  # emulating one
        ({"host_id": ""}, {"host_id": ""}, False),  # an older service that does not say
        ({"cpus": [0]}, {"cpus": [1]}, False),  # pinned apart (taskset)
        ({"cpus": [0, 1]}, {"cpus": [1]}, True),
        ({"cpus": [0]}, {}, True),  # one does not say which
    ],
)
def test_the_pair_shares_cores_only_on_one_machines_cpu(draft, target, shared):
    from coordinator.server import shares_cores
    from specdec.v1 import common_pb2

    def info(**fields):
        return common_pb2.ModelInfo(**{"device": "cpu", "host_id": "a", **fields})

    assert shares_cores(info(**draft), info(**target)) is shared


def test_with_passes_takes_live_costs_of_the_right_length_and_keeps_the_rest():
    costs = RoundCosts(draft_pass_ms=(5.0, 6.0), target_pass_ms=(40.0, 41.0, 42.0), draft_rpc_ms=1.0)
    live = costs.with_passes((50.0, 44.0, 43.0), (9.0, 9.5))
    assert live.target_pass_ms == (50.0, 44.0, 43.0) and live.draft_pass_ms == (9.0, 9.5)
    assert live.draft_rpc_ms == 1.0 and costs.target_pass_ms == (40.0, 41.0, 42.0)
    # A service that reports no live figures (or another number of sizes) keeps its calibrated ones.
    assert costs.with_passes((), ()) == costs
    assert costs.with_passes((50.0,), (9.0, 9.5)).target_pass_ms == (40.0, 41.0, 42.0)
    # The chooser's K moves with them: a draft step grown to a verify's cost no longer pays.
    assert best_k(0.6, costs, 8, False) > 0
    assert best_k(0.6, costs.with_passes((40.0, 41.0, 42.0), (60.0, 60.0)), 8, False) == 0


def test_rates_are_tokens_per_ms_of_every_k_to_the_bit():
    """RoundCosts.rates works out every K's rate in one pass for the chooser; each must be
    exactly what tokens_per_ms gives (the chooser's picks, and so seeded outputs, rest on
    them): alone and loaded, pipelined or not, with hedges and guesses, on a shared host."""
    rng = random.Random(0)
    for _ in range(300):
        costs = RoundCosts(
            tuple(sorted(rng.uniform(0.5, 30) for _ in range(9))),
            tuple(sorted(rng.uniform(5, 80) for _ in range(9))),
            draft_rpc_ms=rng.choice([0.0, 0.7]),
            target_rpc_ms=rng.choice([0.0, 1.1]),
            draft_sessions=rng.choice([1, 3]),
            target_sessions=rng.choice([1, 4]),
            shared_host=rng.random() < 0.3,
            branch_rows=rng.choice([1, 3]),
            guess_share=rng.choice([0.0, 0.3]),
        )
        for alpha in (0.0, 0.31, 0.77, 0.999, 1.0):
            for pipelined in (False, True):
                rescue, k_max = rng.choice([0.0, 0.4]), rng.choice([0, 1, 4, 8])
                expected = [costs.tokens_per_ms(k, alpha, pipelined, rescue) for k in range(k_max + 1)]
                assert costs.rates(alpha, k_max, pipelined, rescue) == expected


def test_a_target_only_call_shares_its_cost_among_its_steps():
    costs = RoundCosts(CHEAP_DRAFT, FLAT_TARGET, draft_rpc_ms=2.0, target_rpc_ms=4.0)
    stepping = dataclasses.replace(costs, target_only_steps=4)
    assert stepping.round_ms(0, 0.5, pipelined=False) == pytest.approx(1.0 + 150.0)
    assert stepping.round_ms(3, 0.5, pipelined=False) == costs.round_ms(3, 0.5, pipelined=False)  # one call a verify
    assert stepping.rates(0.5, 8, False)[0] == pytest.approx(1 / 151.0)


def test_target_only_calls_of_several_steps_park_a_draft_that_cannot_pay():
    """One H200's captured passes (bench/profiles/h200-captured-*: 4.2 ms target, 3.1 ms draft
    step) at the start-up round trips: with every target-only step charged a whole call, K = 2-3
    looked worth it from α 0.82 to 0.9, where K = 2 ran 0.81x target-only (emulated,
    bench/results/cpu-accelerator-h200/). A greedy request's K = 0 round runs four steps a
    call there (rounds.steps_per_call); so charged, no K pays up to α 0.9."""
    target, draft = (4.2, 4.6, 4.61, 4.63, 4.63, 4.64, 4.65, 4.66, 4.66), (3.09,) * 9
    whole_calls = RoundCosts(draft, target, draft_rpc_ms=0.84, target_rpc_ms=0.87)
    shared = dataclasses.replace(whole_calls, target_only_steps=4)
    assert [best_k(alpha, whole_calls, 8, False) for alpha in (0.82, 0.9)] == [2, 3]
    assert [best_k(alpha, shared, 8, False) for alpha in (0.82, 0.9)] == [0, 0]
