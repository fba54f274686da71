"""Replica pools with real processes: sessions spread over target replicas and stay put; a
replica killed mid-request hands its sessions over with the output unchanged; a draining
replica gets no new sessions; a replica that is missing, serves another model, or is found
by DNS; every target replica down; and a pool of EAGLE heads."""

from __future__ import annotations

import signal
import time

import grpc

from specdec.engine.eagle import EAGLE3
from specdec.tools.launch import free_port
from specdec.tools.testing import build_eagle_head
from specdec.v1 import coordinator_pb2_grpc, draft_pb2_grpc
from tests.pool_helpers import (
    PROMPT,
    DnsServer,
    Processes,
    finish_streams,
    generate,
    kill,
    metric,
    open_sessions,
    start_streams,
    streamed_tokens,
    until_placed_on,
    wait_all,
)


def test_sessions_spread_stay_put_and_fail_over_and_a_draining_replica_gets_none(tiny_pair, reference, tmp_path):
    with Processes(tiny_pair, tmp_path) as processes:
        drafts = [processes.draft(), processes.draft()]
        port_a = free_port()
        a, b = processes.target(port_a), processes.target(args=["--shutdown-grace", "30"])
        wait_all(*drafts, a, b)
        coordinator = processes.coordinator(
            f"{drafts[0].address},{drafts[1].address}", f"{a.address},{b.address}", "--connect-timeout", "20"
        )
        wait_all(coordinator)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            started = start_streams(stub)
            # Placed by least load: two sessions on each replica of each pool.
            assert open_sessions(a) >= 1 and open_sessions(b) >= 1
            kill(a)  # mid-generation: its sessions move to b and are re-sent their sequences
            kill(drafts[0])  # and the draft's to the other draft replica
            chunks = finish_streams(started)
            stats = [got[-1].stats for got in chunks]
            for got in chunks:
                assert streamed_tokens(got) == reference(PROMPT, 60)
            assert all(s.target_replica == b.address and s.draft_replica == drafts[1].address for s in stats)
            assert sum(s.replica_moves for s in stats) == 4  # two target sessions, two draft sessions
            # Every session stayed on its replica between moves: a call landing on a replica
            # that never saw the session would have cost a re-prefill.
            assert all(s.reprefills == 0 for s in stats)

            # a comes back on its address and takes sessions again.
            a = processes.target(port_a)
            wait_all(a)
            until_placed_on(stub, a.address, reference)
            # b drains (SIGTERM: NOT_SERVING, then 30 s of grace): no new session goes there.
            b.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # a refresh (0.3 s) sees it
            for _ in range(4):
                response = generate(stub)
                assert list(response.token_ids) == reference(PROMPT, 24)
                assert response.stats.target_replica == a.address and response.stats.replica_moves == 0


def test_a_pool_starts_without_a_missing_replica_refuses_another_model_and_names_the_pool_when_all_are_down(
    tiny_pair, reference, tmp_path
):
    with Processes(tiny_pair, tmp_path) as processes:
        draft, a = processes.draft(), processes.target()
        other = processes.target(model=tiny_pair.draft)  # same tokenizer, another model
        wait_all(draft, a, other)
        port_c = free_port()  # nothing there yet
        c_address = f"127.0.0.1:{port_c}"
        pool = f"{a.address},{other.address},{c_address}"
        coordinator = processes.coordinator(draft.address, pool, "--connect-timeout", "2")
        wait_all(coordinator)
        log = coordinator.log.read_text()
        assert f"target replica {c_address} is not serving" in log, log[-3000:]
        assert f"target replica {other.address} refused: it serves model_id" in log, log[-3000:]
        assert "and they differ in weights_fingerprint" in log, log[-3000:]
        assert metric(coordinator, "specdec_replica_refused", {"pool": "target", "address": other.address}) == 1
        assert metric(coordinator, "specdec_replica_serving", {"pool": "target", "address": a.address}) == 1
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for _ in range(3):
                response = generate(stub)
                assert list(response.token_ids) == reference(PROMPT, 24)
                assert response.stats.target_replica == a.address
            c = processes.target(port_c)  # the missing replica comes up and joins
            wait_all(c)
            until_placed_on(stub, c_address, reference)
            kill(a)
            kill(c)
            try:
                generate(stub)
                raise AssertionError("a request with every target replica down succeeded")
            except grpc.RpcError as down:
                assert down.code() == grpc.StatusCode.UNAVAILABLE, down.details()
                assert f"target pool {pool}" in down.details(), down.details()


