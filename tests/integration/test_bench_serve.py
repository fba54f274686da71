"""bench.serve against a running coordinator's OpenAI-compatible API: every request streams,
the figures come from what the client saw and the server's usage and speculation extras, and
failures are counted by status, never folded into the latencies."""

from __future__ import annotations

from bench.serve import Load, report, run_load, summarise
from tests.stack import inprocess_stack

PROMPTS = ["def add(a, b):", "The quick brown fox", "SELECT name FROM"]


async def test_a_closed_and_an_open_load_report_latency_throughput_and_speculation(tiny_pair):
    async with inprocess_stack(tiny_pair, coordinator_overrides={"http_port": 0}) as stack:
        base = f"http://127.0.0.1:{stack.coordinator.http_port}/v1"
        for rate in (None, 50.0):
            load = Load(base, None, 5, 2, rate, max_tokens=8, temperature=0.0, prompts=PROMPTS)
            outcomes, wall_s = await run_load(load)
            summary = summarise(outcomes, wall_s)
            assert (summary["requests"], summary["succeeded"], summary["errors"]) == (5, 5, {}), summary
            assert all(1 <= o.output_tokens <= 8 and o.ttft_s is not None and o.ttft_s <= o.e2e_s for o in outcomes)
            assert summary["output_tokens"] == sum(o.output_tokens for o in outcomes)
            assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p99"]
            speculation = summary["speculation"]
            assert 0.0 <= speculation["acceptance_rate"] <= 1.0 and speculation["tokens_per_round"] >= 1.0
            assert speculation["rounds"] == sum(o.rounds for o in outcomes)
            text = report(summary, load)
            assert "5/5 requests succeeded" in text and "time to first token (ms)" in text and "acceptance" in text


async def test_failed_requests_are_counted_by_status(tiny_pair):
    async with inprocess_stack(tiny_pair, coordinator_overrides={"http_port": 0}) as stack:
        base = f"http://127.0.0.1:{stack.coordinator.http_port}/v1"
        load = Load(base, "not-this-model", 3, 3, None, max_tokens=4, temperature=0.0, prompts=PROMPTS)
        summary = summarise(*await run_load(load))
        assert (summary["succeeded"], summary["errors"]) == (0, {"HTTP 404": 3})
        assert summary["e2e_ms"] == {} and summary["output_tokens"] == 0
