"""Tracing, metrics and log correlation, end to end.

Traces: the three services run as processes exporting OTLP to a receiver on loopback (the
stand-in for Jaeger's ingest); a traced client call must come back as one trace with the
expected parent/child links and round attributes. Metrics: each server's /metrics endpoint is
scraped around a request and the counters must move by exactly what the response reports.
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest
from opentelemetry.instrumentation.grpc import client_interceptor, grpcext
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from specdec.rpc import telemetry
from specdec.tools.launch import local_stack
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc
from tests.integration.test_coordinator_modes import (
    test_stale_predraft_is_cancelled_on_the_draft_and_never_used as stale_predraft_check,
)
from tests.otlp_receiver import OtlpTraceReceiver
from tests.stack import inprocess_stack

SERVICES = {"specdec-coordinator", "specdec-draft", "specdec-target"}


@pytest.fixture
def receiver():
    receiver = OtlpTraceReceiver()
    endpoint = receiver.start()
    receiver.endpoint = endpoint
    yield receiver
    receiver.stop()


def test_one_request_is_one_trace_across_the_three_services(tiny_pair, receiver, tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    client_spans = InMemorySpanExporter()
    client_tracing = TracerProvider()
    client_tracing.add_span_processor(SimpleSpanProcessor(client_spans))
    with local_stack(
        tiny_pair.draft, tiny_pair.target, tmp_path, threads=1, coordinator_args=["--pipeline", "on"]
    ) as services:
        channel = grpcext.intercept_channel(
            grpc.insecure_channel(services["coordinator"].address), client_interceptor(tracer_provider=client_tracing)
        )
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        response = stub.Generate(
            pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=24, num_speculative_tokens=3), timeout=60
        )
        stats = response.stats
        (client,) = client_spans.get_finished_spans()
        trace_id = format(client.context.trace_id, "032x")

        def drafted(spans) -> int:
            """Rounds whose drafts came from a draft call (not a pre-draft, a catch-up step, or
            none: a last round with no room for drafts)."""
            return sum(s.name == "round" and s.attributes["specdec.round.drafts_from"] == "draft" for s in spans)

        def complete(spans) -> bool:
            names = [s.name for s in spans]
            ids = {s.span_id for s in spans}
            orphans = [s for s in spans if s.parent_span_id not in ids and s.name != "/specdec.v1.Coordinator/Generate"]
            return (
                {s.service for s in spans} == SERVICES
                and "/specdec.v1.Coordinator/Generate" in names
                and names.count("round") == names.count("target.verify") == stats.rounds
                # The draft exports in batches of its own: wait for its spans too.
                and names.count("draft.propose") >= drafted(spans)
                and not orphans
            )

        spans = receiver.wait_for(trace_id, complete)

        # One trace: the coordinator continues the client's span, every round hangs off it.
        by_id = {span.span_id: span for span in spans}
        (server,) = [
            s for s in spans if s.service == "specdec-coordinator" and s.name == "/specdec.v1.Coordinator/Generate"
        ]
        assert server.parent_span_id == format(client.context.span_id, "016x")
        rounds = sorted((s for s in spans if s.name == "round"), key=lambda s: s.attributes["specdec.round.index"])
        assert [r.attributes["specdec.round.index"] for r in rounds] == list(range(stats.rounds))
        assert all(r.parent_span_id == server.span_id for r in rounds)
        assert [r.attributes["specdec.round.k"] for r in rounds] == list(stats.k_per_round)
        assert sum(r.attributes["specdec.round.accepted"] for r in rounds) == stats.accepted_tokens
        assert sum(r.attributes["specdec.round.next_token"] == "recovered" for r in rounds) == stats.recovered_tokens
        assert all(r.attributes["specdec.round.pipelined"] for r in rounds)
        assert {r.attributes["specdec.round.drafts_from"] for r in rounds} <= {"draft", "predraft", "catch-up", "none"}
        assert sum(r.attributes["specdec.round.drafts_from"] == "predraft" for r in rounds) == stats.predraft_hits
        # The first round, and any after a missed pre-draft, is a target-only catch-up step.
        assert rounds[0].attributes["specdec.round.drafts_from"] == "catch-up"
        assert sum(r.attributes["specdec.round.drafts_from"] == "catch-up" for r in rounds) == stats.catch_up_rounds

        def round_of(span) -> dict:
            """Walks up to the round a service span belongs to: service span -> the
            coordinator's client span (a round's calls go as stream messages, each carrying
            its client span's context; a pre-draft's unary call has a server span between)
            -> the round."""
            while span.name != "round":
                assert span.parent_span_id in by_id, f"{span.service} {span.name} has a parent outside the trace"
                span = by_id[span.parent_span_id]
            return span

        verifies = [s for s in spans if s.name == "target.verify"]
        assert len(verifies) == stats.rounds
        assert {round_of(v).span_id for v in verifies} == {r.span_id for r in rounds}
        for verify in verifies:
            # The coordinator's span for the call, sent with the VerifyStream message.
            caller = by_id[verify.parent_span_id]
            assert caller.name == "/specdec.v1.Target/Verify" and caller.service == "specdec-coordinator"
            assert caller.attributes["specdec.on_stream"]
            assert verify.attributes["specdec.forward_ms"] > 0 and verify.attributes["specdec.cache_length"] > 0
        proposes = [s for s in spans if s.name == "draft.propose"]
        assert len(proposes) >= drafted(spans)
        for propose in proposes:
            round_of(propose)
            assert propose.attributes["specdec.session_id"] and "specdec.epoch" in propose.attributes

        # The coordinator's log line for the request carries the same trace id.
        log = (tmp_path / "coordinator.log").read_text()
        assert re.search(
            rf"trace_id={trace_id} span_id=[0-9a-f]{{16}}: generated {stats.generated_tokens} tokens", log
        ), log[-2000:]

        # A collector that goes away costs requests nothing.
        receiver.stop()
        again = stub.Generate(
            pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=24, num_speculative_tokens=3), timeout=60
        )
        assert list(again.token_ids) == list(response.token_ids)


def test_tracing_is_off_without_an_endpoint():
    assert not telemetry.tracing_requested({})
    assert not telemetry.tracing_requested(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}
    )
    assert telemetry.tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317"})
    if not telemetry.tracing_requested():
        assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []


@pytest.mark.parametrize("overrides", [{"pipeline": True}, {"hedges": 3}], ids=["predraft", "hedges"])
async def test_traced_calls_still_cancel_stale_predrafts_on_the_wire(tiny_pair, reference, overrides, monkeypatch):
    """With the tracing interceptor on the coordinator's channels, a cancelled pre-draft or
    hedge must still be cancelled on the draft service (and its span ended)."""
    monkeypatch.setattr(telemetry, "_provider", TracerProvider())  # no exporter: spans go nowhere
    assert telemetry.client_interceptors()
    await stale_predraft_check(tiny_pair, reference, overrides)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_metrics_move_by_what_the_response_reports(tiny_pair):
    async with inprocess_stack(
        tiny_pair,
        draft_overrides={"quantize": "none", "metrics_port": 0},
        coordinator_overrides={"metrics_port": 0},
        target_overrides={"metrics_port": 0},
    ) as stack:
        ports = {
            "coordinator": stack.coordinator.metrics_port,
            "draft": stack.draft.metrics_port,
            "target": stack.target.metrics_port,
        }
        before = {name: scrape(port) for name, port in ports.items()}
        response = await stack.stub.Generate(
            pb.GenerateRequest(prompt="The quick brown fox", max_new_tokens=20, num_speculative_tokens=3), timeout=60
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await stack.stub.Generate(pb.GenerateRequest(prompt="x", temperature=-1.0), timeout=60)
        after = {name: scrape(port) for name, port in ports.items()}
    s = response.stats
    c_before, c_after = before["coordinator"], after["coordinator"]
    assert moved(c_before, c_after, "specdec_requests_total", finish_reason="length", code="OK") == 1
    assert moved(c_before, c_after, "specdec_requests_total", finish_reason="", code="INVALID_ARGUMENT") == 1
    assert moved(c_before, c_after, "specdec_spec_decode_num_drafts_total") == sum(1 for k in s.k_per_round if k)
    assert moved(c_before, c_after, "specdec_spec_decode_num_draft_tokens_total") == s.proposed_tokens
    assert moved(c_before, c_after, "specdec_spec_decode_num_accepted_tokens_total") == s.accepted_tokens > 0
    for position, accepted in enumerate(s.accepted_per_position):
        assert (
            moved(c_before, c_after, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
            == accepted
        )
    assert moved(c_before, c_after, "specdec_spec_decode_num_recovered_tokens_total") == s.recovered_tokens
    assert moved(c_before, c_after, "specdec_spec_decode_num_bonus_tokens_total") == s.bonus_tokens
    assert moved(c_before, c_after, "specdec_generation_tokens_total") == s.generated_tokens == 20
    assert moved(c_before, c_after, "specdec_time_to_first_token_seconds_count") == 1
    assert moved(c_before, c_after, "specdec_round_latency_seconds_count") == s.rounds
    assert moved(c_before, c_after, "specdec_time_per_output_token_seconds_sum") == pytest.approx(
        (s.total_ms - s.time_to_first_token_ms) / 1e3 / (s.generated_tokens - 1), rel=1e-3
    )
    # The model services: one verify per round, one propose per drafted round (sequential mode).
    assert moved(before["target"], after["target"], "specdec_target_forward_seconds_count", rpc="verify") == s.rounds
    assert moved(before["draft"], after["draft"], "specdec_draft_forward_seconds_count", rpc="propose") == sum(
        1 for k in s.k_per_round if k
    )
    assert moved(
        before["target"], after["target"], "specdec_target_forward_seconds_sum", rpc="verify"
    ) == pytest.approx(s.target_compute_ms / 1e3, rel=1e-3)
    # The prompt once, then per round the previous round's recovered/bonus token and the drafts.
    processed = s.prompt_tokens + (s.rounds - 1) + s.proposed_tokens
    assert moved(before["target"], after["target"], "specdec_target_processed_tokens_total") == processed
    for service in ("draft", "target"):
        assert ("specdec_sessions_open", ()) in after[service] and ("specdec_kv_cache_bytes", ()) in after[service]