def test_a_dns_pool_follows_its_records(tiny_pair, reference, tmp_path):
    """Two targets on one port of two loopback addresses, found through a DNS server the test
    controls: start-up waits for the name to resolve, a new record joins, a removed one gets
    no new sessions, and a lookup that fails keeps the replicas known."""
    with Processes(tiny_pair, tmp_path) as processes, DnsServer("targets.pool.test") as dns:
        port = free_port()
        draft = processes.draft()
        a, b = processes.target(port, "127.0.0.1"), processes.target(port, "127.0.0.2")
        wait_all(draft, a, b)
        coordinator = processes.coordinator(draft.address, f"dns://127.0.0.1:{dns.port}/targets.pool.test:{port}")
        time.sleep(1.0)  # it asks, and the name does not resolve yet
        assert coordinator.process.poll() is None, coordinator.log.read_text()[-3000:]
        dns.records = ["127.0.0.1"]
        wait_all(coordinator)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert generate(stub).stats.target_replica == a.address
            dns.records = ["127.0.0.1", "127.0.0.2"]
            until_placed_on(stub, b.address, reference)
            dns.records = ["127.0.0.2"]
            time.sleep(1.0)
            for _ in range(3):
                assert generate(stub).stats.target_replica == b.address
            dns.records = []  # NXDOMAIN: the replicas known stay in use
            time.sleep(1.0)
            response = generate(stub)
            assert list(response.token_ids) == reference(PROMPT, 24) and response.stats.target_replica == b.address
            assert metric(coordinator, "specdec_pool_dns_failures_total", {"pool": "target"}) >= 1
        assert "DNS lookup failed" in coordinator.log.read_text()


def test_a_hung_replica_hands_its_sessions_over(tiny_pair, reference, tmp_path):
    """A replica that stops answering without closing its connections (a frozen process, a
    machine that died without a reset, a network that drops its packets; here SIGSTOP): its
    requests in flight move to another replica within a few refreshes, not at their calls'
    deadline, with the output unchanged. Both pools."""
    with Processes(tiny_pair, tmp_path) as processes:
        drafts = [processes.draft(), processes.draft()]
        a, b = processes.target(), processes.target()
        wait_all(*drafts, a, b)
        coordinator = processes.coordinator(f"{drafts[0].address},{drafts[1].address}", f"{a.address},{b.address}")
        wait_all(coordinator)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            running = start_streams(stub)
            assert open_sessions(a) >= 1 and open_sessions(b) >= 1
            started = time.monotonic()
            for process in (a, drafts[0]):
                process.process.send_signal(signal.SIGSTOP)
            try:
                chunks = finish_streams(running)
                waited = time.monotonic() - started
            finally:
                for process in (a, drafts[0]):
                    process.process.send_signal(signal.SIGCONT)
            for got in chunks:
                assert streamed_tokens(got) == reference(PROMPT, 60)
            stats = [got[-1].stats for got in chunks]
            assert all(s.target_replica == b.address and s.draft_replica == drafts[1].address for s in stats)
            assert sum(s.replica_moves for s in stats) == 4
            # Hung for good, the calls would have waited out --target-timeout (60 s) and failed.
            assert waited < 15.0, waited
            # Each stuck round waits on one hung replica, the target or the draft, whichever it
            # called last; whichever pool gives up first finds the calls in flight, so the calls
            # given up on may all be one pool's.
            hung = {"target": a.address, "draft": drafts[0].address}
            log = coordinator.log.read_text()
            said = [f"{role} replica {address} does not answer" in log for role, address in hung.items()]
            assert any(said), log[-3000:]
            abandoned = [
                metric(coordinator, "specdec_replica_abandoned_calls_total", {"pool": role, "address": address}) or 0
                for role, address in hung.items()
            ]
            assert sum(abandoned) >= 1, abandoned

            # Every draft replica hung: the rounds run target-only, not a draft deadline (30 s) each.
            one = start_streams(stub, count=1)
            started = time.monotonic()
            for process in drafts:
                process.process.send_signal(signal.SIGSTOP)
            try:
                [got] = finish_streams(one)
                waited = time.monotonic() - started
            finally:
                for process in drafts:
                    process.process.send_signal(signal.SIGCONT)
            assert streamed_tokens(got) == reference(PROMPT, 60)
            assert waited < 15.0, waited


def test_a_pool_of_eagle_heads_serves_two_targets_and_hands_sessions_over(tiny_pair, reference, tmp_path):
    """Heads pool as model drafts do (issue 68): sessions spread over two head replicas and two
    target replicas, each head fed the features of the target its session verifies on. A head
    killed mid-request hands its sessions to the other, which has none of their features (it
    reads zeros until the next verify brings more), and every output is still the target's."""
    head = build_eagle_head(tmp_path / "head", tiny_pair.target, EAGLE3, draft_vocab=96)
    flags = ["--quantize", "none", "--drafter", "eagle", "--draft-head", str(head)]
    with Processes(tiny_pair, tmp_path) as processes:
        heads = [processes.spawn("draft", tiny_pair.target, free_port(), args=flags) for _ in range(2)]
        targets = [processes.target(), processes.target()]
        wait_all(*heads, *targets)
        coordinator = processes.coordinator(",".join(h.address for h in heads), ",".join(t.address for t in targets))
        wait_all(coordinator)
        with grpc.insecure_channel(coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            started = start_streams(stub)
            assert all(open_sessions(h, draft_pb2_grpc.DraftStub) >= 1 for h in heads)
            assert all(open_sessions(t) >= 1 for t in targets)
            kill(heads[0])
            chunks = finish_streams(started)
            for got in chunks:
                assert streamed_tokens(got) == reference(PROMPT, 60)
            stats = [got[-1].stats for got in chunks]
            assert all(s.draft_replica == heads[1].address for s in stats)
            assert sum(s.replica_moves for s in stats) >= 2  # the killed head's sessions moved
            assert sum(s.proposed_tokens for s in stats) > 0
