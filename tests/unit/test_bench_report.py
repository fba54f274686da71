"""The benchmark's derived figures: per-token α and Leviathan's theoretical speedup."""

from __future__ import annotations

import pytest

from bench.report import markdown_table, summarise, theoretical_speedup


def test_theoretical_speedup_formula():
    assert theoretical_speedup(0.8, 0, 0.4) == 1.0
    assert theoretical_speedup(0.8, 2, 0.5) == pytest.approx((1 - 0.8**3) / (0.2 * 2.0))
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0


def _sample(mode, rounds, proposed, accepted, per_position, total_ms=1000.0, draft=100.0, target=800.0):
    return dict(
        mode=mode,
        kind="code",
        temperature=0.0,
        repeat=0,
        tokens=accepted + rounds,
        total_ms=total_ms,
        ttft_ms=10.0,
        rounds=rounds,
        proposed=proposed,
        accepted=accepted,
        accepted_per_position=per_position,
        draft_compute_ms=draft,
        target_compute_ms=target,
    )


def test_alpha_counts_only_positions_that_were_evaluated():
    results = {
        "modes": [
            dict(name="ours target-only (K=0)", family="ours", k=0, assisted=None),
            dict(name="ours K=2", family="ours", k=2, assisted=None),
        ],
        "samples": [
            _sample(
                "ours target-only (K=0)", rounds=20, proposed=0, accepted=0, per_position=[], draft=0.0, target=2000.0
            ),
            # 10 rounds of K=2: 8 accepted position 0, 4 of those also position 1.
            _sample("ours K=2", rounds=10, proposed=20, accepted=12, per_position=[8, 4]),
        ],
    }
    row = {r["mode"]: r for r in summarise(results)[0.0]}["ours K=2"]
    assert row["acceptance"] == pytest.approx(12 / 20)
    assert row["alpha"] == pytest.approx(12 / (10 + 8))  # positions reached: 10 at i=0, 8 at i=1
    assert row["per_position_acceptance"] == [0.8, 0.4]
    c = (100.0 / 20) / (2000.0 / 20)
    assert row["cost_ratio_c"] == pytest.approx(c)
    assert row["theoretical_speedup"] == pytest.approx(theoretical_speedup(12 / 18, 2, c))


def test_rounds_without_drafts_reach_no_position():
    """K = 0 rounds (the chooser's, or a pipelined catch-up step) verify nothing: α, the
    per-position acceptance and mean K count only the rounds that carried drafts."""
    piped = _sample("ours pinned pipelined K=2", rounds=4, proposed=4, accepted=3, per_position=[2, 1])
    piped.update(k_per_round=[0, 2, 2, 0], catch_up_rounds=2)
    base = _sample("ours target-only (K=0)", rounds=20, proposed=0, accepted=0, per_position=[], draft=0.0)
    results = {
        "modes": [
            dict(name=base["mode"], family="ours", k=0, assisted=None),
            dict(name=piped["mode"], family="ours", k=2, assisted=None),
        ],
        "samples": [base, piped],
    }
    row = {r["mode"]: r for r in summarise(results)[0.0]}[piped["mode"]]
    assert row["alpha"] == pytest.approx(3 / (2 + 2))  # 2 drafted rounds reach i=0, 2 reach i=1
    assert row["per_position_acceptance"] == [1.0, 0.5]
    assert row["mean_k"] == pytest.approx(2.0)


def _row(sample: dict) -> dict:
    base = _sample("ours target-only (K=0)", rounds=20, proposed=0, accepted=0, per_position=[], draft=0.0)
    modes = [dict(name=base["mode"], family="ours", k=0), dict(name=sample["mode"], family="ours", k=2)]
    return {r["mode"]: r for r in summarise({"modes": modes, "samples": [base, sample]})[0.0]}[sample["mode"]]


