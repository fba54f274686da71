"""`python -m specdec.tools.loadgen ADDRESS`: load a running deployment as an operator measures
any serving endpoint (vLLM's serving benchmark measures the same figures), and report what its
users saw. ADDRESS is the coordinator's gRPC address (`HOST:PORT`) or the base of its
OpenAI-compatible API (`http://HOST:8000/v1`, `https://...`), with TLS and a token as the
client takes them (`--tls-ca`, `--tls-cert`/`--tls-key`, `--auth-token-file`).

Every request streams (GenerateStream, or a chat completion with `stream_options.include_usage`);
the load is closed (`--concurrency N` requests in flight, each sent when one ends) or open
(`--request-rate R`: Poisson arrivals at R a second, at most `--concurrency` in flight), for
`--num-prompts` requests or `--duration` seconds. It reports, over the requests that succeeded:

    time to first token (TTFT)       request sent -> first token
    time per output token (TPOT)     (end - first token) / (output tokens - 1), per request
    end-to-end latency               request sent -> last event
    throughput                       requests/s and output tokens/s over the run's wall time
    speculation                      draft tokens proposed and accepted, tokens per round (this
                                     server's own; another OpenAI-compatible server sends none
                                     and they are left out)

and every failed request by its status (HTTP or gRPC) or the error a stream ended with. It
starts nothing: the services, their flags and their machines are the deployment's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import grpc
from tqdm import tqdm

from specdec.config.services import ClientSecurity, client_security
from specdec.rpc.security import aio_channel, load_client_security
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

# Chat prompts of the kinds `make run` sends (bench/demo_prompts.py), and a few more.
PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a Python list comprehension is, with one short example.",
    "Summarise in two sentences: the draft model proposes several tokens, and the target model checks "
    "all of them in one forward pass; accepted tokens are kept, and the first rejected one is replaced "
    "by a sample from the residual distribution, so the output has exactly the target's distribution.",
    "Write a SQL query that returns the ten customers with the most orders last month.",
    "What does the `yield` keyword do in Python? Answer in three sentences.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "Explain the difference between a process and a thread.",
    "Write a Python class for a fixed-size ring buffer with push and pop.",
]
PERCENTILES = (50, 90, 99)


@dataclass
class Outcome:
    """One request as the client saw it (seconds from when it was sent)."""

    ok: bool
    error: str = ""  # "HTTP 503", "event: ...", "ClientConnectorError", ...
    ttft_s: float | None = None
    e2e_s: float = 0.0
    output_tokens: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0


@dataclass
class Load:
    address: str  # HOST:PORT (gRPC) or http[s]://HOST:PORT/v1 (the OpenAI-compatible API)
    model: str | None  # HTTP: the name to send (None: the first /v1/models lists)
    num_prompts: int | None  # requests to send (None: as many as `duration_s` allows)
    concurrency: int
    request_rate: float | None  # None: closed loop
    max_tokens: int
    temperature: float
    seed: int = 0
    timeout_s: float = 600.0
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    duration_s: float | None = None  # send for this long (then wait for those in flight)
    security: ClientSecurity = field(default_factory=ClientSecurity)

    @property
    def http(self) -> bool:
        return self.address.startswith(("http://", "https://"))


Send = Callable[[str], Awaitable[Outcome]]


async def served_model(session: aiohttp.ClientSession, load: Load) -> str:
    """`--model`, or the first model /v1/models lists."""
    if load.model:
        return load.model
    async with session.get(f"{load.address}/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


def http_ssl(security: ClientSecurity) -> ssl.SSLContext | None:
    """An HTTPS client context from the same files the gRPC client takes (None: the system's)."""
    if not security.tls_ca:
        return None
    context = ssl.create_default_context(cafile=security.tls_ca)
    if security.tls_cert:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


async def http_request(
    session: aiohttp.ClientSession, load: Load, model: str, prompt: str, server_name: str | None
) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": load.max_tokens,
        "temperature": load.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    outcome = Outcome(ok=False)
    try:
        async with session.post(f"{load.address}/chat/completions", json=body, server_hostname=server_name) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}"
                await response.read()
                return outcome
            async for raw in response.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    outcome.ok = True
                    break
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome.error = f"event: {event['error'].get('type', 'error')}"
                    return outcome
                choices = event.get("choices") or []
                # The first token's event: its text, or (text that decodes to nothing yet) its end.
                if outcome.ttft_s is None and any(
                    choice.get("delta", {}).get("content") or choice.get("finish_reason") for choice in choices
                ):
                    outcome.ttft_s = time.perf_counter() - sent
                for figures in [event.get("speculation")] if event.get("speculation") else []:
                    outcome.proposed_tokens += figures.get("proposed_tokens", 0)
                    outcome.accepted_tokens += figures.get("accepted_tokens", 0)
                    outcome.rounds += figures.get("rounds", 0)
                if event.get("usage"):
                    outcome.output_tokens = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome.error = type(exc).__name__
        return outcome
    outcome.e2e_s = time.perf_counter() - sent
    if not outcome.ok:
        outcome.error = "stream ended early"
    return outcome


