"""The services on separate network hosts (specdec.tools.testbed): a namespace each for the
client, the coordinator, the draft and the target, joined by a bridge, with each link's latency
added by a forwarder. The services start by README's own commands, the client by its documented
command on its own host; greedy output equals transformers' `generate()` on the target; the
links really carry their delays; and nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.tools.delay_link import LinkDelay
from specdec.tools.testbed import PREFIX, Testbed, available, ip, leftovers, sweep
from tests.heavy.test_readme_commands import as_run_here, readme_commands

ROOT = Path(__file__).resolve().parents[2]
LINKS = {
    "client": LinkDelay(),  # a host's delay is in front of what it serves; the client serves nothing
    "coordinator": LinkDelay(0.5),
    "draft": LinkDelay(2.0, jitter_ms=0.2),  # across zones
    "target": LinkDelay(0.05),  # same rack
}
PROMPTS = ("def add(a, b):", "The quick brown fox", "SELECT name, count(*) FROM")
NEW_TOKENS = 24

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)")


def fastest_round_trip_ms(address: str, calls: int = 8) -> float:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connect first
        best = float("inf")
        for _ in range(calls):
            started = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            best = min(best, (time.perf_counter() - started) * 1e3)
    return best


def test_greedy_output_across_hosts_equals_the_target_and_nothing_is_left(tiny_pair, reference, tmp_path):
    problem = available()
    assert problem is None, f"a testbed cannot be built here: {problem}"
    commands = readme_commands()
    with Testbed(LINKS) as bed:
        tag = bed.tag
        values = {
            "DRAFT_FOLDER": str(tiny_pair.draft),
            "TARGET_FOLDER": str(tiny_pair.target),
        }
        draft = bed.serve("draft", "draft_service", as_run_here(commands["draft_service"], values), tmp_path / "d.log")
        target = bed.serve(
            "target", "target_service", as_run_here(commands["target_service"], values), tmp_path / "t.log"
        )
        for service in (draft, target):
            service.wait_healthy(120)
        # README's HOST_A and HOST_B are the draft's and the target's hosts.
        values |= {"HOST_A:50061": draft.address, "HOST_B:50062": target.address}
        coordinator = bed.serve(
            "coordinator", "coordinator", as_run_here(commands["coordinator"], values), tmp_path / "c.log"
        )
        coordinator.wait_healthy(120)

        # The links carry their delays: a call's round trip is at least twice the link's
        # one-way delay (from this namespace, through the bridge, to the host's forwarder).
        assert fastest_round_trip_ms(draft.address) >= 2 * LINKS["draft"].delay_ms
        assert fastest_round_trip_ms(target.address) >= 2 * LINKS["target"].delay_ms

        # Each K once (chosen, target-only, fixed), each on its own prompt: a client command
        # is a process of its own, seconds to start.
        for prompt, k in zip(PROMPTS, (None, 0, 4)):
            argv = [sys.executable, "-m", "specdec.tools.client", "--address", coordinator.address, "--json"]
            argv += ["--max-new-tokens", str(NEW_TOKENS), *(["--k", str(k)] if k is not None else []), prompt]
            run = bed.run("client", argv, cwd=ROOT)
            assert run.returncode == 0, run.stderr[-2000:]
            response = json.loads(run.stdout)
            ids = [int(i) for i in response.get("token_ids", [])]
            assert ids == reference(prompt, NEW_TOKENS), f"{prompt!r} K={k}"
            if k != 0:
                assert int(response["stats"].get("proposed_tokens", 0)) > 0, "the draft host was never used"
        assert len(bed.leftovers()) == len(LINKS) + 1 + len(LINKS)  # namespaces, the bridge, veths
    assert not leftovers(tag)


def test_a_testbed_left_by_a_killed_process_is_swept():
    assert available() is None
    dead = 4_000_000  # above any pid this machine hands out (pid_max is 4,194,304 at most)
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    name = f"{PREFIX}{dead}-stale"
    ip("netns", "add", name)
    try:
        assert name in sweep()
        assert name not in ip("netns", "list").stdout.split()
    finally:
        ip("netns", "delete", name, check=False)


def readme_ports(args: list[str]) -> int:
    return int(args[args.index("--port") + 1])


def wait_logged(log: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"{log.name} never logged {text!r}: {log.read_text()[-2000:]}"
        time.sleep(0.2)


def test_readmes_cross_host_commands_run_as_written_on_hosts_of_their_own(tiny_pair, reference, tmp_path):
    """README's three commands exactly as written, their ports and --host included, each on a
    host of its own with nothing in front of it: HOST_A and HOST_B are the draft's and the
    target's hosts, and the client calls the coordinator as README's client does, on its host.
    A service that bound only its own loopback would be unreachable from the coordinator."""
    problem = available()
    assert problem is None, f"a testbed cannot be built here: {problem}"
    commands = readme_commands()
    with Testbed({"draft": LinkDelay(), "target": LinkDelay(), "coordinator": LinkDelay()}) as bed:
        values = {
            "DRAFT_FOLDER": str(tiny_pair.draft),
            "TARGET_FOLDER": str(tiny_pair.target),
            "HOST_A": bed.hosts["draft"].address,
            "HOST_B": bed.hosts["target"].address,
        }

        def as_written(module: str) -> list[str]:
            return [re.sub(r"[A-Z_]+_FOLDER|HOST_[AB]", lambda m: values[m.group(0)], w) for w in commands[module]]

        services = {}
        for host, module in (("draft", "draft_service"), ("target", "target_service")):
            args = as_written(module)
            services[host] = bed.serve_direct(host, module, args, readme_ports(args), tmp_path / f"{host}.log")
        for service in services.values():
            service.wait_healthy(120)  # from this machine's namespace, through the bridge
        args = as_written("coordinator")
        bed.serve_direct("coordinator", "coordinator", args, readme_ports(args), tmp_path / "coordinator.log")
        wait_logged(tmp_path / "coordinator.log", f"on 127.0.0.1:{readme_ports(args)}", 120)
        argv = [sys.executable, "-m", "specdec.tools.client", "--address", f"127.0.0.1:{readme_ports(args)}", "--json"]
        run = bed.run("coordinator", [*argv, "--max-new-tokens", str(NEW_TOKENS), PROMPTS[0]], cwd=ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        response = json.loads(run.stdout)
        assert [int(i) for i in response["token_ids"]] == reference(PROMPTS[0], NEW_TOKENS)
        assert int(response["stats"].get("proposed_tokens", 0)) > 0, "the draft host was never used"