def test_alpha_where_k_varies_counts_each_rounds_own_evaluated_drafts():
    """The K chooser: a round of K = 1 accepting its draft and one of K = 3 accepting all
    three evaluated four drafts and accepted them all: α 1, not the 0.8 that counting the
    first round as reaching position 2 gives. Without per-round counts α is not given."""
    chooser = _sample("ours K chooser", rounds=2, proposed=4, accepted=4, per_position=[2, 1, 1])
    chooser.update(k_per_round=[1, 3], accepted_per_round=[1, 3])
    row = _row(chooser)
    assert row["alpha"] == pytest.approx(1.0)
    assert row["per_position_acceptance"] == [1.0, 1.0, 1.0]  # of the rounds that proposed each
    del chooser["accepted_per_round"]
    assert _row(chooser)["alpha"] is None


def test_tree_rows_have_no_chain_alpha_or_bound():
    """A tree round's K counts nodes, drafted a level a pass: no chain bound fits it."""
    tree = _sample("ours tree 2x1", rounds=10, proposed=40, accepted=15, per_position=[9, 6, 0, 0])
    tree.update(k_per_round=[4] * 10, accepted_per_round=[2] * 6 + [1] * 3 + [0], tree_rounds=10)
    row = _row(tree)
    assert row["alpha"] is None and row["theoretical_speedup"] is None and row["cost_ratio_c"] is None


def test_degraded_requests_are_counted_and_named_in_the_table():
    good = _sample("ours K=2", rounds=10, proposed=20, accepted=12, per_position=[8, 4])
    failed = dict(good, repeat=1, degraded=True, fallback_rounds=10)
    base = _sample("ours target-only (K=0)", rounds=20, proposed=0, accepted=0, per_position=[], draft=0.0)
    modes = [dict(name=base["mode"], family="ours", k=0), dict(name="ours K=2", family="ours", k=2)]
    summary = summarise({"modes": modes, "samples": [base, good, failed]})
    assert {r["mode"]: r["degraded"] for r in summary[0.0]} == {base["mode"]: 0, "ours K=2": 1}
    machine = dict(cpu="x", cores=2, device="cpu", torch="t", transformers="t", threads={"in_process_hf": 2}, date="d")
    assert "**Degraded requests**" in markdown_table(summary, machine) and "ours K=2 1 of 2" in markdown_table(
        summary, machine
    )


def test_overhead_per_round_is_the_coordinators_own_where_reported():
    """A pipelined request's wait for pre-drafts after a verify is model work the round waited
    for (GenerationStats.work_ms_since): its round_overhead_ms, not total less call compute."""
    piped = _sample("ours pipelined K=2", rounds=10, proposed=20, accepted=12, per_position=[8, 4])
    assert _row(piped)["overhead_per_round_ms"] == pytest.approx((1000 - 100 - 800) / 10)
    piped["overhead_ms"] = 40.0
    assert _row(piped)["overhead_per_round_ms"] == pytest.approx(4.0)


def test_nodes_suite_pins_each_service_and_reports_ready_rate_waste_and_round_split():
    from bench.modes import PLACEMENTS, drafter_cpus, node_modes
    from bench.report import markdown_table

    modes = node_modes()
    pinned = [m for m in modes if m.placement == "pinned"]
    assert {m.coordinator for m in pinned} == {"sequential", "pipelined-waiting", "pipelined", "pipelined+hedged2"}
    assert {m.adaptive for m in pinned} == {True, False}
    assert all(m.drafter == "int8@core0" for m in pinned)
    assert PLACEMENTS["pinned"]["draft"].cpus == drafter_cpus("int8@core0") == (0,)
    assert PLACEMENTS["pinned"]["target"].cpus == PLACEMENTS["pinned"]["coordinator"].cpus == (1,)
    assert PLACEMENTS["pinned"]["target"].args == ("--threads", "1")
    assert any(m.family == "hf" and m.assisted == "default" for m in modes)
    base = _sample(
        "ours target-only (K=0)", rounds=20, proposed=0, accepted=0, per_position=[], draft=0.0, target=2000.0
    )
    base.update(target_ms=1900.0)
    piped = _sample(
        "ours pinned pipelined K=2", rounds=10, proposed=20, accepted=14, per_position=[8, 6], total_ms=3000.0
    )
    # 9 rounds followed the first; 6 of them took their drafts from a branch.
    piped.update(
        predrafts=10,
        hedges=20,
        ready_rounds=6,
        target_ms=2000.0,
        draft_ms=300.0,
        branch_wait_ms=200.0,
        predraft_wasted_tokens=5,
        hedge_wasted_tokens=15,
        catch_up_rounds=3,
    )
    results = {
        "modes": [dict(name=base["mode"], family="ours", k=0), dict(name=piped["mode"], family="ours", k=2)],
        "samples": [base, piped],
    }
    summary = summarise(results)
    row = {r["mode"]: r for r in summary[0.0]}["ours pinned pipelined K=2"]
    assert row["ready_rate"] == pytest.approx(6 / 9)
    assert row["wasted_per_round"] == pytest.approx(2.0)
    assert row["catch_up_rate"] == pytest.approx(0.3)
    assert (row["verify_ms"], row["draft_critical_ms"], row["other_ms"]) == pytest.approx((200.0, 50.0, 50.0))
    machine = dict(cpu="x", cores=2, device="cpu", torch="t", transformers="t", threads={"in_process_hf": 2}, date="d")
    table = markdown_table(summary, machine)
    assert "ready rate" in table and "67%" in table and "catch-up steps" in table and "30%" in table