async def grpc_request(stub: coordinator_pb2_grpc.CoordinatorStub, load: Load, prompt: str) -> Outcome:
    request = coordinator_pb2.GenerateRequest(
        messages=[coordinator_pb2.ChatMessage(role="user", content=prompt)],
        max_new_tokens=load.max_tokens,
        temperature=load.temperature,
    )
    sent = time.perf_counter()
    outcome = Outcome(ok=False)
    try:
        async for chunk in stub.GenerateStream(request, timeout=load.timeout_s):
            if outcome.ttft_s is None and (chunk.token_ids or chunk.finish_reason):
                outcome.ttft_s = time.perf_counter() - sent
            if chunk.finish_reason:
                stats = chunk.stats
                outcome.ok = True
                outcome.output_tokens = stats.generated_tokens
                outcome.proposed_tokens, outcome.accepted_tokens = stats.proposed_tokens, stats.accepted_tokens
                outcome.rounds = stats.rounds
    except grpc.aio.AioRpcError as exc:
        outcome.error = f"gRPC {exc.code().name}"
        return outcome
    outcome.e2e_s = time.perf_counter() - sent
    if not outcome.ok:
        outcome.error = "stream ended early"
    return outcome


async def run_load(load: Load, progress: bool = False) -> tuple[list[Outcome], float]:
    """Sends requests (the prompts in turn) as the load says; returns their outcomes and the
    run's wall time in seconds. `progress`: a progress bar on stderr."""
    loaded = load_client_security(load.security)
    if load.http:
        headers = {"Authorization": f"Bearer {loaded.token}"} if loaded.token else {}
        async with aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=load.timeout_s),
            connector=aiohttp.TCPConnector(limit=load.concurrency, ssl=http_ssl(load.security) or True),
        ) as session:
            model = await served_model(session, load)
            return await drive(
                load, lambda p: http_request(session, load, model, p, load.security.tls_server_name), progress
            )
    channel = aio_channel(load.address, [], loaded)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return await drive(load, lambda prompt: grpc_request(stub, load, prompt), progress)
    finally:
        await channel.close()


async def drive(load: Load, send: Send, progress: bool) -> tuple[list[Outcome], float]:
    """The load's arrivals: closed (a request as each ends, `concurrency` at once) or open
    (Poisson at `request_rate`, at most `concurrency` in flight), until `num_prompts` are sent
    or `duration_s` has passed; then waits for those in flight."""
    rng = random.Random(load.seed)
    gate = asyncio.Semaphore(load.concurrency)
    bar = tqdm(total=load.num_prompts, unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    failed = 0

    async def gated(prompt: str, acquired: bool) -> Outcome:
        nonlocal failed
        if not acquired:
            await gate.acquire()
        try:
            outcome = await send(prompt)
        finally:
            gate.release()
        failed += not outcome.ok
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed)
        return outcome

    started = time.perf_counter()

    def more(index: int) -> bool:
        if load.num_prompts is not None and index >= load.num_prompts:
            return False
        return load.duration_s is None or time.perf_counter() - started < load.duration_s

    tasks: list[asyncio.Future[Outcome]] = []
    index = 0
    while more(index):
        if load.request_rate:
            if index:
                await asyncio.sleep(rng.expovariate(load.request_rate))  # Poisson arrivals
                if not more(index):
                    break
            acquired = False
        else:
            await gate.acquire()  # closed loop: the next request as one ends
            acquired = True
        tasks.append(asyncio.ensure_future(gated(load.prompts[index % len(load.prompts)], acquired)))
        index += 1
    try:
        outcomes = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
    return outcomes, time.perf_counter() - started


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ranked = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.fmean(values), **{f"p{q}": ranked[q - 1] for q in PERCENTILES}}


