"""Container health probe: exit 0 when the service answers grpc.health.v1 SERVING, 1 otherwise.

    python healthcheck.py [HOST:PORT]

Without an address it probes 127.0.0.1 on the port the container's service listens on: the
`--port` on the service's command line, else its SPECDEC_<SERVICE>_PORT variable, else the
service's default port. So one image-level HEALTHCHECK serves all three services. Kubernetes
does not need this script: its native `grpc:` probes ask the same health service.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# module -> (environment prefix, default port); tests/unit/test_deploy_files.py checks these
# against each service's config.py, which this script cannot import cheaply (torch).
SERVICES = {
    "draft_service": ("SPECDEC_DRAFT", 50061),
    "target_service": ("SPECDEC_TARGET", 50062),
    "coordinator": ("SPECDEC_COORDINATOR", 50051),
}
TIMEOUT_S = 3.0


def service_module(argv: Sequence[str]) -> str | None:
    """The service a command line starts (`python -m draft_service ...`), or None."""
    for flag, value in zip(argv, argv[1:]):
        if flag == "-m" and value in SERVICES:
            return value
    return None


def service_port(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """The port the service started by `argv` listens on: flags win over the environment, as in
    specdec.config.EnvArgs."""
    module = service_module(argv)
    if module is None:
        raise ValueError(f"not a specdec service command line: {' '.join(argv)!r}")
    prefix, default = SERVICES[module]
    port: str | int = env.get(f"{prefix}_PORT", default)
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif arg.startswith("--port="):
            port = arg.split("=", 1)[1]
    return int(port)


def running_service_argv(proc: Path = Path("/proc")) -> list[str]:
    """The command line of this container's service process (PID 1, or a child of an init)."""
    pids = sorted((int(p.name) for p in proc.iterdir() if p.name.isdigit()))
    for pid in pids:
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if service_module(argv):
            return argv
    raise SystemExit("healthcheck: no specdec service process found; pass HOST:PORT")


def check(address: str, timeout_s: float = TIMEOUT_S) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"healthcheck: {address}: {exc.code().name}", file=sys.stderr)
            return False
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"healthcheck: {address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr)
        return False
    return True


def main(argv: Sequence[str]) -> int:
    address = argv[0] if argv else f"127.0.0.1:{service_port(running_service_argv(), os.environ)}"
    return 0 if check(address) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