def test_overhead_table_reports_per_call_figures_and_the_transport_floor():
    from bench.overhead import markdown_table
    from bench.overhead import summarise as summarise_overhead

    one_round = {"round_ms": [10.0, 12.0], "round_overhead_ms": [2.0, 4.0], "k_per_round": [4, 4]}
    # K = 0: the first two rounds are one call's steps, its time shared between them.
    stepped = {"round_ms": [5.0, 5.0, 12.0], "round_overhead_ms": [1.0, 1.0, 4.0], "k_per_round": [0, 0, 0]}
    samples = [
        {"decoding": decoding, "k": k, **(stepped if k == 0 else one_round)}
        for decoding, k in (("greedy", 0), ("greedy", 4), ("sampled", 0), ("sampled", 4))
    ]
    rows = summarise_overhead({"samples": samples})
    assert [r["per_rpc_ms_p50"] for r in rows] == [3.0, 1.5, 3.0, 1.5]  # calls of 2 and 4 ms; two calls a round
    assert [r["overhead_ms_p50"] for r in rows] == [1.0, 3.0, 1.0, 3.0]
    machine = {"cpu": "cpu", "cpu_flags": "avx2", "cores": 2, "torch": "2.13", "date": "today"}
    table = markdown_table(rows, machine, floors={"unary": [0.5] * 10 + [0.9] * 10, "stream_idle": [0.8] * 3})
    assert "| greedy | 4 | 4.0 | 2 | 11.00 | 3.00 |" in table
    assert "bare unary call" in table and "0.70 ms p50" in table
    assert "after 10 ms idle" in table and "0.80 ms p50" in table
    assert "Floor" not in markdown_table(rows, machine)
    with_cpu = markdown_table(rows, machine, {"unary": [0.5], "framed": [0.2]}, {"unary": [0.3, 0.6], "framed": [0.1]})
    assert "(1 calls; CPU a call: client 0.30 ms, server 0.60 ms)" in with_cpu
    assert "(1 calls; CPU a call: client 0.10 ms)" in with_cpu


def test_overhead_of_one_round_requests_is_no_figure_not_a_crash():
    """--max-new-tokens 1: every request is one round, and no round after the first is timed."""
    from bench.overhead import markdown_table
    from bench.overhead import summarise as summarise_overhead

    one = {"round_ms": [], "round_overhead_ms": [], "k_per_round": []}  # the rounds after the first: none
    rows = summarise_overhead({"samples": [{"decoding": "greedy", "k": 4, **one}]})
    assert all(row["overhead_ms_p50"] is None for row in rows)
    machine = {"cpu": "cpu", "cpu_flags": "avx2", "cores": 2, "torch": "2.13", "date": "today"}
    assert "| greedy | 4 | 0.0 | 0 | — | — | — | — | — |" in markdown_table(rows, machine)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--repeats", "0"], "not in [1, ∞]"),
        (["--max-new-tokens", "0"], "not in [1, ∞]"),
        (["--ks", "-1"], "not in [0, ∞]"),
        (["--temperatures", "-0.5"], "not in [0, ∞]"),
        (["--sessions", "0"], "not in [1, ∞]"),
        (["--threads", "x"], "not a whole number"),
        (["--hf-assisted", "foo"], "--hf-assisted takes default or a K above 0"),
        (["--device", "gpu"], "--device is cpu or cuda"),
    ],
)
def test_the_bench_refuses_bad_arguments_before_it_starts_anything(argv, says, capsys):
    from bench.harness import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--suite", "overhead", *argv])
    assert says in capsys.readouterr().err