def summarise(outcomes: list[Outcome], wall_s: float) -> dict:
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in done)
    proposed = sum(o.proposed_tokens for o in done)
    rounds = sum(o.rounds for o in done)
    summary = {
        "requests": len(outcomes),
        "succeeded": len(done),
        "errors": dict(Counter(o.error for o in outcomes if not o.ok)),
        "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s if wall_s else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_ms": percentiles([1e3 * o.ttft_s for o in done if o.ttft_s is not None]),
        "tpot_ms": percentiles(
            [1e3 * (o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in done if o.ttft_s and o.output_tokens > 1]
        ),
        "e2e_ms": percentiles([1e3 * o.e2e_s for o in done]),
    }
    if rounds:
        summary["speculation"] = {
            "acceptance_rate": sum(o.accepted_tokens for o in done) / proposed if proposed else 0.0,
            "tokens_per_round": tokens / rounds,
            "rounds": rounds,
        }
    return summary


def report(summary: dict, load: Load) -> str:
    mode = (
        f"{load.request_rate} requests/s, at most {load.concurrency} in flight"
        if load.request_rate
        else (f"{load.concurrency} in flight")
    )
    lines = [
        f"{load.address}: {summary['succeeded']}/{summary['requests']} requests succeeded ({mode}; "
        f"max_tokens {load.max_tokens}, temperature {load.temperature}) in {summary['wall_s']:.1f} s",
        f"throughput: {summary['requests_per_s']:.2f} requests/s, {summary['output_tokens_per_s']:.1f} output tokens/s",
    ]
    for key, name in (
        ("ttft_ms", "time to first token"),
        ("tpot_ms", "time per output token"),
        ("e2e_ms", "end to end"),
    ):
        if summary[key]:
            figures = ", ".join(f"{label} {value:.1f}" for label, value in summary[key].items())
            lines.append(f"{name} (ms): {figures}")
    if "speculation" in summary:
        spec = summary["speculation"]
        lines.append(
            f"speculation: acceptance {spec['acceptance_rate']:.3f}, {spec['tokens_per_round']:.2f} tokens a round "
            f"({spec['rounds']} rounds)"
        )
    if summary["errors"]:
        lines.append("errors: " + ", ".join(f"{error} x{count}" for error, count in summary["errors"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.loadgen", description=__doc__.splitlines()[0])
    parser.add_argument(
        "address", help="HOST:PORT (the coordinator's gRPC API) or http[s]://HOST:PORT/v1 (its HTTP API)"
    )
    parser.add_argument("--model", help="HTTP: the model name to send (default: the first /v1/models lists)")
    parser.add_argument("--num-prompts", type=int, help="requests to send (default 50, or unbounded with --duration)")
    parser.add_argument("--duration", type=float, help="send requests for this many seconds, then wait for the rest")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals a second (default: closed loop)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts-file", type=Path, help="a JSON list of prompt strings (default: built-in chat)")
    parser.add_argument("--seed", type=int, default=0, help="arrival times' seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="one request's deadline, seconds")
    parser.add_argument("--out", type=Path, help="write the summary and every request's outcome as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it is off where stderr is no tty)")
    parser.add_argument("--tls-ca", help="PEM CA bundle to verify the server's certificate with (turns TLS on)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a server that requires one (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name to check the server's certificate for, not the address's host")
    parser.add_argument("--auth-token-file", help="file whose first line is the bearer token to send")
    args = parser.parse_args(argv)
    if args.duration is None and args.num_prompts is None:
        args.num_prompts = 50
    if (
        (args.num_prompts is not None and args.num_prompts < 1)
        or args.concurrency < 1
        or (args.request_rate is not None and args.request_rate <= 0)
        or (args.duration is not None and args.duration <= 0)
    ):
        parser.error("--num-prompts and --concurrency must be >= 1, --request-rate and --duration > 0")
    security, problem = client_security(
        args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name, args.auth_token_file
    )
    if problem:
        parser.error(problem)
    prompts = json.loads(args.prompts_file.read_text()) if args.prompts_file else list(PROMPTS)
    if not prompts or not all(isinstance(prompt, str) and prompt for prompt in prompts):
        parser.error("--prompts-file must hold a JSON list of non-empty strings")
    load = Load(
        args.address.rstrip("/"),
        args.model,
        args.num_prompts,
        args.concurrency,
        args.request_rate,
        args.max_tokens,
        args.temperature,
        args.seed,
        args.timeout,
        prompts,
        args.duration,
        security,
    )
    try:
        outcomes, wall_s = asyncio.run(run_load(load, progress=not args.no_progress))
    except (ValueError, OSError, aiohttp.ClientError) as exc:  # bad TLS files, an unreachable /v1/models
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    summary = summarise(outcomes, wall_s)
    print(report(summary, load))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "requests": [asdict(o) for o in outcomes]}, indent=1))
    return 0 if summary["succeeded"] == summary["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
