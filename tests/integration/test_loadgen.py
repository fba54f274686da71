"""specdec.tools.loadgen against a running coordinator, through its gRPC API and its
OpenAI-compatible API: every request streams, the figures come from what the client saw and
the server's own figures (usage, speculation extras or stats), failures are counted by status,
never folded into the latencies, and the command line runs for a duration and saves it all."""

from __future__ import annotations

import asyncio
import json

from specdec.tools.loadgen import Load, main, report, run_load, summarise
from tests.stack import inprocess_stack

PROMPTS = ["def add(a, b):", "The quick brown fox", "SELECT name FROM"]


def check_figures(summary: dict, outcomes: list, requests: int) -> None:
    assert (summary["requests"], summary["succeeded"], summary["errors"]) == (requests, requests, {}), summary
    assert all(1 <= o.output_tokens <= 8 and o.ttft_s is not None and o.ttft_s <= o.e2e_s for o in outcomes)
    assert summary["output_tokens"] == sum(o.output_tokens for o in outcomes)
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p99"]
    speculation = summary["speculation"]
    assert 0.0 <= speculation["acceptance_rate"] <= 1.0 and speculation["tokens_per_round"] >= 1.0
    assert speculation["rounds"] == sum(o.rounds for o in outcomes)


async def test_closed_and_open_loads_over_http_and_grpc_report_latency_throughput_and_speculation(tiny_pair):
    async with inprocess_stack(tiny_pair, coordinator_overrides={"http_port": 0}) as stack:
        addresses = (f"http://127.0.0.1:{stack.coordinator.http_port}/v1", f"127.0.0.1:{stack.coordinator.port}")
        for address in addresses:
            for rate in (None, 50.0):
                load = Load(address, None, 5, 2, rate, max_tokens=8, temperature=0.0, prompts=PROMPTS)
                outcomes, wall_s = await run_load(load)
                summary = summarise(outcomes, wall_s)
                check_figures(summary, outcomes, 5)
                text = report(summary, load)
                assert "5/5 requests succeeded" in text and "time to first token (ms)" in text and "acceptance" in text


async def test_failed_requests_are_counted_by_status(tiny_pair):
    async with inprocess_stack(tiny_pair, coordinator_overrides={"http_port": 0}) as stack:
        base = f"http://127.0.0.1:{stack.coordinator.http_port}/v1"
        load = Load(base, "not-this-model", 3, 3, None, max_tokens=4, temperature=0.0, prompts=PROMPTS)
        summary = summarise(*await run_load(load))
        assert (summary["succeeded"], summary["errors"]) == (0, {"HTTP 404": 3})
        assert summary["e2e_ms"] == {} and summary["output_tokens"] == 0
        load = Load(f"127.0.0.1:{stack.coordinator.port}", None, 3, 3, None, max_tokens=0, temperature=0.0)
        summary = summarise(*await run_load(load))
        assert (summary["succeeded"], summary["errors"]) == (0, {"gRPC INVALID_ARGUMENT": 3})


async def test_the_command_runs_for_a_duration_and_saves_every_request(tiny_pair, tmp_path):
    async with inprocess_stack(tiny_pair) as stack:
        out, prompts = tmp_path / "load.json", tmp_path / "prompts.json"
        prompts.write_text(json.dumps(PROMPTS))  # the built-in ones are longer than the tiny model's context
        argv = [f"127.0.0.1:{stack.coordinator.port}", "--duration", "1.5", "--concurrency", "2"]
        argv += ["--max-tokens", "8", "--prompts-file", str(prompts), "--out", str(out), "--no-progress"]
        assert await asyncio.to_thread(main, argv) == 0
        saved = json.loads(out.read_text())
        assert saved["summary"]["requests"] == len(saved["requests"]) >= 2
        assert saved["summary"]["wall_s"] >= 1.5 and saved["summary"]["errors"] == {}