def test_the_concurrency_table_names_the_cpu_flags():
    from bench import concurrency

    machine = dict(cpu="EPYC", cpu_flags="avx2 fma", cores=2, device="cpu", torch="t", transformers="t", date="d")
    config = dict(target_model="/m/t", draft_model="/m/d", target_dtype="float32", threads=2, requests=0)
    config.update(sessions=[1], max_new_tokens=8, repeats=1, batch_window_ms=2.0)
    sample = dict(sessions=1, k=4, repeat=0, wall_ms=1000.0, tokens=16, rounds=4, proposed=12, accepted=8)
    sample.update(verify_calls=4, verify_batch_sum=4.0)
    rows = concurrency.summarise({"samples": [dict(sample, batching=b) for b in concurrency.BATCHING]})
    assert "(avx2 fma)" in concurrency.markdown_table(rows, machine, config).splitlines()[0]


def test_overhead_cpu_per_round_takes_the_reported_compute_off_the_model_threads():
    """The CPU each process spent per round outside the passes: the requests' rounds pooled,
    a service's reported compute off its model thread's, the total the event loops' and the
    other threads' alone; no CPU figures in an older run's samples, no table."""
    from bench.overhead import markdown_table
    from bench.overhead import summarise as summarise_overhead

    def sample(k, rounds, scale, decoding="greedy"):
        return {
            "decoding": decoding,
            "k": k,
            "round_ms": [10.0],
            "round_overhead_ms": [2.0],
            "k_per_round": [k],
            "rounds_total": rounds,
            "cpu_ms": {
                "coordinator": {"loop": 2.0 * scale, "other": 1.0 * scale, "model": 0.0},
                "draft": {"loop": 1.0, "other": 0.5, "model": 9.0},
                "target": {"loop": 3.0, "other": 1.0, "model": 19.0},
            },
            "compute_ms": {"draft": 8.0, "target": 20.0},
        }

    samples = [sample(4, 2, 1.0), sample(4, 2, 3.0), sample(0, 1, 1.0), sample(0, 1, 1.0, "sampled")]
    samples.append(sample(4, 1, 1.0, "sampled"))
    rows = {(r["decoding"], r["k"]): r for r in summarise_overhead({"samples": samples})}
    four = rows["greedy", 4]["cpu_ms_per_round"]
    assert four["coordinator"] == pytest.approx({"loop": 2.0, "other": 1.0, "model": 0.0})  # (2 + 6) / 4 rounds
    assert four["draft"] == pytest.approx({"loop": 0.5, "other": 0.25, "model": 0.5})  # (9 - 8) * 2 / 4
    assert four["target"] == pytest.approx({"loop": 1.5, "other": 0.5, "model": -0.5})  # (19 - 20) * 2 / 4
    assert rows["greedy", 4]["cpu_total_ms_per_round"] == pytest.approx(5.75)  # loops and others
    assert rows["greedy", 0]["cpu_ms_per_round"]["target"]["model"] == pytest.approx(-1.0)  # one round
    machine = {"cpu": "cpu", "cpu_flags": "avx2", "cores": 2, "torch": "2.13", "date": "today"}
    table = markdown_table(list(rows.values()), machine)
    assert "| greedy | 4 | 2.00 | 1.00 | 0.50 | 0.25 | 0.50 | 1.50 | 0.50 | -0.50 | 5.75 |" in table
    older = [{key: value for key, value in s.items() if key not in ("cpu_ms", "compute_ms")} for s in samples]
    assert "CPU per round" not in markdown_table(summarise_overhead({"samples": older}), machine)


