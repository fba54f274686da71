"""The concurrency suite: aggregate tokens/s with 1, 2, 4, 8 generations at once, with
nothing batched, with the target batching Verify calls, and with the draft batching Propose
calls as well, interleaved in one run.

Each setting has its own draft service (the int8 CPU default), target and coordinator:
`off` runs both services with `--batch-window-ms 0`, `verify` gives the target a window, and
`both` gives both a window. Every sample runs the same workload, one greedy request per slot
of `--requests` (the prompts in turn), with at most N in flight (N clients that each send
their next request when the last one returns), and times it: aggregate tokens/s is
Σ generated tokens / wall time. So N = 1 and N = 8 generate the same tokens from the same
prompts, and only the concurrency differs. Sizes and settings alternate within every repeat,
so machine noise lands on all of them alike.
"""

from __future__ import annotations

import logging
import re
import statistics
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.modes import ROOT, drafter_args, target_service_args  # noqa: E402
from specdec.rpc.ports import free_port  # noqa: E402
from specdec.tools.launch import (  # noqa: E402
    COORDINATOR_START_S,
    ServiceProcess,
    model_service_args,
    spawn,
    spawn_coordinator,
    stop_all,
)
from specdec.v1 import coordinator_pb2 as pb  # noqa: E402
from specdec.v1 import coordinator_pb2_grpc  # noqa: E402

logger = logging.getLogger("bench")

# off: every call alone; verify: the target batches Verify; both: the draft batches Propose too.
BATCHING = ("off", "verify", "both")


@dataclass
class ConcurrencySample:
    batching: str  # one of BATCHING
    sessions: int  # requests in flight at once (N)
    k: int
    repeat: int
    wall_ms: float  # first request sent → last response
    tokens: int  # generated over all requests
    rounds: int
    proposed: int
    accepted: int
    verify_calls: int  # target Verify calls in this sample (from its metrics)
    verify_batch_sum: float  # Σ over those calls of the sessions in their pass
    request_tokens: list[int] = field(default_factory=list)
    request_ms: list[float] = field(default_factory=list)  # each request's own total time
    propose_calls: int = 0  # draft Propose calls in this sample
    propose_batch_sum: float = 0.0  # Σ over those calls of the most sessions in one of their passes


class ConcurrencyRunner:
    """Per batching setting its own draft service, target service and coordinator."""

    def __init__(self, config, log_dir: Path) -> None:
        self._processes = ExitStack()
        self._started: list[ServiceProcess] = []  # stopped together, coordinators first (stop_all)
        self._processes.callback(stop_all, self._started)
        model_args, env = model_service_args(config.device, config.threads)
        try:
            self.metrics_ports: dict[tuple[str, str], int] = {}
            services: dict[str, dict[str, ServiceProcess]] = {}
            for batching in BATCHING:
                windows = {
                    "draft": config.batch_window_ms if batching == "both" else 0.0,
                    "target": config.batch_window_ms if batching in ("verify", "both") else 0.0,
                }
                model_flags = {
                    "draft": [
                        "--model",
                        str(config.draft_model),
                        "--dtype",
                        config.draft_dtype,
                        *drafter_args("int8", config),
                    ],
                    "target": target_service_args(config),
                }
                services[batching] = {}
                for role in ("draft", "target"):
                    services[batching][role] = self._start(
                        f"{role}_service",
                        [
                            *model_flags[role],
                            *model_args,
                            "--batch-window-ms",
                            str(windows[role]),
                            "--max-batch-size",
                            str(max(config.sessions)),
                        ],
                        log_dir / f"{role}-batching-{batching}.log",
                        env,
                        ROOT,
                    )
            for batching, pair in services.items():
                for role, process in pair.items():
                    process.wait_healthy(900)
                    # Bound by the service itself (spawn passes --metrics-port 0): a port picked
                    # here could be taken by another process before the service binds it.
                    self.metrics_ports[batching, role] = process.metrics_port()
            self.channels: dict[str, grpc.Channel] = {}
            self.stubs: dict[str, coordinator_pb2_grpc.CoordinatorStub] = {}
            coordinators: list[ServiceProcess] = []
            for batching, pair in services.items():
                draft, target = pair["draft"], pair["target"]
                coordinator = spawn_coordinator(
                    draft,
                    target,
                    config.target_model,
                    log_dir / f"coordinator-batching-{batching}.log",
                    ["--max-new-tokens-limit", "4096"],
                    ROOT,
                    wait=False,
                )
                coordinators.append(coordinator)
                self._started.append(coordinator)
                self.channels[batching] = grpc.insecure_channel(coordinator.address)
                self.stubs[batching] = coordinator_pb2_grpc.CoordinatorStub(self.channels[batching])
            for coordinator in coordinators:
                coordinator.wait_healthy(COORDINATOR_START_S)
        except BaseException:
            self._processes.close()
            raise

    def _start(self, module: str, args: list[str], log: Path, env: dict[str, str], root: Path) -> ServiceProcess:
        process = spawn(module, module, args, free_port(), log, env, root)
        self._started.append(process)
        return process

    def batch_totals(self, batching: str, role: str) -> tuple[float, float]:
        """(calls, Σ their batch sizes) so far, from the service's Prometheus metrics."""
        rpc = {"draft": "propose", "target": "verify"}[role]
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[batching, role]}/metrics", timeout=10)
            .read()
            .decode()
        )
        values = {}
        for name in ("count", "sum"):
            match = re.search(rf'^specdec_{role}_batch_size_{name}\{{rpc="{rpc}"\}} (\S+)$', text, re.MULTILINE)
            values[name] = float(match.group(1)) if match else 0.0
        return values["count"], values["sum"]

    def run(
        self, batching: str, prompts: list[str], sessions: int, max_new_tokens: int, k: int, repeat: int
    ) -> ConcurrencySample:
        """One request per prompt, at most `sessions` in flight."""
        import time

        before = {role: self.batch_totals(batching, role) for role in ("draft", "target")}
        stub = self.stubs[batching]
        requests = [
            pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, num_speculative_tokens=k)
            for prompt in prompts
        ]
        with ThreadPoolExecutor(sessions) as pool:
            start = time.perf_counter()
            responses = list(pool.map(lambda request: stub.Generate(request, timeout=3600), requests))
            wall_ms = (time.perf_counter() - start) * 1e3
        after = {role: self.batch_totals(batching, role) for role in ("draft", "target")}
        moved = {role: (after[role][0] - before[role][0], after[role][1] - before[role][1]) for role in after}
        stats = [response.stats for response in responses]
        return ConcurrencySample(
            batching,
            sessions,
            k,
            repeat,
            wall_ms,
            sum(s.generated_tokens for s in stats),
            sum(s.rounds for s in stats),
            sum(s.proposed_tokens for s in stats),
            sum(s.accepted_tokens for s in stats),
            int(moved["target"][0]),
            moved["target"][1],
            [s.generated_tokens for s in stats],
            [s.total_ms for s in stats],
            int(moved["draft"][0]),
            moved["draft"][1],
        )

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self._processes.close()


