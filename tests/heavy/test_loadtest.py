"""The load test script, short: 8 clients for 15 seconds against the three services as real
processes. `make loadtest` runs the long version (32 clients, 3 minutes)."""

from __future__ import annotations

import json

from scripts.loadtest import main as loadtest_main


def test_short_load_has_no_errors_frees_every_session_and_keeps_memory_flat(tiny_pair, tmp_path):
    report_path = tmp_path / "report.json"
    code = loadtest_main(
        [
            "--clients",
            "8",
            "--duration",
            "15",
            "--warmup",
            "3",
            "--max-new-tokens",
            "16",
            "--draft-model",
            str(tiny_pair.draft),
            "--target-model",
            str(tiny_pair.target),
            "--report",
            str(report_path),
            "--log-dir",
            str(tmp_path / "logs"),
        ]
    )
    report = json.loads(report_path.read_text())
    assert report["errors"] == {}, report["error_examples"]
    assert report["requests"] > 8 and report["ok"] == report["requests"]
    assert 0 < report["streamed"] < report["requests"], "both Generate and GenerateStream should be exercised"
    assert report["open_sessions_after"] == {"draft": 0, "target": 0}
    assert report["tokens_per_s"] > 0
    for figures in (report["latency_ms"], report["server_total_ms"], report["ttft_ms"]):
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"]
    for when in ("start", "mid", "end"):
        assert set(report["rss_bytes"][when]) == {"draft", "target", "coordinator"}
        assert all(rss > 0 for rss in report["rss_bytes"][when].values())
    assert code == 0 and report["passed"], report["failures"]
