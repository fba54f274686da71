"""Real grpc.aio draft, target and coordinator servers on loopback port 0, in this process."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.emulated import service_command
from coordinator import server as coordinator_server
from coordinator.clients import DraftClient, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.rounds import RoundRules
from coordinator.servicer import CoordinatorServicer
from coordinator.servicer import add_to_server as add_coordinator_servicer
from draft_service import server as draft_server
from draft_service.config import DraftConfig
from draft_service.runner import DraftRunner
from draft_service.servicer import DraftServicer
from specdec.config.services import ClientSecurity
from specdec.rpc.local import LocalChannel
from specdec.rpc.model_thread import ModelThread
from specdec.rpc.ports import free_port
from specdec.rpc.security import aio_channel, load_client_security
from specdec.rpc.serving import RunningServer, build_model_servicer
from specdec.tools.launch import ServiceProcess, spawn, stop_all
from specdec.tools.testing import TinyPair
from specdec.v1 import coordinator_pb2_grpc, draft_pb2_grpc, target_pb2_grpc
from target_service import server as target_server
from target_service.config import TargetConfig
from target_service.runner import TargetRunner
from target_service.servicer import TargetServicer


def model_service_config(cls, folder, **overrides):
    """The service's declared defaults, with what tests need instead: a free port, no metrics
    server, fewer sessions, no start-up calibration (tested where it is the subject) and no
    confidence stops, so K means K."""
    base = dict(
        model=str(folder),  # an override's `model` wins (an EAGLE draft reads its target's folder)
        port=0,
        metrics_port=-1,
        max_sessions=64,
        session_ttl_s=60.0,
        calibrate=False,
        **({} if cls is TargetConfig else {"min_confidence": 0.0}),
    )
    base.update(overrides)
    return cls(**base)


def slow_down(runner, seconds: float) -> None:
    """Makes every forward pass of `runner`'s model take `seconds` longer (a slow node),
    whichever runner path runs it (one session's, a batched pass, a DecodeBatch step)."""
    plain_forward = runner.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return plain_forward(*args, **kwargs)

    runner.model.forward = slow_forward


@dataclass
class Stack:
    stub: coordinator_pb2_grpc.CoordinatorStub
    channel: grpc.aio.Channel | LocalChannel
    draft: RunningServer | None  # None in a local stack: no servers
    target: RunningServer | None
    coordinator: RunningServer | None
    draft_runner: DraftRunner
    target_runner: TargetRunner
    coordinator_config: CoordinatorConfig


def configured(config: CoordinatorConfig, overrides: dict | None) -> tuple[CoordinatorConfig, RoundRules]:
    """A test's coordinator overrides applied: RoundRules' fields (`catch_up`, `live_costs`)
    to the round rules, which are no flags, the rest to the config, whose overlap is the plain
    one (sequential, no hedges, one bonus guess) where the test leaves it."""
    rule_names = {item.name for item in dataclasses.fields(RoundRules)}
    overrides = overrides or {}
    rules = RoundRules(**{name: value for name, value in overrides.items() if name in rule_names})
    # A test names the overlap it runs: the plain one unless it says (auto has tests of its own).
    settings = {"pipeline": False, "hedges": 0, "bonus_guesses": 1}
    settings.update((name, value) for name, value in overrides.items() if name not in rule_names)
    return dataclasses.replace(config, **settings), rules


@asynccontextmanager
async def local_stack(
    pair: TinyPair,
    draft_overrides: dict | None = None,
    coordinator_overrides: dict | None = None,
    target_overrides: dict | None = None,
    prepare_runners: Callable[[DraftRunner, TargetRunner], None] | None = None,
    draft_runner_overrides: dict | None = None,
) -> AsyncIterator[Stack]:
    """The same coordinator, servicers and runners as `inprocess_stack`, joined by in-process
    channels (specdec.rpc.local) instead of loopback gRPC: every message is still serialised and
    parsed, and errors still travel as status codes, but no socket, HTTP/2 or interceptor is
    involved. For tests that need thousands of generations and test the math, not the wire.
    `draft_runner_overrides` as in `inprocess_stack`.

    Both services run their passes on one model thread (so do `inprocess_stack`'s). In one
    process two model threads can only take turns with the GIL anyway, and every torch op
    releases and retakes it, so with two the GIL changed hands at nearly every op: about 20,000
    context switches a second, and a case of test_distribution.py ran 18 s where one thread
    runs it in 14 (2-core EPYC)."""
    draft_config = model_service_config(DraftConfig, pair.draft, **(draft_overrides or {}))
    target_config = model_service_config(TargetConfig, pair.target, **(target_overrides or {}))
    draft_runner = draft_server.load_runner(draft_config, **(draft_runner_overrides or {}))
    target_runner = target_server.load_runner(target_config)
    if prepare_runners is not None:
        prepare_runners(draft_runner, target_runner)
    model_thread = ModelThread("model")
    channels = {}
    for role, config, runner, make, add in (
        ("draft", draft_config, draft_runner, DraftServicer, draft_pb2_grpc.add_DraftServicer_to_server),
        ("target", target_config, target_runner, TargetServicer, target_pb2_grpc.add_TargetServicer_to_server),
    ):
        servicer, _, _ = build_model_servicer(config, runner, make, f"specdec.v1.{role.title()}", model_thread)
        channels[role] = LocalChannel()
        add(servicer, channels[role])
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, channels[role])
    coordinator_config, rules = configured(
        CoordinatorConfig(
            draft_address="in-process draft",
            target_address="in-process target",
            tokenizer=str(pair.target),
            port=0,
            metrics_port=-1,
        ),
        coordinator_overrides,
    )
    draft = DraftClient(coordinator_config.draft_address, coordinator_config.draft_timeout_s, channel=channels["draft"])
    target = TargetClient(
        coordinator_config.target_address, coordinator_config.target_timeout_s, channel=channels["target"]
    )
    coordinator = await coordinator_server.connect(coordinator_config, draft, target, rules)
    channel = LocalChannel()
    add_coordinator_servicer(CoordinatorServicer(coordinator), channel)
    try:
        yield Stack(
            coordinator_pb2_grpc.CoordinatorStub(channel),
            channel,
            None,
            None,
            None,
            draft_runner,
            target_runner,
            coordinator_config,
        )
    finally:
        coordinator.close()
        await coordinator.wait_cleanup()
        model_thread.shutdown()


