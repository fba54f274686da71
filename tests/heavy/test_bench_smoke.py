"""The benchmark harness end to end on the tiny pair, so it cannot rot. It checks that the harness
works and reports every figure; it asserts no speed."""

from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest

from bench import relaxed
from bench.__main__ import main as bench_main
from bench.accelerator import LINK_MODES, TOPOLOGIES
from bench.overhead import FRAME, spawn_framed
from specdec.rpc.ports import free_port
from specdec.tools.testbed import leftovers
from specdec.v1 import draft_pb2

# One mode per feature the tables report, from each of the three suites `--suite all` merges
# (substrings of mode names, as --only takes them).
ONLY = [
    # k-sweep: our K sweep against HF target-only and assisted generation
    *("ours K=1", "ours K=3", "HF generate", "HF assisted ("),
    # drafters: each draft-service drafter, HF's int8 assisted and prompt lookup
    *("ours model K=2", "int8+reduced", "ngram K=4", "HF assisted int8 (K=4)", "HF prompt lookup"),
    # modes: sequential, pipelined (with a hedge), adaptive K (also pipelined), two hedges
    *("K=3 sequential", "int8 K=3 pipelined", "int8 adaptive K", "hedged (2)"),
]


def test_bench_runs_the_k_sweep_drafters_and_modes_suites_together_and_writes_results(tiny_pair, tmp_path):
    """The three suites in one run (`--suite all`), so their modes share one set of processes."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {
                "prompts": [
                    {"kind": "code", "text": "def add(a, b):"},
                    {"kind": "code-edit", "text": "x = 1\nx = 1\nx ="},
                ]
            }
        )
    )
    out = tmp_path / "out"
    code = bench_main(
        [
            *("--suite", "all", "--draft-model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target)),
            *("--draft-dtype", "float32", "--target-setting", "float32", "--threads", "1", "--draft-vocab", "128"),
            *("--max-new-tokens", "8", "--repeats", "1", "--ks", "1", "3", "--hf-assisted", "default", "2"),
            *("--temperatures", "0", "0.7", "--prompts-file", str(prompts), "--out", str(out), "--only", *ONLY),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    names = [m["name"] for m in results["modes"]]
    assert names[:6] == [
        "ours target-only (K=0)",
        "HF generate target-only",
        "HF assisted (default)",
        "HF assisted (K=2)",
        "ours K=1",
        "ours K=3",
    ]
    assert len(results["samples"]) == len(names) * 2 * 1 * 2  # modes × prompts × repeats × temperatures
    assert results["machine"]["torch"] and results["machine"]["cores"]
    for temperature in ("0.0", "0.7"):
        rows = {row["mode"]: row for row in results["summary"][temperature]}
        assert rows["ours target-only (K=0)"]["speedup_vs_target_only"] == 1.0
        assert all(row["tokens_per_s"] > 0 for row in rows.values())
        for name in ("ours K=1", "ours K=3"):
            row = rows[name]
            assert 0 <= row["acceptance"] <= 1 and 0 <= row["alpha"] <= 1
            assert row["theoretical_speedup"] > 0 and row["achieved_over_theoretical"] > 0
            assert row["overhead_per_round_ms"] is not None and row["speedup_vs_hf_assisted"] > 0
            assert len(row["per_position_acceptance"]) == row["k"]
        assert rows["HF assisted (K=2)"]["tokens_per_s"] > 0 and rows["HF generate target-only"]["ttft_ms"] > 0
    # Drafters: every draft-service drafter ran, the lookup drafter proposed on a repeating prompt.
    assert {m["drafter"] for m in results["modes"] if m["family"] == "ours"} == {"model", "int8", "int8+vocab", "ngram"}
    greedy = {row["mode"]: row for row in results["summary"]["0.0"]}
    assert greedy["ours ngram K=4"]["acceptance"] is not None, "the lookup drafter must propose on a repeating prompt"
    assert results["machine"]["drafters"]["ours"]["int8+vocab"][-1] == "128"
    # Modes: pipelining, hedges and adaptive K report their own figures, and only where they ran.
    assert greedy["ours int8 K=3 pipelined"]["predraft_hit_rate"] is not None
    assert greedy["ours int8 K=3 sequential"]["predraft_hit_rate"] is None
    assert greedy["ours int8 adaptive K"]["mean_k"] > 0
    assert greedy["ours int8 K=3 hedged (2)"]["hedge_hit_rate"] is not None
    assert greedy["ours int8 K=3 sequential"]["hedge_hit_rate"] is None
    table = (out / "table.md").read_text()
    for heading in ("achieved/theoretical", "Best K", "by prompt kind", "pre-drafts used", "rejected rounds hedged"):
        assert heading in table, heading
    assert (out / "tokens_per_s_vs_k.png").stat().st_size > 0 and (out / "acceptance_vs_k.png").stat().st_size > 0


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


def test_the_relaxed_suite_compares_exact_and_relaxed_on_one_stack(tiny_pair, tmp_path):
    """`--suite relaxed` on the tiny pair: every mode on every prompt, exact output equal to the
    target-only output, relaxed responses labelled relaxed, and every row with its speed,
    agreement and perplexity. No speed asserted."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(
            {"prompts": [{"kind": "code", "text": "def add(a, b):"}, {"kind": "prose", "text": "The quick brown fox"}]}
        )
    )
    out = tmp_path / "out"
    code = bench_main(
        [
            *("--suite", "relaxed", "--draft-model", str(tiny_pair.draft), "--target-model", str(tiny_pair.target)),
            *("--target-setting", "float32", "--threads", "1", "--max-new-tokens", "16", "--repeats", "1"),
            *("--prompts-file", str(prompts), "--out", str(out)),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    modes = results["modes"]
    assert modes[:2] == ["target-only (K=0)", "exact K=4"] and len(modes) == 2 + len(relaxed.SETTINGS)
    assert len(results["samples"]) == len(modes) * 2 and len(results["scores"]) == len(modes) * 2
    for sample in results["samples"]:
        assert sample["acceptance_mode"] == ("relaxed" if sample["mode"].startswith("relaxed") else "exact")
    rows = {row["mode"]: row for row in results["summary"]}
    assert rows["target-only (K=0)"]["identical"] == rows["exact K=4"]["identical"] == 2, "exact is the target's"
    assert rows["exact K=4"]["vs_exact"] == 1.0 and rows["exact K=4"]["relaxed_only_share"] == 0.0
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["perplexity"] > 1.0 and 0.0 <= row["prefix_agreement"] <= 1.0
    assert sum(rows[mode]["relaxed_only_share"] for mode in modes[2:]) > 0, "no setting kept a draft by relaxing"
    table = (out / "table.md").read_text()
    assert "perplexity under the target" in table and "Relaxed output is not the target's" in table


def test_the_accelerator_suite_runs_emulated_and_reports_its_bounds(tmp_path):
    """`--suite accelerator --quick`: one profile pair at α ≈ 0.8, services held to the H100
    profiles; every mode reports tok/s against target-only and the bounds. No speed asserted."""
    out = tmp_path / "accelerator"
    assert bench_main(["--suite", "accelerator", "--quick", "--max-new-tokens", "16", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    (cell,) = results["cells"]
    assert cell["target_profile"] == "h100-70b-tp4" and cell["draft_profile"] == "h100-1b"
    assert 0.0 < cell["alpha_run"] <= 1.0 and cell["bounds"]["overlapped"] >= cell["bounds"]["sequential"] > 1.0
    modes = {sample["mode"] for sample in cell["samples"]}
    assert {"target-only (K=0)", "sequential K=4", "pipelined, K chooser", "tree (2,1,1,1)"} <= modes
    assert all(sample["tokens_per_s"] > 0 for sample in cell["samples"])
    assert "EMULATED" in (out / "table.md").read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")
def test_the_links_suite_runs_on_separate_hosts_and_leaves_nothing(tmp_path):
    """`--suite links` at one delay: both topologies on testbed hosts, every mode reported,
    no namespace left behind. No speed asserted."""
    out = tmp_path / "links"
    argv = ["--suite", "links", "--link-ms", "0.5", "--max-new-tokens", "8", "--out", str(out)]
    assert bench_main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [link["topology"] for link in results["links"]] == list(TOPOLOGIES)
    for link in results["links"]:
        assert link["delay_ms"] == 0.5 and len(link["samples"]) == sum(2 if m.sampled else 1 for m in LINK_MODES)
        assert all(sample["tokens_per_s"] > 0 for sample in link["samples"])
        # Two repeats (the default), every mode once in each, pooled into one sample.
        assert all(len(sample["repeat_tokens_per_s"]) == 2 for sample in link["samples"])
    assert "EMULATED" in (out / "table.md").read_text()
    assert not leftovers()  # this process's testbed: the suite ran in it


async def test_the_overhead_suites_framed_floor_answers_as_the_draft_service_refuses(tmp_path):
    """The overhead suite's gRPC-free floor (bench.overhead.serve_framed): a framed ProposeRequest
    comes back as the framed NOT_FOUND BranchResult the draft service sends for an unknown session."""
    port = free_port()
    server = spawn_framed(port, tmp_path / "framed.log")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = draft_pb2.ProposeRequest(session_id="nobody", num_tokens=1).SerializeToString()
        for _ in range(2):  # the connection serves one message after another
            writer.write(FRAME.pack(len(request)) + request)
            (length,) = FRAME.unpack(await reader.readexactly(FRAME.size))
            reply = draft_pb2.BranchResult.FromString(await reader.readexactly(length))
            assert reply.error_code == grpc.StatusCode.NOT_FOUND.value[0] and "nobody" in reply.error_message
        writer.close()
    finally:
        server.stop()
