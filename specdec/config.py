"""Config helpers: every flag may take its default from an environment variable; flags win.

Each service builds one frozen dataclass from these, once, in its `__main__`; nothing reads
the environment at import time.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.quantize import int8_supported

T = TypeVar("T")

# 64 MiB: a round of K dense draft distributions over a 152k vocab is 0.6 MB per token.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
QUANTIZE = ("auto", "none", "int8")


def env_default(env: Mapping[str, str], name: str, default: T, cast: Callable[[str], Any] = str) -> T:
    """`default`, unless the variable `name` is set; a malformed value is a start-up error."""
    if name not in env:
        return default
    try:
        return cast(env[name])
    except ValueError as exc:
        raise SystemExit(f"environment variable {name}={env[name]!r} is invalid: {exc}") from exc


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0', '0,2', '0-3' (lscpu's and taskset's list syntax) -> sorted core ids; '' -> () (no pinning)."""
    cpus: set[int] = set()
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"{text!r} is not a CPU list; use ids and ranges such as 0, 0,2 or 0-3")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError(f"range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Pins this process (and the threads it starts later) to `cpus`; () leaves it as it is.

    Called first thing in a service's main, before torch starts its thread pool, so one
    machine can stand in for separate nodes: the draft on one core, the target on another,
    neither taking cycles from the other. A core this process may not use is a start-up error.
    """
    if not cpus:
        return
    allowed = os.sched_getaffinity(0)
    if missing := sorted(set(cpus) - allowed):
        raise SystemExit(
            f"--cpus names cores {missing} that this process may not run on (it may use {sorted(allowed)})"
        )
    os.sched_setaffinity(0, cpus)


def parse_bytes(text: str) -> int:
    """'8GiB', '512MB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size; use bytes or a unit such as 512MiB or 8GiB")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


class EnvArgs:
    """Adds flags whose defaults come from `PREFIX_FLAG_NAME` variables, and says so in --help."""

    def __init__(self, parser: argparse.ArgumentParser, prefix: str, env: Mapping[str, str] | None = None):
        self.parser = parser
        self.prefix = prefix
        self.env = os.environ if env is None else env

    def add(self, flag: str, default: Any, help: str, type: Callable[[str], Any] = str, **kwargs: Any) -> None:
        name = f"{self.prefix}_{flag.lstrip('-').replace('-', '_').upper()}"
        value = env_default(self.env, name, default, type)
        choices = kwargs.get("choices")
        # argparse checks choices on flags only, never on defaults: check the variable here,
        # or SPECDEC_COORDINATOR_PIPELINE=yes would silently mean "off".
        if choices is not None and name in self.env and value not in choices:
            raise SystemExit(
                f"environment variable {name}={self.env[name]!r} is invalid: choose from {', '.join(map(str, choices))}"
            )
        self.parser.add_argument(
            flag, type=type, default=value, help=f"{help} [env {name}; default: %(default)s]", **kwargs
        )


# --- TLS and token settings (loaded and enforced by specdec.security) ---------------------


@dataclass(frozen=True)
class ServerSecurity:
    """A server's TLS and token settings (paths); all unset = plaintext, no token."""

    tls_cert: str | None = None  # PEM certificate chain served (with tls_key): TLS on
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM CA bundle clients' certificates must chain to: mutual TLS
    auth_token_file: str | None = None  # accepted bearer tokens, one per line


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server (paths); all unset = plaintext, no token."""

    tls_ca: str | None = None  # PEM CA bundle the server's certificate must chain to: TLS on
    tls_cert: str | None = None  # client certificate and key, for servers that require one (mutual TLS)
    tls_key: str | None = None
    tls_server_name: str | None = None  # the name to check the server's certificate for, when not the address's host
    auth_token_file: str | None = None  # the first token in the file is sent as `authorization: Bearer <token>`


def add_server_security_args(args: EnvArgs) -> None:
    args.add("--tls-cert", None, "PEM certificate chain to serve TLS with (needs --tls-key)")
    args.add("--tls-key", None, "PEM private key of --tls-cert")
    args.add(
        "--tls-client-ca",
        None,
        "PEM CA bundle: clients must present a certificate signed by it (mutual TLS; needs --tls-cert)",
    )
    args.add(
        "--auth-token-file",
        None,
        "file of accepted bearer tokens, one per line: every call except health and reflection must send "
        "`authorization: Bearer <token>` metadata",
    )


def server_security(ns: Any) -> tuple[ServerSecurity, str | None]:
    """The settings from parsed flags (an empty value counts as unset), and the contradiction
    between them in words, or None."""
    settings = ServerSecurity(
        ns.tls_cert or None, ns.tls_key or None, ns.tls_client_ca or None, ns.auth_token_file or None
    )
    if bool(settings.tls_cert) != bool(settings.tls_key):
        return settings, "--tls-cert and --tls-key go together: give both to serve TLS, or neither"
    if settings.tls_client_ca and not settings.tls_cert:
        return settings, "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"
    return settings, None


def client_security(
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_server_name: str | None,
    auth_token_file: str | None,
    flag_prefix: str = "--",
) -> tuple[ClientSecurity, str | None]:
    """Client settings (an empty value counts as unset), and the contradiction between them in
    words, or None; `flag_prefix` ("--upstream-") names the flags in the message."""
    settings = ClientSecurity(
        tls_ca or None, tls_cert or None, tls_key or None, tls_server_name or None, auth_token_file or None
    )
    if bool(settings.tls_cert) != bool(settings.tls_key):
        return (
            settings,
            f"{flag_prefix}tls-cert and {flag_prefix}tls-key go together: give both to present a client certificate, "
            "or neither",
        )
    needs_ca = [
        f"{flag_prefix}{name}"
        for name, value in (("tls-cert", settings.tls_cert), ("tls-server-name", settings.tls_server_name))
        if value
    ]
    if needs_ca and not settings.tls_ca:
        return (
            settings,
            f"{' and '.join(needs_ca)} need{'s' if len(needs_ca) == 1 else ''} {flag_prefix}tls-ca (which turns TLS "
            "on)",
        )
    return settings, None


@dataclass(frozen=True)
class ModelServiceConfig:
    """Settings both model services share."""

    model: str
    dtype: str
    device: str
    host: str
    port: int
    threads: int  # torch intra-op threads; 0: one per --cpus core, else torch's default
    max_sessions: int
    session_ttl_s: float
    max_speculative_tokens: int
    max_message_bytes: int
    log_level: str
    metrics_port: int = -1  # Prometheus /metrics over HTTP on --host; 0 picks a free port, -1 is off
    max_kv_bytes: int = 0  # KV cache budget over all sessions; least recently used are evicted; 0 = none
    shutdown_grace_s: float = 25.0  # on SIGTERM: how long in-flight calls may finish
    trust_remote_code: bool = False  # run Python code shipped in the model folder (transformers' trust_remote_code)
    security: ServerSecurity = ServerSecurity()  # TLS, client certificates, tokens (specdec.security)
    batch_window_ms: float = 2.0  # how long a call waits for other sessions' calls to share its passes; 0 = never
    max_batch_size: int = 8  # sessions in one batched call at most
    quantize: str = (
        "auto"  # "int8": int8 Linear layers, per-token activations (CPU, float32); "auto": int8 on CPU float32
    )
    calibrate: bool = True  # measure forward-pass costs at start-up (Info.calibrated_pass_ms); off for fast tests
    cpus: tuple[int, ...] = ()  # cores the process is pinned to (--cpus); () = not pinned

    @property
    def torch_threads(self) -> int:
        """Intra-op threads to set: --threads, else one per pinned core, else 0 (torch's default)."""
        return self.threads or len(self.cpus)

    def resolved_quantize(self) -> str:
        """ "int8" or "none": what `auto` means for this device and dtype."""
        if self.quantize != "auto":
            return self.quantize
        return "int8" if self.device == "cpu" and self.dtype == "float32" and int8_supported() else "none"

    def quantize_problem(self) -> str | None:
        if self.quantize == "int8" and (self.device != "cpu" or self.dtype != "float32"):
            return f"--quantize int8 needs --device cpu and --dtype float32; got {self.device} and {self.dtype}"
        return None


CPUS_FLAG = "--cpus"
CPUS_HELP = (
    "pin the process to these cores, e.g. 0 or 0-3 (empty = not pinned): one machine standing in for separate nodes"
)
SHUTDOWN_GRACE_HELP = "seconds in-flight calls may finish after SIGTERM (health turns NOT_SERVING first)"
METRICS_PORT_HELP = "Prometheus metrics HTTP port on --host (0 picks a free one, -1 turns metrics off)"


def add_model_service_args(args: EnvArgs, default_port: int, default_metrics_port: int) -> None:
    args.add("--model", None, "Hugging Face model id or local folder", required=False)
    args.add(
        "--dtype", "float32", "weights dtype: float32, bfloat16 or float16", choices=["float32", "bfloat16", "float16"]
    )
    args.add("--device", "cpu", "torch device: cpu, cuda or cuda:N")
    args.add("--host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    args.add("--port", default_port, "port to listen on (0 picks a free one)", type=int)
    args.add(
        "--threads", 0, "torch intra-op threads (0 = one per --cpus core, or torch's default when not pinned)", type=int
    )
    args.add(CPUS_FLAG, "", CPUS_HELP, type=parse_cpu_list)
    args.add("--max-sessions", 256, "sessions held at once; beyond that new ones get RESOURCE_EXHAUSTED", type=int)
    args.add("--session-ttl", 300.0, "seconds an idle session is kept", type=float)
    args.add("--max-speculative-tokens", 16, "largest K accepted per call", type=int)
    args.add("--max-message-bytes", DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message sent or received", type=int)
    args.add("--log-level", "INFO", "logging level")
    args.add("--metrics-port", default_metrics_port, METRICS_PORT_HELP, type=int)
    args.add("--shutdown-grace", 25.0, SHUTDOWN_GRACE_HELP, type=float)
    args.add(
        "--max-kv-bytes",
        0,
        "KV cache budget over all sessions, e.g. 8GiB; least recently used sessions are evicted "
        "(their generations re-send and go on); 0 = no budget",
        type=parse_bytes,
    )
    args.add(
        "--trust-remote-code",
        "off",
        "on: run Python code that comes with the model folder (only for models you trust)",
        choices=["on", "off"],
    )
    args.add(
        "--batch-window-ms",
        2.0,
        "milliseconds a Verify/Propose call waits for calls from other sessions to share its "
        "forward passes (0 = every call runs alone)",
        type=float,
    )
    args.add("--max-batch-size", 8, "most sessions served by one batched call", type=int)
    args.add(
        "--quantize",
        "auto",
        "int8: int8 Linear layers with per-token activation scales (CPU, --dtype float32); "
        "auto: int8 on CPU with float32, else none",
        choices=list(QUANTIZE),
    )
    args.add(
        "--calibrate",
        "on",
        "on: measure what a forward pass costs for 1..max-speculative-tokens+1 new tokens at start-up "
        "(a few seconds; reported in Info, used by the coordinator's K chooser)",
        choices=["on", "off"],
    )
    add_server_security_args(args)


def model_service_kwargs(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not ns.model:
        parser.error("--model is required (or set the environment variable named in --help)")
    security, problem = server_security(ns)
    if problem:
        parser.error(problem)
    if ns.batch_window_ms < 0:
        parser.error(f"--batch-window-ms must be >= 0 (0 turns batching off); got {ns.batch_window_ms}")
    if ns.max_batch_size < 1:
        parser.error(f"--max-batch-size must be >= 1 (1 turns batching off); got {ns.max_batch_size}")
    return dict(
        model=ns.model,
        dtype=ns.dtype,
        device=ns.device,
        host=ns.host,
        port=ns.port,
        threads=ns.threads,
        max_sessions=ns.max_sessions,
        session_ttl_s=ns.session_ttl,
        max_speculative_tokens=ns.max_speculative_tokens,
        max_message_bytes=ns.max_message_bytes,
        log_level=ns.log_level,
        metrics_port=ns.metrics_port,
        max_kv_bytes=ns.max_kv_bytes,
        shutdown_grace_s=ns.shutdown_grace,
        trust_remote_code=ns.trust_remote_code == "on",
        security=security,
        batch_window_ms=ns.batch_window_ms,
        max_batch_size=ns.max_batch_size,
        quantize=ns.quantize,
        calibrate=ns.calibrate == "on",
        cpus=ns.cpus,
    )