def test_overhead_thread_cpu_tells_the_loop_from_a_model_thread():
    """thread_cpu_ms reads /proc: work on the main thread is the loop's, work on a ModelThread
    (named for the OS) the model's."""
    import asyncio
    import os
    import time

    from bench.overhead import thread_cpu_ms
    from specdec.rpc.model_thread import ModelThread

    def burn(seconds: float) -> None:
        started = time.thread_time()
        while time.thread_time() - started < seconds:
            pass

    async def main() -> None:
        model = ModelThread("draft-model")
        await model.run(burn, 0.0)  # the thread exists from here on
        before = thread_cpu_ms(os.getpid())
        burn(0.05)
        await model.run(burn, 0.05)
        after = thread_cpu_ms(os.getpid())
        model.shutdown()
        assert after["loop"] - before["loop"] >= 40.0
        assert after["model"] - before["model"] >= 40.0
        assert after["other"] - before["other"] < 40.0

    asyncio.run(main())


def test_the_multiturn_table_compares_each_stack_with_the_uncached_one():
    """`--suite multiturn`'s summary: first-token time of later turns against the uncached
    stack, tok/s against target-only and the hybrid drafter, outputs compared request by
    request."""
    from bench import multiturn

    samples = []
    for stack in multiturn.STACKS:
        for workload, requests, turns in (("edits", 2, 3), ("agent", 2, 1), ("demo", 3, 2)):
            for index in range(requests):
                for turn in range(turns):
                    for k in (0, None) if stack == "hybrid" else (None,):
                        cached = stack != "hybrid" and turn > 0
                        samples.append(
                            dict(
                                stack=stack,
                                workload=workload,
                                index=index,
                                turn=turn,
                                k=k,
                                tokens=48,
                                total_ms=4000.0 if k == 0 else 2000.0 if stack == "suffix+prefix" else 3000.0,
                                ttft_ms=300.0 if cached else 900.0,
                                copied_rounds=1,
                                token_ids=[1, 2, index] if stack != "suffix+prefix" or index else [9],
                            )
                        )
    results = {
        "suite": "multiturn",
        "machine": {"date": "d", "cpu": "c", "cpu_flags": "f", "cores": 2, "torch": "t"},
        "max_new_tokens": 48,
        "demo_repeats": 2,
        "samples": samples,
    }
    summary = multiturn.summarise(results)
    assert summary["ttft"]["hybrid later"] / summary["ttft"]["suffix+prefix later"] == pytest.approx(3.0)
    edits = summary["rates"]["edits"]
    assert edits["suffix+prefix"] / edits["target_only"] == pytest.approx(2.0)
    assert edits["suffix+prefix"] / edits["hybrid"] == pytest.approx(1.5)
    assert edits["suffix+prefix identical"] == 3 and edits["hybrid+prefix identical"] == 6  # index 0 differs
    table = multiturn.markdown(results)
    assert "| suffix+prefix | 900 ms | 300 ms | 3.00× |" in table
    assert "| edits | 12.00 | 16.00 (1.33×, 1.00×) | 16.00 (1.33×, 1.00×) |" in table
    assert "| suffix+prefix | 24.00 (1.50×) | 24.00 (1.50×) | 24.00 (1.50×) |" in table  # make run's, over repeats
    # Repeat by repeat: every pair of runs gives 1.5, so the interval is that point.
    assert "| suffix+prefix | 1.50× (1.50-1.50) | 1.50× (1.50-1.50) | 1.50× (1.50-1.50) |" in table
    assert "| suffix | 1.00× (1.00-1.00) |" in table


