"""`make loadtest`: a bounded load test of the three services as real processes on loopback.

N concurrent clients loop Generate and GenerateStream requests (greedy and sampled) for a fixed
time, then stop by themselves. The run passes when no request failed, both model services hold
no session once the clients stop, and each service's resident memory at the end is within a
tolerance of its value after warm-up: sessions are freed, not accumulated. It reports request
counts, errors by status code, latency percentiles (client wall time, and the server's total
and time to first token), aggregate tokens/s and RSS per service, and writes them as JSON.

    python scripts/loadtest.py --clients 32 --duration 180 --report .cache/loadtest/report.json

Without --draft-model/--target-model it builds the tests' tiny pair (random Qwen2 weights) in a
temporary folder, so it needs no model download.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.tools.launch import ServiceProcess, local_stack  # noqa: E402
from specdec.v1 import (  # noqa: E402
    common_pb2,
    coordinator_pb2_grpc,  # noqa: E402
    draft_pb2_grpc,
    target_pb2_grpc,
)
from specdec.v1 import coordinator_pb2 as pb  # noqa: E402

DEFAULT_PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "SELECT name, count(*) FROM users",
    "Speculative decoding drafts tokens with a small model and",
    "for i in range(10):\n    print(",
    "Résumé: naïve café — ünïcödé text, 東京 and",
    "The draft model proposes several tokens, and the target model checks all of them in one forward pass.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
]
SAMPLED_TEMPERATURE = 0.8
PERCENTILES = (50, 90, 99)


@dataclass
class Outcome:
    """One finished request."""

    started: float  # monotonic seconds
    streamed: bool
    code: str  # "OK" or the status code name
    latency_ms: float = 0.0  # client wall time, send to last byte
    tokens: int = 0
    server_total_ms: float = 0.0
    ttft_ms: float = 0.0  # the server's time to first token
    detail: str = ""


@dataclass
class Phase:
    """Timestamps that split the run: requests started before `measured_from` are warm-up."""

    measured_from: float
    stop_at: float
    outcomes: list[Outcome] = field(default_factory=list)


def load_prompts(path: Path | None) -> list[str]:
    """A JSON list of strings, or bench/prompts.json's {"prompts": [{"text": ...}]}."""
    if path is None:
        return DEFAULT_PROMPTS
    data = json.loads(path.read_text())
    prompts = [p["text"] if isinstance(p, dict) else p for p in (data["prompts"] if isinstance(data, dict) else data)]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise SystemExit(f"{path}: expected a non-empty list of prompt strings")
    return prompts


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc (Linux), which counts what the process really holds."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sample_rss(services: dict[str, ServiceProcess]) -> dict[str, int]:
    return {name: rss_bytes(service.process.pid) for name, service in services.items()}


async def client_loop(index: int, address: str, prompts: list[str], args: argparse.Namespace, phase: Phase) -> None:
    """One client with its own connection: requests back to back until the phase ends."""
    rng = random.Random(args.seed * 1_000_003 + index)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while time.monotonic() < phase.stop_at:
            streamed = rng.random() < args.stream_fraction
            request = pb.GenerateRequest(prompt=rng.choice(prompts), max_new_tokens=args.max_new_tokens)
            if args.cache_salts:  # many namespaces: the services' caches fill as many tenants' would
                request.cache_salt = f"tenant-{rng.randrange(args.cache_salts)}"
            if rng.random() < args.sampled_fraction:
                request.temperature = SAMPLED_TEMPERATURE
                request.seed = rng.getrandbits(63)
            phase.outcomes.append(await one_request(stub, request, streamed, args.request_timeout))


