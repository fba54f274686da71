"""Config helpers: every flag may take its default from an environment variable; flags win.

Each service builds one frozen dataclass from these, once, in its `__main__`; nothing reads
the environment at import time.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from specdec.security import ServerSecurity, add_server_security_args, server_security

T = TypeVar("T")

# 64 MiB: a round of K dense draft distributions over a 152k vocab is 0.6 MB per token.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def env_default(env: Mapping[str, str], name: str, default: T, cast: Callable[[str], T] = str) -> T:
    """`default`, unless the variable `name` is set; a malformed value is a start-up error."""
    if name not in env:
        return default
    try:
        return cast(env[name])
    except ValueError as exc:
        raise SystemExit(f"environment variable {name}={env[name]!r} is invalid: {exc}") from exc


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
            raise SystemExit(f"environment variable {name}={self.env[name]!r} is invalid: choose from {', '.join(map(str, choices))}")
        self.parser.add_argument(flag, type=type, default=value, help=f"{help} [env {name}; default: %(default)s]", **kwargs)


@dataclass(frozen=True)
class ModelServiceConfig:
    """Settings both model services share."""

    model: str
    dtype: str
    device: str
    host: str
    port: int
    threads: int  # torch intra-op threads; 0 keeps torch's default
    max_sessions: int
    session_ttl_s: float
    max_speculative_tokens: int
    max_message_bytes: int
    log_level: str
    trust_remote_code: bool = False  # run Python code shipped in the model folder (transformers' trust_remote_code)
    security: ServerSecurity = ServerSecurity()  # TLS, client certificates, tokens (specdec.security)


def add_model_service_args(args: EnvArgs, default_port: int) -> None:
    args.add("--model", None, "Hugging Face model id or local folder", required=False)
    args.add("--dtype", "float32", "weights dtype: float32, bfloat16 or float16", choices=["float32", "bfloat16", "float16"])
    args.add("--device", "cpu", "torch device: cpu, cuda or cuda:N")
    args.add("--host", "127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    args.add("--port", default_port, "port to listen on (0 picks a free one)", type=int)
    args.add("--threads", 0, "torch intra-op threads (0 = torch's default)", type=int)
    args.add("--max-sessions", 256, "sessions held at once; beyond that new ones get RESOURCE_EXHAUSTED", type=int)
    args.add("--session-ttl", 300.0, "seconds an idle session is kept", type=float)
    args.add("--max-speculative-tokens", 16, "largest K accepted per call", type=int)
    args.add("--max-message-bytes", DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message sent or received", type=int)
    args.add("--log-level", "INFO", "logging level")
    args.add(
        "--trust-remote-code", "off", "on: run Python code that comes with the model folder (only for models you trust)",
        choices=["on", "off"],
    )
    add_server_security_args(args)


def model_service_kwargs(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not ns.model:
        parser.error("--model is required (or set the environment variable named in --help)")
    security, problem = server_security(ns)
    if problem:
        parser.error(problem)
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
        trust_remote_code=ns.trust_remote_code == "on",
        security=security,
    )
