"""Container health probe: exit 0 when the service answers grpc.health.v1 SERVING, 1 otherwise.

    python healthcheck.py [HOST:PORT] [--service NAME] [--tls-ca CA] [--tls-cert CERT --tls-key KEY]
                          [--tls-server-name NAME]

Without an address it probes 127.0.0.1 on the port the container's service listens on: the
`--port` on the service's command line, else its SPECDEC_<SERVICE>_PORT variable, else the
service's default port. So one image-level HEALTHCHECK serves all three services.

TLS: with an address, the probe uses TLS when given --tls-ca. Without one, it also follows the
service's own settings: TLS when the service has a --tls-cert, trusting --tls-ca or else the
service's --tls-client-ca; when the service requires client certificates (--tls-client-ca), it
presents the service's own certificate and key unless given --tls-cert/--tls-key. The
certificate must name 127.0.0.1 (deploy/make_certs.py's do), or pass --tls-server-name.
`--service liveness` asks the name that stays SERVING while the process runs (a liveness
probe), where the default ("") says whether the service can serve now (readiness). The health
service needs no token. Kubernetes' native `grpc:` probes ask the same health
service but cannot speak TLS: with TLS on, the manifests run this script instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


def service_setting(
    argv: Sequence[str], env: Mapping[str, str], flag: str, default: str | int | None = None
) -> str | int | None:
    """A setting of the service started by `argv` (`flag` is "port", "tls-cert", ...): flags win
    over the environment, as in specdec.config.settings.parse_settings."""
    module = service_module(argv)
    if module is None:
        raise ValueError(f"not a specdec service command line: {' '.join(argv)!r}")
    prefix, _ = SERVICES[module]
    value = env.get(f"{prefix}_{flag.replace('-', '_').upper()}", default)
    for i, arg in enumerate(argv):
        if arg == f"--{flag}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{flag}="):
            value = arg.split("=", 1)[1]
    return value


def service_port(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """The port the service started by `argv` listens on."""
    module = service_module(argv)
    if module is None:
        raise ValueError(f"not a specdec service command line: {' '.join(argv)!r}")
    return int(service_setting(argv, env, "port", SERVICES[module][1]))


@dataclass(frozen=True)
class ProbeTLS:
    ca: str
    cert: str | None = None  # a client certificate, for services that require one
    key: str | None = None
    server_name: str | None = None


def service_tls(argv: Sequence[str], env: Mapping[str, str], ca: str | None = None) -> ProbeTLS | None:
    """How to reach the service started by `argv`: None when it serves plaintext. `ca` (the
    --tls-ca flag) wins over the service's --tls-client-ca; it presents the service's own
    certificate when the service requires one (make_certs.py issues them for both uses)."""
    cert, key, client_ca = (
        service_setting(argv, env, flag) or None for flag in ("tls-cert", "tls-key", "tls-client-ca")
    )
    if not cert:
        return None
    if not (ca or client_ca):
        raise SystemExit(
            "healthcheck: the service serves TLS and has no --tls-client-ca: pass --tls-ca with the CA that signed "
            "its certificate"
        )
    return ProbeTLS(ca or client_ca, cert if client_ca else None, key if client_ca else None)


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


def open_channel(address: str, tls: ProbeTLS | None):
    import grpc

    if tls is None:
        return grpc.insecure_channel(address)

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    credentials = grpc.ssl_channel_credentials(read(tls.ca), read(tls.key), read(tls.cert))
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def check(address: str, timeout_s: float = TIMEOUT_S, tls: ProbeTLS | None = None, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = open_channel(address, tls)
    except OSError as exc:
        print(f"healthcheck: {address}: cannot read a TLS file: {exc}", file=sys.stderr)
        return False
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            print(f"healthcheck: {address}: {exc.code().name}", file=sys.stderr)
            return False
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(
            f"healthcheck: {address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
            file=sys.stderr,
        )
        return False
    return True


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.split("\n")[0])
    parser.add_argument("address", nargs="?", help="HOST:PORT (default: 127.0.0.1 and the container's service port)")
    parser.add_argument("--service", default="", help="health service name to ask (liveness: the process runs)")
    parser.add_argument("--tls-ca", help="PEM CA bundle to verify the service's certificate with (turns TLS on)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for services that require one")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="name to check the service's certificate for, instead of the address's host"
    )
    args = parser.parse_args(argv)
    if args.address:
        if (args.tls_cert or args.tls_key or args.tls_server_name) and not args.tls_ca:
            parser.error("--tls-cert, --tls-key and --tls-server-name need --tls-ca (which turns TLS on)")
        address = args.address
        tls = ProbeTLS(args.tls_ca) if args.tls_ca else None
    else:
        service_argv = running_service_argv()
        address = f"127.0.0.1:{service_port(service_argv, os.environ)}"
        tls = service_tls(service_argv, os.environ, args.tls_ca)
    if tls is not None:
        tls = ProbeTLS(
            tls.ca, args.tls_cert or tls.cert, args.tls_key or tls.key, args.tls_server_name or tls.server_name
        )
    return 0 if check(address, tls=tls, service=args.service) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
