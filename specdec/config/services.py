"""Settings both model services share, the TLS settings, and the parsers they use.

Each field is declared once with `specdec.config.settings.setting` (its flag, variable, default and
help); each service builds its frozen config from them, once, in its `__main__`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from specdec.config.settings import fixed, group, log_level, number, setting
from specdec.engine.costs import CALIBRATION_MAX_TOKENS
from specdec.engine.memory import MemoryShare
from specdec.engine.prefix_cache import DEFAULT_PREFIX_BLOCK_TOKENS
from specdec.engine.quantize import int8_supported
from specdec.engine.rows import MAX_ROWS

QUANTIZE = ("auto", "none", "int8")
SECURITY_DOC = "See [Security](operations.md#security)."


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


def pinned_cores() -> int:
    """How many cores this process may run on, where that is fewer than the machine has
    (started under `taskset`, or in a container given a cpuset); 0 where it may use them all."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 0
    return allowed if allowed < (os.cpu_count() or allowed) else 0


def parse_bytes(text: str) -> int:
    """'8GiB', '512MB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size; use bytes or a unit such as 512MiB or 8GiB")
    size = float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]
    if 0 < size < 1:  # 0.9: a share meant, which int() would have made 0 (no budget)
        raise ValueError(
            f"{text!r} is less than a byte; give bytes or a unit such as 512MiB (a share of memory, where a flag "
            "takes one, is a percentage such as 90%)"
        )
    return int(size)


def parse_kv_budget(text: str) -> int | MemoryShare:
    """'8GiB' -> bytes (parse_bytes); '90%' -> MemoryShare(0.9)."""
    if text.strip().endswith("%"):
        try:
            percent = float(text.strip()[:-1])
        except ValueError:
            raise ValueError(f"{text!r} is not a share of memory; use a percentage such as 90%") from None
        return MemoryShare(percent / 100)
    return parse_bytes(text)


# --- TLS and token settings (loaded and enforced by specdec.rpc.security) ---------------------


@dataclass(frozen=True)
class ServerSecurity:
    """A server's TLS and token settings (paths); all unset = plaintext, no token."""

    tls_cert: str | None = setting(
        None, "--tls-cert", "PEM certificate chain to serve TLS with (needs --tls-key)", more=SECURITY_DOC
    )
    tls_key: str | None = setting(None, "--tls-key", "PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(
        None,
        "--tls-client-ca",
        "PEM CA bundle: clients must present a certificate signed by it (mutual TLS; needs --tls-cert)",
    )
    auth_token_file: str | None = setting(
        None,
        "--auth-token-file",
        "file of accepted bearer tokens, one per line: every call except health and reflection must send "
        "`authorization: Bearer <token>` metadata",
    )

    def problem(self) -> str | None:
        """The contradiction between the settings in words, or None."""
        if bool(self.tls_cert) != bool(self.tls_key):
            return "--tls-cert and --tls-key go together: give both to serve TLS, or neither"
        if self.tls_client_ca and not self.tls_cert:
            return "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"
        return None


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server (paths); all unset = plaintext, no token. The coordinator
    declares these as its --upstream-* flags."""

    tls_ca: str | None = setting(
        None, "--tls-ca", "PEM CA bundle the server's certificate must chain to: TLS on", more=SECURITY_DOC
    )
    tls_cert: str | None = setting(
        None, "--tls-cert", "PEM client certificate, for servers that require one (mutual TLS; needs the key)"
    )
    tls_key: str | None = setting(None, "--tls-key", "PEM private key of the client certificate")
    tls_server_name: str | None = setting(
        None, "--tls-server-name", "name to check the server's certificate for, instead of the address's host"
    )
    auth_token_file: str | None = setting(
        None, "--auth-token-file", "file whose first line is the bearer token sent as `authorization: Bearer`"
    )

    def problem(self, flag_prefix: str = "--") -> str | None:
        """The contradiction between the settings in words, or None; `flag_prefix`
        ("--upstream-") names the flags in the message."""
        if bool(self.tls_cert) != bool(self.tls_key):
            return (
                f"{flag_prefix}tls-cert and {flag_prefix}tls-key go together: give both to present a client "
                "certificate, or neither"
            )
        needs_ca = [
            f"{flag_prefix}{name}"
            for name, value in (("tls-cert", self.tls_cert), ("tls-server-name", self.tls_server_name))
            if value
        ]
        if needs_ca and not self.tls_ca:
            return (
                f"{' and '.join(needs_ca)} need{'s' if len(needs_ca) == 1 else ''} {flag_prefix}tls-ca (which turns "
                "TLS on)"
            )
        return None


def client_security(
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_server_name: str | None,
    auth_token_file: str | None,
    flag_prefix: str = "--",
) -> tuple[ClientSecurity, str | None]:
    """Client settings (an empty value counts as unset) and their contradiction, or None."""
    settings = ClientSecurity(
        tls_ca or None, tls_cert or None, tls_key or None, tls_server_name or None, auth_token_file or None
    )
    return settings, settings.problem(flag_prefix)


def port_setting(default: int) -> int:
    return setting(default, "--port", "port to listen on (0 picks a free one)", parse=number(int, 0, 65535))


def metrics_port_setting(default: int) -> int:
    return setting(
        default,
        "--metrics-port",
        "Prometheus /metrics HTTP port on --host (0 picks a free one, -1 turns metrics off)",
        parse=number(int, -1, 65535),
    )


def shutdown_grace_setting() -> float:
    return setting(
        25.0,
        "--shutdown-grace",
        "seconds in-flight calls may finish after SIGTERM (health turns NOT_SERVING first)",
        parse=number(float, 0),
    )


def log_level_setting() -> str:
    return setting("INFO", "--log-level", "logging level (DEBUG, INFO, WARNING, ERROR or CRITICAL)", parse=log_level)


def host_setting() -> str:
    return setting("127.0.0.1", "--host", "address to listen on (0.0.0.0 for all interfaces)")


def quantize_setting(default: str) -> str:
    """--quantize: the draft's default is `auto` (its numerics change only speed), the
    target's `none` (its numerics are the output's)."""
    return setting(
        default,
        "--quantize",
        "none: serve the model as given; int8: int8 Linear layers with per-token activation scales "
        "(CPU, --dtype float32); auto: int8 on CPU with float32, else none",
        choices=QUANTIZE,
        more="The target's output is its numerics' distribution: with int8 (or auto on CPU) that is the int8 "
        "model's, not the checkpoint's, which is why the target never quantises unless asked; its `Info` and every "
        "response's `stats.target_numerics` say which. The draft's setting changes only speed. See "
        "[An int8 target](design.md#an-int8-target).",
    )


@dataclass(frozen=True)
class ModelServiceConfig:
    """Settings both model services share (each service declares its own ports)."""

    model: str = setting("", "--model", "Hugging Face model id or local folder", required=True)
    dtype: str = setting("float32", "--dtype", "weights dtype", choices=("float32", "bfloat16", "float16"))
    device: str = setting(
        "cpu",
        "--device",
        "torch device: cpu, cuda or cuda:N; the target also takes auto, its layers over every visible GPU "
        "(accelerate's device map)",
    )
    cuda_graphs: str = setting(
        "auto",
        "--cuda-graphs",
        "auto: on for a CUDA device; on: decode, verify and tree passes of up to 64 tokens a session run in "
        "shapes fixed ahead, over the KV pool, captured as CUDA graphs (on CPU: uncaptured, as the tests run "
        "them); compiled: on, each pass compiled by torch.compile (Inductor) before it is captured; off: every "
        "pass eager",
        choices=("auto", "on", "compiled", "off"),
        more="A bucket's graph is captured at its first pass; one-session passes of 1-8 tokens up to 2k tokens of "
        "context at start-up. `compiled` compiles one pass for every bucket (sizes symbolic; up to four "
        "variants, for one session or more and one token or more) at start-up: 10-20 s a variant for a 2-layer "
        "test model on 2 CPU cores, not yet measured on a GPU. The start-up log and `Info` name the buckets. See "
        "[Captured passes](design.md#captured-passes).",
    )
    host: str = host_setting()
    port: int = port_setting(0)
    threads: int = setting(
        0,
        "--threads",
        "torch intra-op threads (0 = one per core the process may run on where it is pinned, as by taskset or a "
        "container's cpuset; else torch's default)",
        parse=number(int, 0),
    )
    max_sessions: int = setting(
        256,
        "--max-sessions",
        "sessions held at once; beyond that new ones get RESOURCE_EXHAUSTED",
        parse=number(int, 1),
    )
    max_speculative_tokens: int = setting(
        32,
        "--max-speculative-tokens",
        f"largest K, or copy, accepted per call (at most {MAX_ROWS - 1}: a verify's passes attend row by row up to "
        f"{MAX_ROWS} rows)",
    )
    log_level: str = log_level_setting()
    metrics_port: int = metrics_port_setting(-1)
    shutdown_grace_s: float = shutdown_grace_setting()
    max_kv_bytes: int | MemoryShare = setting(
        0,
        "--max-kv-bytes",
        "KV cache budget over all sessions, e.g. 8GiB, or a share of the memory left after the weights, e.g. "
        "90%; least recently used sessions are evicted (their generations re-send and go on); 0 = no budget",
        parse=parse_kv_budget,
        more="A share is of the device's free memory (CUDA) or the memory available (CPU) when the service "
        "starts, before the CUDA graphs are captured: leave them room. A session that cannot fit alone gets "
        "RESOURCE_EXHAUSTED with the numbers; `Info` and the metrics report bytes held, the budget in bytes, "
        "bytes per token and evictions. Sessions' KV sits in a pool allocated at start-up and sized from this "
        "(plus a page a session; on CPU twice it, as memory is committed only as written), or, at 0, half the "
        "machine's memory (CPU) or half the device's free memory (CUDA); see [KV pool](design.md#kv-pool).",
    )
    prefix_cache_bytes: int = setting(
        0,
        "--prefix-cache-bytes",
        "keep the KV of finished and idle sessions' prompts, up to this many bytes (e.g. 1GiB), so a session "
        "that starts the same way prefills only the rest; 0 = off",
        parse=parse_bytes,
        more="Counted in --max-kv-bytes and given up, least recently used first, before any session is evicted. "
        "With it on, prompts are prefilled in aligned blocks of 64 tokens, so a cached block holds "
        "exactly what a fresh prefill computes (an int8 CPU target, whose passes compute each token alike "
        "however they are cut, prefills in passes of 256 either way). See [Prefix cache](design.md#prefix-cache).",
    )
    prefix_block_tokens: int = fixed(
        DEFAULT_PREFIX_BLOCK_TOKENS,
        "prefix cache: tokens per cached block, and per prefill pass while it is on (but an int8 CPU target's); "
        "the coordinator reads it "
        "from Info to place sessions by their cached prefixes. In 64-token passes a 512-token prompt "
        "prefilled no slower than in one on CPU (specdec.engine.prefix_cache); a shorter block shares shorter "
        "prefixes at more passes each",
    )
    trust_remote_code: bool = setting(
        False, "--trust-remote-code", "on: run Python code that comes with the model folder (only for models you trust)"
    )
    batch_window_ms: float = setting(
        2.0,
        "--batch-window-ms",
        "milliseconds a Verify/Propose call waits for calls from other sessions to share its "
        "forward passes (0 = every call runs alone)",
        parse=number(float, 0),
        more="Never while every session active in the last second already has a call waiting.",
    )
    max_batch_size: int = setting(8, "--max-batch-size", "most sessions served by one batched call")
    quantize: str = quantize_setting("auto")  # the draft's: its numerics change only speed
    session_ttl_s: float = fixed(
        300.0,
        "seconds an idle session is kept. The coordinator ends every session when its request ends, fails or is "
        "cancelled, and a full KV budget evicts idle sessions first, so this only collects what a coordinator "
        "that vanished left open: one value for every deployment",
    )
    pass_cost_profile: str = fixed(
        "",
        "emulation only (python -m bench.emulated): hold every forward pass to this JSON profile's time for "
        "it, as a host beside an accelerator waits; a deployment runs at its hardware's own speed",
    )
    calibrate: bool = setting(
        True,
        "--calibrate",
        f"on: measure what a forward pass costs for 1..{CALIBRATION_MAX_TOKENS} new tokens (at most "
        "max-speculative-tokens+1; larger passes are extrapolated) at start-up (a few seconds; reported in Info, "
        "used by the coordinator's K chooser)",
        more="`off` reports no costs; the coordinator then uses its default K.",
    )
    security: ServerSecurity = group(ServerSecurity())

    @property
    def torch_threads(self) -> int:
        """Intra-op threads to set: --threads, else one per pinned core, else 0 (torch's default,
        which counts the machine's cores, not the ones this process may use)."""
        return self.threads or pinned_cores()

    def resolved_quantize(self) -> str:
        """ "int8" or "none": what `auto` means for this device and dtype."""
        if self.quantize != "auto":
            return self.quantize
        return "int8" if self.device == "cpu" and self.dtype == "float32" and int8_supported() else "none"

    def quantize_problem(self) -> str | None:
        if self.quantize == "int8" and (self.device != "cpu" or self.dtype != "float32"):
            return f"--quantize int8 needs --device cpu and --dtype float32; got {self.device} and {self.dtype}"
        return None

    def problem(self) -> str | None:
        """A contradiction between settings, in words; None if the config is consistent."""
        if not 1 <= self.max_speculative_tokens < MAX_ROWS:
            return f"--max-speculative-tokens must be in [1, {MAX_ROWS - 1}]; got {self.max_speculative_tokens}"
        if self.max_batch_size < 1:
            return f"--max-batch-size must be >= 1 (1 turns batching off); got {self.max_batch_size}"
        if self.prefix_block_tokens < 1:
            return f"prefix_block_tokens must be >= 1; got {self.prefix_block_tokens}"
        if isinstance(self.max_kv_bytes, int) and self.max_kv_bytes and self.prefix_cache_bytes > self.max_kv_bytes:
            return (
                f"--prefix-cache-bytes ({self.prefix_cache_bytes}) is counted in --max-kv-bytes "
                f"({self.max_kv_bytes}) and cannot exceed it"
            )
        return self.security.problem() or self.quantize_problem()
