"""Starting the three services as separate local processes: for `make run`, the benchmark and
the end-to-end tests. Deployments start them with their own process managers instead."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.ports import free_port
from specdec.tools.forkserver import ForkedProcess, ForkServer

COORDINATOR_START_S = 120.0  # a coordinator loads no model: a minute or two is a hung one


@dataclass
class ServiceProcess:
    name: str
    address: str
    process: subprocess.Popen | ForkedProcess
    log: Path
    local_address: str | None = None  # on a testbed host: the service itself, behind its link
    coordinator: bool = False  # calls the other services, so stop_all stops it before them

    def wait_healthy(self, timeout_s: float) -> None:
        """Blocks until the gRPC health service says SERVING; raises with the log if it exits."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()[-4000:]}"
                    )
                try:
                    response = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s:\n{self.log.read_text()[-4000:]}")

    def wait_listening(self, timeout_s: float) -> None:
        """Blocks until its address accepts TCP connections (a process that serves no gRPC
        health: a forwarder, a framed server); raises with the log if it exits or never does."""
        host, port = self.address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log.read_text()[-2000:]}"
                )
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(
            f"{self.name} not listening on {self.address} after {timeout_s:.0f} s:\n{self.log.read_text()[-2000:]}"
        )

    def metrics_port(self) -> int:
        """The Prometheus port the service bound (spawn passes --metrics-port 0), from its log."""
        match = re.search(r"metrics on http://[^ ]*:(\d+)/metrics", self.log.read_text())
        if match is None:
            raise RuntimeError(f"{self.name} logged no metrics port:\n{self.log.read_text()[-2000:]}")
        return int(match.group(1))

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time."""
        stop_together([self], timeout_s)


def stop_all(services: Iterable[ServiceProcess], timeout_s: float = 15.0) -> None:
    """Stops `services`: the coordinators among them first (a request one drains may still call
    the others), then the rest; each group together (stop_together)."""
    services = list(services)
    stop_together([service for service in services if service.coordinator], timeout_s)
    stop_together([service for service in services if not service.coordinator], timeout_s)


def stop_together(services: Iterable[ServiceProcess], timeout_s: float = 15.0) -> None:
    """SIGTERM to every one of `services` at once, then waits for them all; one still running
    after `timeout_s` is killed. Each spends about two seconds between the signal and its exit
    (a second of NOT_SERVING notice, the drain, the interpreter's exit), so stopping a stack's
    services one after another adds those up."""
    running = [service for service in services if service.process.poll() is None]
    for service in running:
        service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for service in running:
        try:
            service.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


def spawn(
    name: str,
    module: str,
    args: list[str],
    port: int,
    log: Path,
    env: Mapping[str, str | None] | None = None,
    cwd: Path | None = None,
    prefix: Sequence[str] = (),
    cpus: Collection[int] = (),
) -> ServiceProcess:
    """`python -m module args --port port --metrics-port 0`, output to `log`. Metrics take a free
    port, so several local stacks never collide (the log names the port). `env` adds to this
    process's environment; a variable given as None is left out. `prefix` goes before the
    command (`ip netns exec NAME` runs it on a testbed's host: specdec.tools.testbed). `cpus`:
    the cores it may run on (`taskset`; one machine standing in for separate nodes, each
    service's threads one per core: ModelServiceConfig.torch_threads); () leaves it as this
    process is. With SPECDEC_FORK_SERVICES=1 in this process's environment (the tests set it),
    a service with neither is forked from one that imported torch and transformers once
    (specdec.tools.forkserver) instead of starting a fresh interpreter."""
    log.parent.mkdir(parents=True, exist_ok=True)
    given: dict[str, str | None] = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    full_env = {name: value for name, value in given.items() if value is not None}
    argv = ["--metrics-port", "0", *args, "--port", str(port)]
    process: subprocess.Popen | ForkedProcess
    if os.environ.get("SPECDEC_FORK_SERVICES") == "1" and not prefix and not cpus:
        process = ForkServer.shared().spawn(module, argv, full_env, cwd, log)  # imports done once
    else:
        process = subprocess.Popen(
            [*ended_with_this_process(), *prefix, *pinned_to(cpus), sys.executable, "-m", module, *argv],
            cwd=cwd,
            env=full_env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
    return ServiceProcess(name, f"127.0.0.1:{port}", process, log, coordinator=module.endswith("coordinator"))


def ended_with_this_process() -> list[str]:
    """The prefix that makes a child get SIGTERM (and stop as `stop_all` stops it) when this
    process dies, killed outright too, instead of living on with its model's memory: Linux's
    PR_SET_PDEATHSIG, set by util-linux's `setpriv` and kept across the execs after it
    (`taskset`, `ip netns exec`). Not a preexec_fn: that makes Python fork this whole process
    instead of vfork, which fails ENOMEM from a process holding much memory. The signal fires
    when the spawning thread ends, so only the main thread uses it; [] elsewhere or without
    setpriv. A launcher killed before setpriv has run (milliseconds) leaves the child untied."""
    if threading.current_thread() is not threading.main_thread() or not shutil.which("setpriv"):
        return []
    return ["setpriv", "--pdeathsig", "TERM", "--"]


def pinned_to(cpus: Collection[int]) -> list[str]:
    """The `taskset` prefix that runs a command on `cpus` (every thread it starts too); [] for
    none. A core this process may not use is refused here, not in the child's log."""
    if not cpus:
        return []
    allowed = os.sched_getaffinity(0)
    if missing := sorted(set(cpus) - allowed):
        raise ValueError(f"cores {missing} are not ones this process may run on ({sorted(allowed)})")
    return ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus)))]