def run_concurrency(config, prompts: list[dict], machine: dict) -> dict:
    config.out_dir.mkdir(parents=True, exist_ok=True)
    logger.info(
        "starting a draft service, a target service and a coordinator per batching setting (%s)", ", ".join(BATCHING)
    )
    runner = ConcurrencyRunner(config, config.out_dir / "logs")
    samples: list[ConcurrencySample] = []
    try:
        for batching in BATCHING:  # warm-up: first calls pay one-off costs
            runner.run(batching, [prompts[0]["text"]] * 2, 2, 4, max(config.ks), -1)
        requests = config.requests or max(config.sessions)
        texts = [prompts[i % len(prompts)]["text"] for i in range(requests)]
        for repeat in range(config.repeats):
            for k in config.ks:
                for sessions in config.sessions:
                    order = BATCHING if (repeat + sessions) % 2 == 0 else BATCHING[::-1]
                    for batching in order:
                        sample = runner.run(batching, texts, sessions, config.max_new_tokens, k, repeat)
                        logger.info(
                            "K=%d sessions=%d batching %s: %.2f tok/s aggregate (%d tokens in %.1f s), %.2f sessions "
                            "per verify, "
                            "%.2f per propose",
                            k,
                            sessions,
                            batching,
                            sample.tokens / (sample.wall_ms / 1e3),
                            sample.tokens,
                            sample.wall_ms / 1e3,
                            sample.verify_batch_sum / max(sample.verify_calls, 1),
                            sample.propose_batch_sum / max(sample.propose_calls, 1),
                        )
                        samples.append(sample)
    finally:
        runner.close()
    machine["threads"]["note"] = (
        "N generations at once: the draft and target services compute at the same time on the same cores"
    )
    return {
        "suite": "concurrency",
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in asdict(config).items()},
        "machine": machine,
        "prompts": [p["kind"] for p in prompts],
        "samples": [asdict(s) for s in samples],
    }


