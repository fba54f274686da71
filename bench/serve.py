"""`python -m bench.serve --base-url http://HOST:8000/v1`: load a running deployment through its
OpenAI-compatible API, as an operator measures any serving endpoint (vLLM's serving benchmark
measures the same figures), and report what its users saw.

Every request streams a chat completion; the load is closed (`--concurrency N` requests in
flight, each sent when one ends) or open (`--request-rate R`: Poisson arrivals at R a second,
at most `--concurrency` in flight). It reports, over the requests that succeeded:

    time to first token (TTFT)       request sent -> first content event
    time per output token (TPOT)     (end - first token) / (output tokens - 1), per request
    end-to-end latency               request sent -> last event
    throughput                       requests/s and output tokens/s over the run's wall time
    speculation                      the server's `speculation` extras: draft tokens proposed
                                     and accepted, tokens per round (this server's own; another
                                     OpenAI-compatible server sends none and they are left out)

and every failed request by its HTTP status (or the error event a stream ended with). It starts
nothing: the services, their flags and their machines are the deployment's own. Output counts
come from the server's `usage` (`stream_options.include_usage`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.demo_prompts import QUESTIONS

PROMPTS = [
    *QUESTIONS,
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
    base_url: str
    model: str | None
    num_prompts: int
    concurrency: int
    request_rate: float | None  # None: closed loop
    max_tokens: int
    temperature: float
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))


async def served_model(session: aiohttp.ClientSession, load: Load) -> str:
    """`--model`, or the first model /v1/models lists."""
    if load.model:
        return load.model
    async with session.get(f"{load.base_url}/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def one_request(session: aiohttp.ClientSession, load: Load, model: str, prompt: str) -> Outcome:
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
        async with session.post(f"{load.base_url}/chat/completions", json=body) as response:
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


async def run_load(load: Load) -> tuple[list[Outcome], float]:
    """Sends `num_prompts` requests (the prompts in turn) as the load says; returns their
    outcomes and the run's wall time in seconds."""
    rng = random.Random(load.seed)
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    connector = aiohttp.TCPConnector(limit=load.concurrency)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = await served_model(session, load)
        gate = asyncio.Semaphore(load.concurrency)

        async def gated(prompt: str) -> Outcome:
            async with gate:
                return await one_request(session, load, model, prompt)

        started = time.perf_counter()
        tasks = []
        for index in range(load.num_prompts):
            if load.request_rate and index:
                await asyncio.sleep(rng.expovariate(load.request_rate))  # Poisson arrivals
            tasks.append(asyncio.ensure_future(gated(load.prompts[index % len(load.prompts)])))
        outcomes = list(await asyncio.gather(*tasks))
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
        f"{load.base_url}: {summary['succeeded']}/{summary['requests']} requests succeeded ({mode}; "
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
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the API's base, e.g. http://HOST:8000/v1")
    parser.add_argument("--model", help="model name to send (default: the first /v1/models lists)")
    parser.add_argument("--api-key", help="bearer token, where the server checks tokens")
    parser.add_argument("--num-prompts", type=int, default=50, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals a second (default: closed loop)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts-file", type=Path, help="a JSON list of prompt strings (default: built-in chat)")
    parser.add_argument("--seed", type=int, default=0, help="arrival times' seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="one request's deadline, seconds")
    parser.add_argument("--out", type=Path, help="write the summary and every request's outcome as JSON")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.concurrency < 1 or (args.request_rate is not None and args.request_rate <= 0):
        parser.error("--num-prompts and --concurrency must be >= 1, --request-rate > 0")
    prompts = json.loads(args.prompts_file.read_text()) if args.prompts_file else list(PROMPTS)
    if not prompts or not all(isinstance(prompt, str) and prompt for prompt in prompts):
        parser.error("--prompts-file must hold a JSON list of non-empty strings")
    load = Load(
        args.base_url.rstrip("/"),
        args.model,
        args.num_prompts,
        args.concurrency,
        args.request_rate,
        args.max_tokens,
        args.temperature,
        args.api_key,
        args.seed,
        args.timeout,
        prompts,
    )
    outcomes, wall_s = asyncio.run(run_load(load))
    summary = summarise(outcomes, wall_s)
    print(report(summary, load))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "requests": [asdict(o) for o in outcomes]}, indent=1))
    return 0 if summary["succeeded"] == summary["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
