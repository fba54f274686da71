"""The benchmark harness end to end on the tiny pair, so it cannot rot. It checks that the harness
works and reports every figure; it asserts no speed."""

from __future__ import annotations

import json

from bench.__main__ import main as bench_main


def test_bench_harness_runs_all_modes_and_writes_results(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {"prompts": [{"kind": "code", "text": "def add(a, b):"}, {"kind": "prose", "text": "The quick brown fox"}]}
        )
    )
    out = tmp_path / "out"
    code = bench_main(
        [
            "--draft-model",
            str(tiny_pair.draft),
            "--target-model",
            str(tiny_pair.target),
            "--draft-dtype",
            "float32",
            "--target-setting",
            "float32",
            "--threads",
            "1",
            "--max-new-tokens",
            "8",
            "--repeats",
            "2",
            "--ks",
            "1",
            "3",
            "--hf-assisted",
            "default",
            "2",
            "--temperatures",
            "0",
            "0.7",
            "--prompts-file",
            str(prompts),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    names = [m["name"] for m in results["modes"]]
    assert names == [
        "ours target-only (K=0)",
        "HF generate target-only",
        "HF assisted (default)",
        "HF assisted (K=2)",
        "ours K=1",
        "ours K=3",
    ]
    assert len(results["samples"]) == len(names) * 2 * 2 * 2  # modes × prompts × repeats × temperatures
    assert results["machine"]["torch"] and results["machine"]["cores"]
    for temperature in ("0.0", "0.7"):
        rows = {row["mode"]: row for row in results["summary"][temperature]}
        assert rows["ours target-only (K=0)"]["speedup_vs_target_only"] == 1.0
        for name in ("ours K=1", "ours K=3"):
            row = rows[name]
            assert row["tokens_per_s"] > 0 and 0 <= row["acceptance"] <= 1 and 0 <= row["alpha"] <= 1
            assert row["theoretical_speedup"] > 0 and row["achieved_over_theoretical"] > 0
            assert row["overhead_per_round_ms"] is not None and row["speedup_vs_hf_assisted"] > 0
            assert len(row["per_position_acceptance"]) == row["k"]
        assert rows["HF assisted (K=2)"]["tokens_per_s"] > 0 and rows["HF generate target-only"]["ttft_ms"] > 0
    table = (out / "table.md").read_text()
    assert "achieved/theoretical" in table and "Best K" in table
    assert (out / "tokens_per_s_vs_k.png").stat().st_size > 0 and (out / "acceptance_vs_k.png").stat().st_size > 0


def test_bench_drafters_suite_runs_every_drafter(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"kind": "code-edit", "text": "x = 1\nx = 1\nx ="}]}))
    out = tmp_path / "out"
    code = bench_main(
        [
            "--suite",
            "drafters",
            "--draft-model",
            str(tiny_pair.draft),
            "--target-model",
            str(tiny_pair.target),
            "--draft-dtype",
            "float32",
            "--target-setting",
            "float32",
            "--threads",
            "1",
            "--draft-vocab",
            "128",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--temperatures",
            "0",
            "--prompts-file",
            str(prompts),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = {row["mode"]: row for row in results["summary"]["0.0"]}
    assert {m["drafter"] for m in results["modes"] if m["family"] == "ours"} == {"model", "int8", "int8+vocab", "ngram"}
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    assert rows["ours ngram K=4"]["acceptance"] is not None, "the lookup drafter must propose on a repeating prompt"
    assert results["machine"]["drafters"]["ours"]["int8+vocab"][-1] == "128"
    assert "by prompt kind" in (out / "table.md").read_text()


def test_bench_modes_suite_reports_pipelining_hedging_and_adaptive_k(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"kind": "code", "text": "def add(a, b):"}]}))
    out = tmp_path / "out"
    code = bench_main(
        [
            "--suite",
            "modes",
            # One mode per coordinator feature the table reports (the combinations run the
            # same harness code and would only add processes).
            "--only",
            "K=3 sequential",
            "int8 K=3 pipelined",
            "int8 adaptive K",
            "hedged (2)",
            "--draft-model",
            str(tiny_pair.draft),
            "--target-model",
            str(tiny_pair.target),
            "--draft-dtype",
            "float32",
            "--target-setting",
            "float32",
            "--threads",
            "1",
            "--max-new-tokens",
            "12",
            "--repeats",
            "1",
            "--temperatures",
            "0",
            "--prompts-file",
            str(prompts),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = {row["mode"]: row for row in results["summary"]["0.0"]}
    assert rows["ours int8 K=3 pipelined"]["predraft_hit_rate"] is not None
    assert rows["ours int8 K=3 sequential"]["predraft_hit_rate"] is None
    assert rows["ours int8 adaptive K"]["mean_k"] > 0
    assert rows["ours int8 K=3 hedged (2)"]["hedge_hit_rate"] is not None
    assert rows["ours int8 K=3 sequential"]["hedge_hit_rate"] is None
    assert (
        "pre-drafts used" in (out / "table.md").read_text()
        and "rejected rounds hedged" in (out / "table.md").read_text()
    )


def test_bench_concurrency_suite_reports_scaling_with_and_without_batching(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {"prompts": [{"kind": "code", "text": "def add(a, b):"}, {"kind": "prose", "text": "The quick brown fox"}]}
        )
    )
    out = tmp_path / "out"
    code = bench_main(
        [
            "--suite",
            "concurrency",
            "--draft-model",
            str(tiny_pair.draft),
            "--target-model",
            str(tiny_pair.target),
            "--draft-dtype",
            "float32",
            "--target-setting",
            "float32",
            "--threads",
            "1",
            "--sessions",
            "1",
            "3",
            "--batch-window-ms",
            "50",
            "--max-new-tokens",
            "12",
            "--repeats",
            "1",
            "--prompts-file",
            str(prompts),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["samples"]) == 2 * 3  # sizes × settings
    assert all(s["tokens"] == sum(s["request_tokens"]) and len(s["request_tokens"]) == 3 for s in results["samples"])
    rows = {row["sessions"]: row for row in results["summary"]}
    assert rows[1]["off"]["scaling"] == rows[1]["verify"]["scaling"] == rows[1]["both"]["scaling"] == 1.0
    assert rows[3]["off"]["sessions_per_verify"] == 1.0 and rows[3]["off"]["sessions_per_propose"] == 1.0, "off batched"
    assert rows[3]["verify"]["sessions_per_propose"] == 1.0, "the verify setting batched Propose"
    assert rows[3]["verify"]["sessions_per_verify"] > 1.0, "three generations at once never shared a verify pass"
    assert rows[3]["both"]["sessions_per_propose"] > 1.0, "three generations at once never shared a propose pass"
    assert all(row[b]["tokens_per_s"] > 0 for row in rows.values() for b in ("off", "verify", "both"))
    table = (out / "table.md").read_text()
    assert (
        "sessions per verify pass" in table and "sessions per propose pass" in table and "the same 3 requests" in table
    )
    assert (out / "tokens_per_s_vs_sessions.png").stat().st_size > 0