@asynccontextmanager
async def inprocess_stack(
    pair: TinyPair,
    draft_overrides: dict | None = None,
    coordinator_overrides: dict | None = None,
    target_overrides: dict | None = None,
    client_security: ClientSecurity | None = None,
    prepare_runners: Callable[[DraftRunner, TargetRunner], None] | None = None,
    draft_runner_overrides: dict | None = None,
) -> AsyncIterator[Stack]:
    """`client_security`: how the stack's own stub reaches the coordinator (TLS, token).
    `prepare_runners` runs on the loaded runners before any server starts (to slow one down
    and then calibrate, say). `draft_runner_overrides`: `DraftRunner` arguments that are no
    flags, only tests' (`proposal_mode` "greedy": one-hot proposals; `proposal_top_k` 0: dense
    full rows, or a small k), which the service leaves at their defaults."""
    draft_config = model_service_config(DraftConfig, pair.draft, **(draft_overrides or {}))
    target_config = model_service_config(TargetConfig, pair.target, **(target_overrides or {}))
    draft_runner = draft_server.load_runner(draft_config, **(draft_runner_overrides or {}))
    target_runner = target_server.load_runner(target_config)
    if prepare_runners is not None:
        prepare_runners(draft_runner, target_runner)
    started: list[RunningServer] = []
    channel = None
    model_thread = ModelThread("model")  # both services' passes, as in local_stack
    try:
        draft = await draft_server.build_server(draft_config, draft_runner, model_thread)
        started.append(draft)
        target = await target_server.build_server(target_config, target_runner, model_thread)
        started.append(target)
        coordinator_config = CoordinatorConfig(
            draft_address=f"127.0.0.1:{draft.port}",
            target_address=f"127.0.0.1:{target.port}",
            tokenizer=str(pair.target),
            port=0,
            metrics_port=-1,
            connect_timeout_s=10.0,
        )
        coordinator_config, rules = configured(coordinator_config, coordinator_overrides)
        coordinator = await coordinator_server.build_server(coordinator_config, rules)
        started.insert(0, coordinator)
        channel = aio_channel(
            f"127.0.0.1:{coordinator.port}", [], load_client_security(client_security or ClientSecurity())
        )
        yield Stack(
            coordinator_pb2_grpc.CoordinatorStub(channel),
            channel,
            draft,
            target,
            coordinator,
            draft_runner,
            target_runner,
            coordinator_config,
        )
    finally:
        if channel is not None:
            await channel.close()
        for running in started:
            await running.stop(0)
        model_thread.shutdown()


ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120


class ProcessStack:
    """Draft, target and coordinator as processes. Draft and target keep their ports, so a
    killed one can be restarted on the address the coordinator knows; everything started is
    stopped, newest first, on exit."""

    def __init__(self, pair, logs: Path, coordinator_args: list[str], target_args: list[str] = ()) -> None:
        self.logs = logs
        self.args = {
            "draft": ["--model", str(pair.draft), "--quantize", "none"],
            "target": ["--model", str(pair.target), *target_args],
            "coordinator": ["--tokenizer", str(pair.target), *coordinator_args],
        }
        self.ports = {role: free_port() for role in self.args}
        self.processes: list[ServiceProcess] = []
        self.current: dict[str, ServiceProcess] = {}

    def start(self, role: str) -> ServiceProcess:
        name = f"{role}-{sum(p.name.startswith(role) for p in self.processes)}"
        args = self.args[role]
        if role == "coordinator":
            module = "coordinator"
            args = ["--draft", self.current["draft"].address, "--target", self.current["target"].address, *args]
        else:
            module, args = service_command(role, args)
        process = spawn(
            name, module, args, self.ports[role], self.logs / f"{name}.log", env={"OMP_NUM_THREADS": "1"}, cwd=ROOT
        )
        self.processes.append(process)
        self.current[role] = process
        return process

    def kill(self, role: str) -> None:
        self.current[role].process.kill()
        self.current[role].process.wait()

    def __enter__(self) -> ProcessStack:
        try:
            for role in ("draft", "target"):
                self.start(role)
            for role in ("draft", "target"):
                self.current[role].wait_healthy(START_TIMEOUT_S)
            self.start("coordinator").wait_healthy(START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_all(self.processes)

    def channel(self, role: str = "coordinator") -> grpc.Channel:
        return grpc.insecure_channel(self.current[role].address)