def test_the_drafts_table_compares_each_draft_with_target_only_through_its_own_stack():
    """`--suite drafts`: c from the services' calibrated passes, acceptance at K = 4, tok/s
    against the same stack's K = 0, greedy outputs compared, and HF's modes against its own
    target-only; a peer that failed is reported, not dropped."""
    from bench import drafts

    samples = []
    for stack in drafts.DRAFTS:
        for index, kind in enumerate(("demo", "demo", "code")):
            for temperature in drafts.TEMPERATURES:
                for k in drafts.KS:
                    fast = stack == "smollm2-135m" and k is None
                    samples.append(
                        dict(
                            stack=stack,
                            kind=kind,
                            index=index,
                            temperature=temperature,
                            k=k,
                            token_ids=[1, 2] if k == 0 or index else [3],
                            tokens=48,
                            total_ms=4000.0 if k == 0 else 2000.0 if fast else 3000.0,
                            proposed=40 if k else 0,
                            accepted=30 if k else 0,
                            rounds=24 if k else 48,
                        )
                    )
        for temperature in drafts.TEMPERATURES:
            for mode, ms in (("hf target-only", 4000.0), ("hf-assisted qwen2.5-0.5b", 2500.0)):
                samples.append(dict(stack=mode, kind="code", index=0, temperature=temperature, tokens=48, total_ms=ms))
    samples.append(dict(stack="hf-universal smollm2-135m", index=0, temperature=0.7, error="not supported"))
    info = {"draft_pass_ms": [10.0], "target_pass_ms": [50.0], "shared_tokens": 39237, "target_vocab_tokens": 151665}
    results = {
        "suite": "drafts",
        "machine": {"date": "d", "cpu": "c", "cpu_flags": "f", "cores": 2, "torch": "t"},
        "max_new_tokens": 48,
        "drafter": "model",
        "info": {name: info for name in drafts.DRAFTS},
        "samples": samples,
    }
    rows = drafts.summarise(results)["rows"]
    smol = rows["smollm2-135m T=0.0"]
    assert smol["c"] == pytest.approx(0.2) and smol["k4 acceptance"] == pytest.approx(0.75)
    assert smol["chosen tok/s"] / smol["target_only"] == pytest.approx(2.0)
    assert smol["k4 identical"] == 2 and smol["requests"] == 3  # index 0 differs from K = 0
    assert rows["hf T=0.0"]["hf-assisted qwen2.5-0.5b"] == pytest.approx(1.6)
    table = drafts.markdown(results)
    row = "| smollm2-135m | 0.0 | 10.0 ms | 0.20 | 0.75 | 2.00 | 12.0 tok/s | 1.33× | 2.00× | 2/3, 2/3 | 2.00×, 2.00× |"
    assert row in table
    assert "39,237 tokens it shares" in table and "hf-universal smollm2-135m at T = 0.7 failed: not supported" in table


def test_ratios_are_the_median_of_each_repeats_ratio():
    """The machine's drift between repeats cancels: a mode 10% faster in two of three repeats
    is 1.1×, where the ratio of the medians (15 against 20 tok/s) would say 0.75×."""
    base, mode = "ours target-only (K=0)", "ours K=2"
    results = {
        "modes": [
            dict(name=base, family="ours", k=0, assisted=None),
            dict(name=mode, family="ours", k=2, assisted=None),
        ],
        "samples": [],
    }
    for repeat, (base_ms, mode_ms) in enumerate([(2000.0, 2000.0 / 1.1), (1000.0, 1000.0 / 1.1), (2000 / 3, 4000 / 3)]):
        for name, total_ms in ((base, base_ms), (mode, mode_ms)):
            sample = _sample(name, rounds=20, proposed=0, accepted=0, per_position=[], total_ms=total_ms)
            results["samples"].append({**sample, "repeat": repeat})
    rows = {r["mode"]: r for r in summarise(results)[0.0]}
    assert rows[base]["tokens_per_s"] == pytest.approx(20.0) and rows[mode]["tokens_per_s"] == pytest.approx(15.0)
    assert rows[mode]["speedup_vs_target_only"] == pytest.approx(1.1)