async def one_request(stub, request: pb.GenerateRequest, streamed: bool, timeout_s: float) -> Outcome:
    started = time.monotonic()
    outcome = Outcome(started=started, streamed=streamed, code="OK")
    try:
        if streamed:
            final, tokens = None, 0
            async for chunk in stub.GenerateStream(request, timeout=timeout_s):
                tokens += len(chunk.token_ids)
                final = chunk
            if final is None or not final.finish_reason:
                raise RuntimeError("the stream ended without a final message")
            stats = final.stats
        else:
            response = await stub.Generate(request, timeout=timeout_s)
            stats, tokens = response.stats, len(response.token_ids)
    except grpc.aio.AioRpcError as error:
        outcome.code, outcome.detail = error.code().name, error.details() or ""
    except RuntimeError as error:
        outcome.code, outcome.detail = "INCOMPLETE_STREAM", str(error)
    else:
        outcome.tokens, outcome.server_total_ms, outcome.ttft_ms = tokens, stats.total_ms, stats.time_to_first_token_ms
    outcome.latency_ms = (time.monotonic() - started) * 1000
    return outcome


async def sample_memory_during(services: dict[str, ServiceProcess], phase: Phase) -> dict[str, dict[str, int]]:
    """RSS after warm-up ("start"), halfway through the measured time ("mid") and at its end ("end")."""
    samples = {}
    measured_s = phase.stop_at - phase.measured_from
    for name, at in (
        ("start", phase.measured_from),
        ("mid", phase.measured_from + measured_s / 2),
        ("end", phase.stop_at),
    ):
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        samples[name] = sample_rss(services)
    return samples


async def run_load(
    services: dict[str, ServiceProcess], prompts: list[str], args: argparse.Namespace
) -> tuple[Phase, dict, float]:
    now = time.monotonic()
    phase = Phase(measured_from=now + args.warmup, stop_at=now + args.warmup + args.duration)
    address = services["coordinator"].address
    clients = [asyncio.create_task(client_loop(i, address, prompts, args, phase)) for i in range(args.clients)]
    memory = await sample_memory_during(services, phase)
    await asyncio.gather(*clients)
    return phase, memory, time.monotonic() - phase.measured_from


async def infos(services: dict[str, ServiceProcess]) -> dict[str, common_pb2.ModelInfo]:
    found = {}
    for name, stub_class in (("draft", draft_pb2_grpc.DraftStub), ("target", target_pb2_grpc.TargetStub)):
        async with grpc.aio.insecure_channel(services[name].address) as channel:
            found[name] = await stub_class(channel).Info(common_pb2.InfoRequest(), timeout=10)
    return found


async def open_sessions(services: dict[str, ServiceProcess]) -> dict[str, int]:
    return {name: info.open_sessions for name, info in (await infos(services)).items()}


def prefix_caches(services: dict[str, ServiceProcess]) -> dict[str, dict]:
    """Each model service's prefix cache at the end (--prefix-cache-bytes): bytes held, limit, hits."""
    return {
        name: {
            "bytes": info.prefix_cache.bytes,
            "max_bytes": info.prefix_cache.max_bytes,
            "lookups": info.prefix_cache.lookups,
            "hits": info.prefix_cache.hits,
            "tokens_saved": info.prefix_cache.tokens_saved,
        }
        for name, info in asyncio.run(infos(services)).items()
    }


async def wait_sessions_closed(services: dict[str, ServiceProcess], timeout_s: float) -> tuple[dict[str, int], float]:
    """Polls both services' Info until neither holds a session; returns the last counts and the wait."""
    started = time.monotonic()
    while True:
        counts = await open_sessions(services)
        waited = time.monotonic() - started
        if not any(counts.values()) or waited >= timeout_s:
            return counts, waited
        await asyncio.sleep(0.2)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": round(float(np.percentile(values, q)), 1) for q in PERCENTILES}