def summarise(results: dict) -> list[dict]:
    """One row per (K, sessions): aggregate tokens/s per batching setting (median over
    repeats), on/off, and scaling against one session with the same setting."""
    samples = results["samples"]
    rows = []
    for k in sorted({s["k"] for s in samples}):
        for sessions in sorted({s["sessions"] for s in samples}):
            row: dict = {"k": k, "sessions": sessions}
            for batching in BATCHING:
                group = [s for s in samples if (s["k"], s["sessions"], s["batching"]) == (k, sessions, batching)]
                rates = [s["tokens"] / (s["wall_ms"] / 1e3) for s in group]
                calls = sum(s["verify_calls"] for s in group)
                proposes = sum(s.get("propose_calls", 0) for s in group)
                row[batching] = {
                    "tokens_per_s": statistics.median(rates) if rates else None,
                    "tokens_per_s_min": min(rates, default=None),
                    "tokens_per_s_max": max(rates, default=None),
                    "sessions_per_verify": sum(s["verify_batch_sum"] for s in group) / calls if calls else None,
                    "sessions_per_propose": sum(s.get("propose_batch_sum", 0) for s in group) / proposes
                    if proposes
                    else None,
                    "acceptance": sum(s["accepted"] for s in group) / sum(s["proposed"] for s in group)
                    if sum(s["proposed"] for s in group)
                    else None,
                    "tokens_per_round": sum(s["tokens"] for s in group) / sum(s["rounds"] for s in group)
                    if sum(s["rounds"] for s in group)
                    else None,
                    "request_ms": statistics.median([ms for s in group for ms in s.get("request_ms", [])])
                    if group and group[0].get("request_ms")
                    else None,
                }
            rows.append(row)
    for row in rows:
        single = next(r for r in rows if r["k"] == row["k"] and r["sessions"] == min(x["sessions"] for x in rows))
        for batching in BATCHING:
            base, tps = single[batching]["tokens_per_s"], row[batching]["tokens_per_s"]
            row[batching]["scaling"] = tps / base if tps and base else None
        off = row["off"]["tokens_per_s"]
        for batching in BATCHING[1:]:
            tps = row[batching]["tokens_per_s"]
            row[batching]["over_off"] = tps / off if tps and off else None
    return rows


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(rows: list[dict], machine: dict, config: dict) -> str:
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores, device {machine['device']}"
        + (f" ({machine['gpu']})" if machine.get("gpu") else "")
        + f"; torch {machine['torch']}, transformers {machine['transformers']}; {machine['date']}"
        + (f" ({machine['cpu_flags']})" if machine.get("cpu_flags") else ""),
        f"Target {Path(config['target_model']).name} {config['target_dtype']}, draft "
        f"{Path(config['draft_model']).name} int8, "
        f"{config['threads']} threads per service, greedy; every row runs the same "
        f"{config['requests'] or max(config['sessions'])} requests "
        f"({config['max_new_tokens']} new tokens each) with at most N in flight; {config['repeats']} repeats (median, "
        "range); "
        f"off = every call alone; verify = the target batches Verify; both = the draft batches Propose too "
        f"(--batch-window-ms {config['batch_window_ms']}).",
        "",
        "| K | N in flight | off: tok/s | verify: tok/s | both: tok/s | off: × N=1 | verify: × N=1 | both: × N=1 "
        "| both / off | sessions per verify pass (verify / both) | sessions per propose pass (both) | request ms (off "
        "/ verify / both, median) | acceptance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        off, verify, both = row["off"], row["verify"], row["both"]
        rates = " ".join(
            f"| {_fmt(row[b]['tokens_per_s'])} ({_fmt(row[b]['tokens_per_s_min'])}–{_fmt(row[b]['tokens_per_s_max'])})"
            for b in BATCHING
        )
        lines.append(
            f"| {row['k']} | {row['sessions']} {rates} "
            f"| {_fmt(off['scaling'], suffix='×')} | {_fmt(verify['scaling'], suffix='×')} | "
            f"{_fmt(both['scaling'], suffix='×')} "
            f"| {_fmt(both['over_off'], suffix='×')} | {_fmt(verify['sessions_per_verify'])} / "
            f"{_fmt(both['sessions_per_verify'])} "
            f"| {_fmt(both['sessions_per_propose'])} "
            f"| {' / '.join(_fmt(row[b]['request_ms'], '.0f') for b in BATCHING)} | {_fmt(both['acceptance'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({row["k"] for row in rows}):
        points = [row for row in rows if row["k"] == k]
        for batching, style in zip(BATCHING, ("o:", "o--", "o-")):
            ax.plot(
                [r["sessions"] for r in points],
                [r[batching]["tokens_per_s"] for r in points],
                style,
                label=f"K={k}, batching {batching}",
            )
    ax.set_xlabel("generations in flight (N)")
    ax.set_ylabel("aggregate tokens/s (median over repeats)")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "tokens_per_s_vs_sessions.png", dpi=110)
    plt.close(fig)
    return ["tokens_per_s_vs_sessions.png"]