def test_the_live_costs_table_pairs_the_two_choosers_repeat_by_repeat():
    """`--suite live-costs`: live ÷ calibrated tok/s per prompt from paired repeats, each
    chooser's rounds, and whether every output of a prompt was the same."""
    from bench import live_costs

    def sample(chooser, index, repeat, total_ms, rounds, ids=(1, 2)):
        return dict(
            chooser=chooser,
            index=index,
            repeat=repeat,
            tokens=60,
            total_ms=total_ms,
            rounds=rounds,
            token_ids=list(ids),
        )

    samples = []
    for repeat in range(3):
        samples += [sample("live", 0, repeat, 2000.0, 30), sample("calibrated", 0, repeat, 2500.0, 40)]
        samples += [sample("live", 1, repeat, 1000.0, 8), sample("calibrated", 1, repeat, 1000.0, 8, ids=(3,))]
    costs = {role: {"calibrated": [40.0] * 9, "live": [30.0] * 9} for role in ("target", "draft")}
    results = {
        "suite": "live-costs",
        "machine": {"date": "d", "cpu": "c", "cpu_flags": "f", "cores": 2, "torch": "t"},
        "max_new_tokens": 96,
        "cases": {"disturbed": {"samples": samples, "costs": costs}},
    }
    results["summary"] = live_costs.summarise(results)
    first, second = results["summary"]["disturbed"]
    assert first["ratio"] == pytest.approx((1.25, 1.25, 1.25))
    assert first["rounds"] == {"live": 30, "calibrated": 40} and first["identical"]
    assert not second["identical"]
    table = live_costs.markdown(results)
    assert "| disturbed | 1 | 1.25× (1.25-1.25) | 30.0 | 40.0 | yes |" in table
    assert "| disturbed | 2 | 1.00× (1.00-1.00) | 8.0 | 8.0 | no |" in table
    assert "| disturbed | target | 40 40 40 40 40 40 40 40 40 | 30 30 30 30 30 30 30 30 30 |" in table


def test_a_dilated_pools_run_scales_every_profile_time_and_labels_its_tables(tmp_path):
    """`--suite pools --dilation S`: the services get the published profiles with every time
    times S (the pass cost at any size and context with it), and the tables say the figures are
    in dilated, emulated time. S = 1 uses the published files as they are."""
    from bench import pools
    from bench.accelerator import PROFILES, profile
    from specdec.engine.pace import load_profile

    emulated = pools.Emulation.build(None, tmp_path / "x3", 3.0)
    for path, name in ((emulated.draft_profile, pools.DRAFT_PROFILE), (emulated.target_profile, pools.TARGET_PROFILE)):
        dilated, published = load_profile(str(path)), profile(name)
        assert dilated.pass_ms == tuple((tokens, 3.0 * ms) for tokens, ms in published.pass_ms)
        for tokens, context in ((1, 0), (40, 3000), (700, 100)):
            assert dilated.ms(tokens, context) == pytest.approx(3.0 * published.ms(tokens, context))
    plain = pools.Emulation.build(None, tmp_path / "x1", 1.0)
    assert plain.target_profile == PROFILES / f"{pools.TARGET_PROFILE}.json" and not (tmp_path / "x1").exists()

    row = dict(targets=1, drafts=1, tokens_per_s=100.0, queued_ms_mean=0.0, evicted=0, reprefills=0)
    row["tokens"] = 256 * pools.NEW_TOKENS
    results = {
        "machine": {"date": "d", "cpu": "c", "cpu_flags": "avx2", "cores": 2, "torch": "t"},
        "alpha_measured": 0.8,
        "kv_budget": 1,
        "kv": [dict(row, failed=[], host_busy=0.5)],
    }
    assert "dilated" not in pools.markdown(results)
    assert "**Time-dilated ×3**" in pools.markdown({**results, "dilation": 3.0})
    assert "256 requests of 64 tokens, 8 a client in turn" in pools.markdown(results)