def summarise(phase: Phase, memory: dict, measured_s: float, sessions: dict, sessions_wait_s: float, args) -> dict:
    measured = [o for o in phase.outcomes if o.started >= phase.measured_from]
    ok = [o for o in measured if o.code == "OK"]
    errors = Counter(o.code for o in phase.outcomes if o.code != "OK")
    growth = {name: memory["end"][name] / memory["start"][name] - 1 for name in memory["start"]}
    return {
        "config": {
            "clients": args.clients,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "max_new_tokens": args.max_new_tokens,
            "sampled_fraction": args.sampled_fraction,
            "stream_fraction": args.stream_fraction,
            "threads": args.threads,
            "coordinator_args": args.coordinator_args,
            "draft_args": args.draft_args,
            "target_args": args.target_args,
            "cache_salts": args.cache_salts,
            "draft_model": str(args.draft_model or "tiny"),
            "target_model": str(args.target_model or "tiny"),
            "rss_tolerance": args.rss_tolerance,
        },
        "requests": len(measured),
        "warmup_requests": len(phase.outcomes) - len(measured),
        "ok": len(ok),
        "streamed": sum(o.streamed for o in measured),
        "errors": dict(errors),  # warm-up included: every failure counts
        "error_examples": sorted({f"{o.code}: {o.detail}" for o in phase.outcomes if o.code != "OK"})[:10],
        "measured_s": round(measured_s, 2),  # end of warm-up until the last in-flight request finished
        "requests_per_s": round(len(ok) / measured_s, 2),
        "tokens": sum(o.tokens for o in ok),
        "tokens_per_s": round(sum(o.tokens for o in ok) / measured_s, 1),
        "latency_ms": percentiles([o.latency_ms for o in ok]),
        "server_total_ms": percentiles([o.server_total_ms for o in ok]),
        "ttft_ms": percentiles([o.ttft_ms for o in ok]),
        "rss_bytes": memory,
        "rss_growth": {name: round(value, 4) for name, value in growth.items()},
        "open_sessions_after": sessions,
        "sessions_closed_after_s": round(sessions_wait_s, 2),
        # Figures depend on what else shares the cores: the load average says how much did.
        "machine": {"cores": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
    }


def verdict(report: dict, tolerance: float) -> list[str]:
    """Why the run failed; empty when it passed."""
    failures = []
    if report["errors"]:
        failures.append(f"requests failed: {report['errors']}")
    if not report["ok"]:
        failures.append("no request completed in the measured time")
    if any(report["open_sessions_after"].values()):
        failures.append(f"sessions still open after the clients stopped: {report['open_sessions_after']}")
    for name, growth in report["rss_growth"].items():
        if growth > tolerance:
            failures.append(f"{name} RSS grew {growth:.1%} from start to end (tolerance {tolerance:.0%})")
    return failures


def print_report(report: dict) -> None:
    mib = 1024 * 1024
    print(
        f"requests {report['requests']} in {report['measured_s']:.0f}s ({report['requests_per_s']}/s; "
        f"{report['streamed']} streamed) + {report['warmup_requests']} warm-up; errors {report['errors'] or 0}"
    )
    for name in ("latency_ms", "server_total_ms", "ttft_ms"):
        figures = report[name]
        print(f"{name:>16}: " + "  ".join(f"{q} {v}" for q, v in figures.items()))
    print(f"tokens {report['tokens']}, {report['tokens_per_s']} tokens/s aggregate")
    for service in report["rss_bytes"]["start"]:
        start, mid, end = (report["rss_bytes"][when][service] / mib for when in ("start", "mid", "end"))
        print(
            f"RSS {service:>11}: start {start:.1f} MiB, mid {mid:.1f} MiB, end {end:.1f} MiB "
            f"({report['rss_growth'][service]:+.1%})"
        )
    print(f"open sessions after: {report['open_sessions_after']} (waited {report['sessions_closed_after_s']}s)")
    for service, cache in report.get("prefix_caches", {}).items():
        if cache["max_bytes"]:
            print(
                f"prefix cache {service:>6}: {cache['bytes'] / mib:.1f} of {cache['max_bytes'] / mib:.1f} MiB, "
                f"{cache['hits']} hits in {cache['lookups']} lookups, {cache['tokens_saved']} tokens saved"
            )
    print(
        f"machine: {report['machine']['cores']} cores, load average at the end "
        f"{report['machine']['load_average_at_end']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/loadtest.py", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients, each with its own connection")
    parser.add_argument("--duration", type=float, default=180.0, help="measured seconds, after the warm-up")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the first memory sample")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--prompts", type=Path, default=None, help="JSON list of prompt strings (or bench/prompts.json)"
    )
    parser.add_argument(
        "--sampled-fraction",
        type=float,
        default=0.5,
        help=f"share of requests at temperature {SAMPLED_TEMPERATURE} (others greedy)",
    )
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="share of requests sent as GenerateStream")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="deadline of one request, seconds")
    parser.add_argument(
        "--rss-tolerance", type=float, default=0.25, help="largest RSS growth from start to end, as a fraction"
    )
    parser.add_argument(
        "--sessions-timeout", type=float, default=5.0, help="how long sessions may take to close after the load"
    )
    parser.add_argument(
        "--draft-model", type=Path, default=None, help="draft model folder (default: the tests' tiny pair)"
    )
    parser.add_argument(
        "--target-model", type=Path, default=None, help="target model folder (default: the tests' tiny pair)"
    )
    parser.add_argument("--dtype", default="float32", help="both services' --dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model service")
    parser.add_argument("--coordinator-args", default="", help="extra coordinator flags, e.g. '--pipeline on'")
    parser.add_argument(
        "--draft-args", default="", help="extra draft service flags, e.g. '--drafter suffix --prefix-cache-bytes 16MiB'"
    )
    parser.add_argument(
        "--target-args", default="", help="extra target service flags, e.g. '--prefix-cache-bytes 16MiB'"
    )
    parser.add_argument(
        "--cache-salts",
        type=int,
        default=0,
        help="each request sends one of N cache_salt values at random (0 = none), so the caches fill",
    )
    parser.add_argument(
        "--report", type=Path, default=ROOT / ".cache/loadtest/report.json", help="where the JSON report goes"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="service logs (default: beside the report)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the clients' choices of prompt, mode and sampling seed"
    )
    args = parser.parse_args(argv)
    if (args.draft_model is None) != (args.target_model is None):
        parser.error("give both --draft-model and --target-model, or neither")
    if args.clients < 1 or args.duration <= 0 or args.warmup < 0 or args.max_new_tokens < 1:
        parser.error("--clients and --max-new-tokens must be >= 1, --duration > 0, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the load test; 0 when it passed, 1 when it failed (the report says why)."""
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)
    log_dir = args.log_dir or args.report.parent / "logs"
    with tempfile.TemporaryDirectory(prefix="specdec-loadtest-") as scratch:
        draft_model, target_model = args.draft_model, args.target_model
        if draft_model is None:
            from transformers.utils import logging as hf_logging

            from specdec.tools.testing import build_pair, byte_level_tokenizer

            hf_logging.disable_progress_bar()
            pair = build_pair(Path(scratch), byte_level_tokenizer(), logit_scale=3.0, noise=0.3, eos=True)
            draft_model, target_model = pair.draft, pair.target
        print(f"starting draft, target and coordinator ({draft_model}, {target_model}); logs in {log_dir}", flush=True)
        with local_stack(
            draft_model,
            target_model,
            log_dir,
            draft_dtype=args.dtype,
            target_dtype=args.dtype,
            threads=args.threads,
            draft_args=shlex.split(args.draft_args),
            target_args=shlex.split(args.target_args),
            coordinator_args=shlex.split(args.coordinator_args),
            cwd=ROOT,
        ) as services:
            print(f"{args.clients} clients: {args.warmup:.0f}s warm-up, then {args.duration:.0f}s measured", flush=True)
            phase, memory, measured_s = asyncio.run(run_load(services, prompts, args))
            sessions, waited = asyncio.run(wait_sessions_closed(services, args.sessions_timeout))
            caches = prefix_caches(services)
    report = summarise(phase, memory, measured_s, sessions, waited, args)
    report["prefix_caches"] = caches
    failures = verdict(report, args.rss_tolerance)
    report["passed"], report["failures"] = not failures, failures
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"report: {args.report}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
