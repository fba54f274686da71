"""Coordinator configuration: flags over SPECDEC_COORDINATOR_* environment variables."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.config import (
    CPUS_FLAG,
    CPUS_HELP,
    DEFAULT_MAX_MESSAGE_BYTES,
    METRICS_PORT_HELP,
    SHUTDOWN_GRACE_HELP,
    ClientSecurity,
    EnvArgs,
    ServerSecurity,
    add_server_security_args,
    client_security,
    parse_cpu_list,
    server_security,
)

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9151
MAX_HEDGES = 8


@dataclass(frozen=True)
class CoordinatorConfig:
    draft_address: str
    target_address: str
    tokenizer: str  # folder or id of the pair's tokenizer, for text in and out
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    default_num_speculative_tokens: int = 4
    max_num_speculative_tokens: int = 8
    default_max_new_tokens: int = 64
    max_new_tokens_limit: int = 2048
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    draft_timeout_s: float = 30.0
    target_timeout_s: float = 60.0
    connect_timeout_s: float = 120.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    log_level: str = "INFO"
    pipeline: bool = False  # pre-draft the next round while the target verifies
    adaptive_k: bool = True  # choose K (0 included) per round from measured costs when a request leaves it unset
    hedges: int = 0  # branches pre-drafted per verify for likely rejection outcomes
    metrics_port: int = -1  # Prometheus /metrics over HTTP on host; 0 picks a free port, -1 is off
    draft_attempts: int = 2  # tries of a draft call on UNAVAILABLE before the round goes target-only
    draft_retry_backoff_s: float = 0.05  # first wait between tries (doubles)
    breaker_failures: int = 3  # consecutive failed draft calls that open the breaker
    breaker_probe_interval_s: float = 2.0  # health probes of the draft while the breaker is open
    shutdown_grace_s: float = 25.0  # on SIGTERM: how long in-flight requests may finish
    target_retry_s: float = (
        30.0  # how long a target call failing UNAVAILABLE is retried (a restart), within the client's deadline
    )
    trust_remote_code: bool = False  # run Python code shipped with the tokenizer
    security: ServerSecurity = ServerSecurity()  # the public API: TLS, client certificates, tokens
    upstream: ClientSecurity = ClientSecurity()  # calls to draft and target
    cpus: tuple[int, ...] = ()  # cores the process is pinned to (--cpus); () = not pinned


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> CoordinatorConfig:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="Coordinator: the public Generate API")
    args = EnvArgs(parser, "SPECDEC_COORDINATOR", env)
    args.add("--draft", None, "draft service address HOST:PORT")
    args.add("--target", None, "target service address HOST:PORT")
    args.add("--tokenizer", None, "tokenizer folder or id (the pair's); checked against the target's fingerprint")
    args.add("--host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    args.add("--port", DEFAULT_PORT, "port to listen on (0 picks a free one)", type=int)
    args.add("--num-speculative-tokens", 4, "default K per round when a request leaves it unset", type=int)
    args.add("--max-num-speculative-tokens", 8, "largest K a request may ask for", type=int)
    args.add("--default-max-new-tokens", 64, "max_new_tokens when a request leaves it unset", type=int)
    args.add("--max-new-tokens-limit", 2048, "largest max_new_tokens a request may ask for", type=int)
    args.add("--draft-timeout", 30.0, "deadline of one draft call, seconds", type=float)
    args.add("--target-timeout", 60.0, "deadline of one target call, seconds", type=float)
    args.add("--connect-timeout", 120.0, "how long start-up waits for draft and target to answer Info", type=float)
    args.add("--max-message-bytes", DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message sent or received", type=int)
    args.add("--log-level", "INFO", "logging level")
    args.add("--metrics-port", DEFAULT_METRICS_PORT, METRICS_PORT_HELP, type=int)
    args.add("--shutdown-grace", 25.0, SHUTDOWN_GRACE_HELP, type=float)
    args.add(
        "--draft-attempts",
        2,
        "tries of a draft call that fails UNAVAILABLE before that round runs target-only",
        type=int,
    )
    args.add(
        "--draft-retry-backoff", 0.05, "seconds before the second try of a draft call (doubling after)", type=float
    )
    args.add(
        "--target-retry-timeout",
        30.0,
        "seconds a target call failing UNAVAILABLE is retried (a restarting target), never past the client's deadline",
        type=float,
    )
    args.add(
        "--breaker-failures",
        3,
        "consecutive failed draft calls after which rounds skip the draft (target-only)",
        type=int,
    )
    args.add(
        "--breaker-probe-interval", 2.0, "seconds between health probes of the draft while it is skipped", type=float
    )
    args.add(
        "--pipeline", "off", "on: the draft pre-drafts the next round while the target verifies", choices=["on", "off"]
    )
    args.add(
        "--adaptive-k",
        "on",
        "on: when a request leaves K unset, choose it each round (K = 0 included) from the services' "
        "calibrated pass costs and the request's acceptance; without calibrated costs, or off, use "
        "--num-speculative-tokens",
        choices=["on", "off"],
    )
    args.add(
        "--hedges",
        0,
        "pre-draft this many likely rejection outcomes on forks of the draft session during each verify "
        f"(0 = off; at most {MAX_HEDGES})",
        type=int,
    )
    args.add(CPUS_FLAG, "", CPUS_HELP, type=parse_cpu_list)
    args.add(
        "--trust-remote-code",
        "off",
        "on: run Python code that comes with the tokenizer (only for ones you trust)",
        choices=["on", "off"],
    )
    add_server_security_args(args)
    args.add(
        "--upstream-tls-ca", None, "PEM CA bundle to verify the draft's and target's certificates with: TLS to them on"
    )
    args.add(
        "--upstream-tls-cert",
        None,
        "PEM client certificate presented to draft and target (mutual TLS; needs --upstream-tls-key)",
    )
    args.add("--upstream-tls-key", None, "PEM private key of --upstream-tls-cert")
    args.add(
        "--upstream-tls-server-name",
        None,
        "name to check the draft's and target's certificates for, instead of their address's host",
    )
    args.add(
        "--upstream-auth-token-file",
        None,
        "file whose first line is the bearer token sent to draft and target (their --auth-token-file)",
    )
    ns = parser.parse_args(argv)
    for flag in ("draft", "target", "tokenizer"):
        if not getattr(ns, flag):
            parser.error(f"--{flag} is required (or set the environment variable named in --help)")
    if not 0 <= ns.num_speculative_tokens <= ns.max_num_speculative_tokens:
        parser.error("--num-speculative-tokens must be in [0, --max-num-speculative-tokens]")
    if ns.draft_attempts < 1 or ns.breaker_failures < 1 or ns.breaker_probe_interval <= 0 or ns.draft_retry_backoff < 0:
        parser.error(
            "--draft-attempts and --breaker-failures must be >= 1, --breaker-probe-interval > 0, "
            "--draft-retry-backoff >= 0"
        )
    if not 0 <= ns.hedges <= MAX_HEDGES:
        parser.error(f"--hedges must be in [0, {MAX_HEDGES}]")
    security, problem = server_security(ns)
    upstream, upstream_problem = client_security(
        ns.upstream_tls_ca,
        ns.upstream_tls_cert,
        ns.upstream_tls_key,
        ns.upstream_tls_server_name,
        ns.upstream_auth_token_file,
        flag_prefix="--upstream-",
    )
    if message := problem or upstream_problem:
        parser.error(message)
    return CoordinatorConfig(
        draft_address=ns.draft,
        target_address=ns.target,
        tokenizer=ns.tokenizer,
        host=ns.host,
        port=ns.port,
        default_num_speculative_tokens=ns.num_speculative_tokens,
        max_num_speculative_tokens=ns.max_num_speculative_tokens,
        default_max_new_tokens=ns.default_max_new_tokens,
        max_new_tokens_limit=ns.max_new_tokens_limit,
        draft_timeout_s=ns.draft_timeout,
        target_timeout_s=ns.target_timeout,
        connect_timeout_s=ns.connect_timeout,
        max_message_bytes=ns.max_message_bytes,
        log_level=ns.log_level,
        pipeline=ns.pipeline == "on",
        adaptive_k=ns.adaptive_k == "on",
        hedges=ns.hedges,
        metrics_port=ns.metrics_port,
        draft_attempts=ns.draft_attempts,
        draft_retry_backoff_s=ns.draft_retry_backoff,
        breaker_failures=ns.breaker_failures,
        breaker_probe_interval_s=ns.breaker_probe_interval,
        target_retry_s=ns.target_retry_timeout,
        shutdown_grace_s=ns.shutdown_grace,
        trust_remote_code=ns.trust_remote_code == "on",
        security=security,
        upstream=upstream,
        cpus=ns.cpus,
    )