def model_service_args(device: str, threads: int) -> tuple[list[str], dict[str, str]]:
    """Flags and environment shared by a local draft or target service."""
    args = ["--device", device] + (["--threads", str(threads)] if threads else [])
    return args, ({"OMP_NUM_THREADS": str(threads)} if threads else {})


def spawn_coordinator(
    draft: ServiceProcess,
    target: ServiceProcess,
    tokenizer: Path,
    log: Path,
    args: Sequence[str] = (),
    cwd: Path | None = None,
    module: str = "coordinator",
    cpus: Collection[int] = (),
    wait: bool = True,
) -> ServiceProcess:
    """A coordinator for a running draft and target, healthy on return; `module` runs it
    (bench.rules_coordinator: with a benchmark's round rules), on `cpus` (spawn). `wait=False`
    returns it started, for the caller to wait on: coordinators time nothing at start-up, so
    several may start at once."""
    coordinator = spawn(
        "coordinator",
        module,
        ["--draft", draft.address, "--target", target.address, "--tokenizer", str(tokenizer), *args],
        free_port(),
        log,
        {},
        cwd,
        cpus=cpus,
    )
    try:
        if wait:
            coordinator.wait_healthy(COORDINATOR_START_S)
    except BaseException:
        coordinator.stop()
        raise
    return coordinator


@contextmanager
def stopped_on_sigterm() -> Iterator[None]:
    """SIGTERM (`make` passes on its own, `kill`) raises SystemExit in the main thread while
    this runs, as Ctrl-C raises KeyboardInterrupt, so services started inside are stopped on
    the way out; Python's default would end the process and leave them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def local_stack(
    draft_model: Path,
    target_model: Path,
    log_dir: Path,
    *,
    draft_dtype: str = "float32",
    target_dtype: str = "float32",
    device: str = "cpu",
    threads: int = 0,
    draft_args: Sequence[str] = (),
    target_args: Sequence[str] = (),
    coordinator_args: Sequence[str] = (),
    cwd: Path | None = None,
    start_timeout_s: float = 900.0,
    coordinator_module: str = "coordinator",
) -> Iterator[dict[str, ServiceProcess]]:
    """Draft, target and coordinator as three local processes on free loopback ports, healthy
    on entry and stopped (coordinator first) on exit. The coordinator uses the target's tokenizer.
    `draft_args` and `target_args` go last on their command lines, so they override the dtypes."""
    model_args, env = model_service_args(device, threads)
    services: dict[str, ServiceProcess] = {}
    with stopped_on_sigterm():
        try:
            services["draft"] = spawn(
                "draft",
                "draft_service",
                ["--model", str(draft_model), "--dtype", draft_dtype, *model_args, *draft_args],
                free_port(),
                log_dir / "draft.log",
                env,
                cwd,
            )
            # One after the other: each service times its own passes at start-up (--calibrate), and
            # on one machine a neighbour still loading its weights would skew those figures.
            services["draft"].wait_healthy(start_timeout_s)
            services["target"] = spawn(
                "target",
                "target_service",
                ["--model", str(target_model), "--dtype", target_dtype, *model_args, *target_args],
                free_port(),
                log_dir / "target.log",
                env,
                cwd,
            )
            services["target"].wait_healthy(start_timeout_s)
            services["coordinator"] = spawn_coordinator(
                services["draft"],
                services["target"],
                target_model,
                log_dir / "coordinator.log",
                coordinator_args,
                cwd,
                coordinator_module,
            )
            yield services
        finally:
            stop_all(services.values())