def test_pools_load_counts_steady_tokens_only_while_every_client_has_a_request_in_flight(monkeypatch):
    """bench.pools.load: two clients, requests of 20, 80 and 20 tokens taking 0.1, 0.4 and
    0.1 s. One client runs the 80-token request alone; the other the two short ones in turn.
    The whole run counts all 120 tokens over 0.4 s; the steady window is the short ones' 0.2 s,
    holding their 40 tokens and half of the long one's 80. The times are a clock of each
    client thread's own, which its requests advance (the main thread reads the latest): a
    loaded machine's scheduling does not move them. Real sleeps, a quarter as long, keep the
    order in which the clients take the requests."""
    import threading
    import time
    from types import SimpleNamespace

    from bench import pools
    from specdec.v1 import coordinator_pb2 as pb

    clocks: dict[int, float] = {}
    main = threading.get_ident()

    def now() -> float:
        thread = threading.get_ident()
        return max(clocks.values(), default=0.0) if thread == main else clocks.setdefault(thread, 0.0)

    class Stub:
        def Generate(self, request, timeout=None):
            seconds = request.max_new_tokens / 200
            time.sleep(seconds / 4)
            clocks[threading.get_ident()] += seconds
            stats = pb.GenerationStats(generated_tokens=request.max_new_tokens)
            return pb.GenerateResponse(token_ids=[1] * request.max_new_tokens, stats=stats)

    monkeypatch.setattr(pools, "time", SimpleNamespace(perf_counter=now))
    result = pools.load(Stub(), 2, [pools.request([1], None, tokens) for tokens in (20, 80, 20)], 1.0)
    assert result["tokens"] == 120 and not result["failed"]
    assert result["tokens_per_s"] == pytest.approx(300)
    assert result["steady_s"] == pytest.approx(0.2)
    assert result["steady_tokens_per_s"] == pytest.approx(400)


def test_the_pools_tables_count_failed_requests_beside_their_rates():
    """A failed request's tokens are not in a rate: the sweep and real-pair rows say how many
    failed, so a rate that dropped requests cannot pass for a full one."""
    from bench import pools

    sample = dict(tokens_per_s=100.0, k_mean=2.0, sessions_mean=1.0, failed=[])
    results = {
        "machine": {"date": "d", "cpu": "c", "cpu_flags": "avx2", "cores": 2, "torch": "t"},
        "alpha_measured": 0.8,
        "sweep": [dict(clients=1, chosen=dict(sample, failed=["UNAVAILABLE: x"] * 2), target_only=sample, ratio=1.0)],
        "real": [
            dict(drafter="int8", clients=1, chosen=[9.0], target_only=[8.0], ratios=[1.125], k_mean=3.0, failed=1)
        ],
    }
    table = pools.markdown(results)
    assert "| 1 | 100.0 | 100.0 | 1.00× | 2.00 | 1.0 | 2 |" in table
    assert "| int8 | 1 | 9.0 | 8.0 | 1.12× | 3.00 | 1 |" in table


def test_accelerator_table_names_the_alpha_a_run_met_or_says_it_met_none():
    """A run without a greedy fixed-K chain (a custom set of modes) meets no α of its own: the
    table gives the teacher-forced α and says so, not 'α 0.00 as the run met it'."""
    from bench import accelerator

    bounds = {"sequential": 2.5, "sequential_k": 6, "overlapped": 4.4, "overlapped_k": 8}
    cell = {
        "pair": "70b+1b",
        "target_profile": "h100-70b-tp4",
        "draft_profile": "h100-1b",
        "alpha_target": 0.8,
        "alpha_measured": 0.81,
        "bounds": {**bounds, "draft_step_ms": 1.8, "target_pass_ms": 18.5},
        "overruns": {"draft": 0, "target": 0},
        "samples": [
            {"mode": "target-only (K=0)", "temperature": 0.0, "tokens_per_s": 50.0, "tokens_per_round": 1.0,
             "acceptance": 0.0, "overhead_share": 0.02},
        ],
    }  # fmt: skip
    machine = {"date": "2026-12-06", "cpu": "AMD EPYC", "cpu_flags": "avx2 fma", "cores": 2, "torch": "2.13.0"}
    table = accelerator.markdown({"machine": machine, "cells": [cell]})
    assert "α 0.81\n" in table and "the run met no α of its own" in table and "0.00 as the run met" not in table
    table = accelerator.markdown({"machine": machine, "cells": [{**cell, "alpha_run": 0.77}]})
    assert "α 0.77\n" in table and "α 0.77 as the run met it" in table
