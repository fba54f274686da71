"""`--suite pools`: replica pools, and speculation against target-only under load.

Emulated part (the synthetic pair at α ≈ 0.8 held to the 70B-TP4 / 1B H100 profiles, as the
accelerator suite; a batched pass costs what the profile gives for all its tokens, so batching
is nearly free up to 64 tokens, as on an H100). Every service on loopback, unpinned, with
`--max-batch-size 32`; greedy requests of 64 tokens from the accelerator suite's prompts, each
client sending its next request when the last returns:

- sweep: one target and one draft, 1 to 32 clients, the coordinator's defaults (the K chooser)
  against K = 0, aggregate tok/s over the same requests;
- scale: 32 clients against 1 target + 1 draft, 4 targets + 1 draft, 4 targets + 2 drafts;
- kv: the scale part's stacks with every target replica's KV budget (--max-kv-bytes) holding
  KV_SESSIONS of these requests, a replica that saturates by memory rather than by compute:
  the coordinator admits what fits (coordinator.pools, `Pool.admit`) and the rest wait;
- failover: 4 targets + 1 draft, 16 clients streaming; one target replica is killed once a
  third of the requests are done; failed requests, outputs against target-only, and the longest
  stall a moved request saw (the time to recover).

Real part: the Qwen2.5-Coder pair on this CPU (the bench's target setting; the int8 model
drafter, then the hybrid in a stack of its own), 1, 4 and 8 clients, defaults against K = 0,
interleaved, `--repeats` times.

Everything here is one machine's CPU standing in for the cluster: the emulated figures leave out
the accelerators' own variance and any network beyond loopback, and six processes and 32 clients
share its two cores (the services report passes whose real compute overran the profile).

`--dilation S` (emulated parts): every pass takes S times its profile's time, and the figures
are given in the accelerators' time (tok/s × S, waits ÷ S). The host's work (the services'
Python, the tiny models' real compute, gRPC, the coordinator) then weighs 1/S of what it weighs
at S = 1, as on hosts S times faster than this one: time dilation, as network emulators use to
stand a small testbed in for a larger one (Gupta et al., "To infinity and beyond: time-warped
network emulation", NSDI 2006). It separates what the design gives from what this host can
carry; it is not a measurement of any real host.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.accelerator import PROFILES, PROMPTS, overruns, profile
from bench.emulated import service_command
from bench.modes import drafter_args, model_infos, overlap_flags, target_service_args
from bench.synthetic import pair_with_acceptance
from specdec.engine.modeling import load_causal_lm
from specdec.engine.runner import kv_bytes_per_token
from specdec.rpc.ports import free_port
from specdec.tools.launch import ServiceProcess, model_service_args, spawn
from specdec.tools.testing import TinyPair
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
SWEEP_CLIENTS = (1, 2, 4, 8, 16, 32)
SCALE = ((1, 1), (4, 1), (4, 2))  # (target replicas, draft replicas)
SCALE_CLIENTS = 32
# Requests each scale/kv client sends in turn: enough that the run's start and its tail, where
# fewer than SCALE_CLIENTS are in flight, weigh little beside the steady state between them.
SCALE_REQUESTS_PER_CLIENT = 8
FAILOVER_CLIENTS = 16
REAL_CLIENTS = (1, 4, 8)
REAL_DRAFTERS = ("int8", "int8+lookup")  # bench.modes.drafter_args: the model drafter, and the hybrid
NEW_TOKENS = 64
MAX_K = 16  # the emulated services' --max-speculative-tokens
KV_SESSIONS = 8  # kv part: requests one target replica's KV budget holds
CHOSEN = None  # a request that leaves K to the coordinator
TARGET_PROFILE, DRAFT_PROFILE = "h100-70b-tp4", "h100-1b"


@dataclass(frozen=True)
class Emulation:
    """The emulated parts' pair and the profiles its services hold their passes to."""

    pair: TinyPair
    draft_profile: Path
    target_profile: Path
    dilation: float = 1.0  # every pass takes this many times its profile's time (module docstring)

    @classmethod
    def build(cls, pair: TinyPair, folder: Path, dilation: float) -> Emulation:
        """The published profiles, or at `dilation` ≠ 1 copies of them with every time scaled,
        written into `folder`."""
        if dilation == 1.0:
            return cls(pair, PROFILES / f"{DRAFT_PROFILE}.json", PROFILES / f"{TARGET_PROFILE}.json")
        folder.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {}
        for name in (DRAFT_PROFILE, TARGET_PROFILE):
            published = profile(name)
            path = folder / f"{name}-x{dilation:g}.json"
            path.write_text(
                json.dumps(
                    {
                        "name": f"{name} x{dilation:g}",
                        "source": f"{name} (bench/profiles) with every time x{dilation:g}: time dilation, bench.pools",
                        "pass_ms": [[tokens, ms * dilation] for tokens, ms in published.pass_ms],
                        "context_ms_per_1k": published.context_ms_per_1k * dilation,
                    }
                )
            )
            paths[name] = path
        return cls(pair, paths[DRAFT_PROFILE], paths[TARGET_PROFILE], dilation)


class Stack:
    """Draft and target replicas and a coordinator over them, stopped on exit."""

    def __init__(self, logs: Path, stack: ExitStack) -> None:
        self.logs, self._stack = logs, stack
        self.drafts: list[ServiceProcess] = []
        self.targets: list[ServiceProcess] = []
        self.processes: list[ServiceProcess] = []  # every one started, the coordinator too

    def spawn(self, role: str, args: list[str], env: dict[str, str]) -> ServiceProcess:
        module, args = service_command(role, args) if role != "coordinator" else (role, args)
        name = f"{role}-{len(self.drafts) + len(self.targets)}"
        process = spawn(name, module, args, free_port(), self.logs / f"{name}.log", env, ROOT)
        self._stack.callback(process.stop)
        self.processes.append(process)
        return process

    def coordinator(self, tokenizer: Path, *args: str) -> grpc.Channel:
        coordinator = self.spawn(
            "coordinator",
            [
                "--draft",
                ",".join(d.address for d in self.drafts),
                "--target",
                ",".join(t.address for t in self.targets),
                "--tokenizer",
                str(tokenizer),
                "--max-new-tokens-limit",
                "4096",
                *overlap_flags(),  # sequential rounds, as its figures were measured
                *args,
            ],
            {},
        )
        coordinator.wait_healthy(300)
        self._stack.callback(coordinator.stop)
        channel = grpc.insecure_channel(coordinator.address)
        self._stack.callback(channel.close)
        return channel


def emulated_stack(
    emulated: Emulation, targets: int, drafts: int, logs: Path, stack: ExitStack, target_args: tuple[str, ...] = ()
) -> tuple[Stack, grpc.Channel]:
    pair, services = emulated.pair, Stack(logs, stack)
    common = ["--threads", "1", "--max-speculative-tokens", str(MAX_K), "--max-batch-size", "32"]
    common += ["--max-sessions", "256"]
    env = {"OMP_NUM_THREADS": "1"}
    # One after the other: a service calibrates its passes at start-up, and must not time them
    # while a neighbour loads.
    for _ in range(drafts):
        services.drafts.append(
            services.spawn(
                "draft",
                ["--model", str(pair.draft), "--pass-cost-profile", str(emulated.draft_profile), *common]
                + ["--min-confidence", "0", "--quantize", "none"],
                env,
            )
        )
        services.drafts[-1].wait_healthy(300)
    for _ in range(targets):
        services.targets.append(
            services.spawn(
                "target",
                [
                    "--model",
                    str(pair.target),
                    "--pass-cost-profile",
                    str(emulated.target_profile),
                    *common,
                    *target_args,
                ],
                env,
            )
        )
        services.targets[-1].wait_healthy(300)
    return services, services.coordinator(pair.target)


def request(prompt: list[int] | str, k: int | None, new_tokens: int = NEW_TOKENS) -> pb.GenerateRequest:
    if isinstance(prompt, str):
        return pb.GenerateRequest(prompt=prompt, max_new_tokens=new_tokens, num_speculative_tokens=k)
    return pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens, num_speculative_tokens=k)


def load(stub, clients: int, requests: list[pb.GenerateRequest], dilation: float = 1.0) -> dict:
    """Every request, at most `clients` in flight: each client takes the next request when
    its last is answered. Aggregate tok/s = tokens / wall time, in the accelerators' time at a
    `dilation` (Emulation).

    `steady_tokens_per_s` counts only the window in which every client had a request in flight
    (from the last client's first request to the first client's last answer), the run's start
    and tail left out: each request's tokens are spread evenly over its time in flight, and
    the window gets the share of them its time covers. None where the window is empty. (The
    requests are unary: streamed, they would cost the coordinator and these client threads
    host time per message.)"""
    failed: list[str] = []
    answered: list[tuple[int, float, float, pb.GenerationStats]] = []  # (client thread, began, ended, stats)

    def one(item: pb.GenerateRequest) -> None:
        began = time.perf_counter()
        try:
            reply = stub.Generate(item, timeout=900)
        except grpc.RpcError as exc:
            failed.append(f"{exc.code().name}: {exc.details()}")
            return
        answered.append((threading.get_ident(), began, time.perf_counter(), reply.stats))

    with ThreadPoolExecutor(clients) as pool:
        started = time.perf_counter()
        list(pool.map(one, requests))
        wall = time.perf_counter() - started
    done = [stats for _, _, _, stats in answered]
    tokens = sum(s.generated_tokens for s in done)
    proposed = sum(s.proposed_tokens for s in done)
    loads = [n for s in done for n in s.sessions_per_round]
    spans: dict[int, tuple[float, float]] = {}  # per client thread: its first start, its last end
    for client, began, ended, _ in answered:
        first_began, last_ended = spans.get(client, (began, ended))
        spans[client] = (min(first_began, began), max(last_ended, ended))
    first = max((span[0] for span in spans.values()), default=0.0)
    last = min((span[1] for span in spans.values()), default=0.0)
    if len(spans) < clients:
        first = last = 0.0  # some client never had a request in flight: no steady window
    steady = sum(
        s.generated_tokens * max(0.0, min(ended, last) - max(began, first)) / (ended - began)
        for _, began, ended, s in answered
        if ended > began
    )
    return {
        "clients": clients,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens * dilation / wall,
        "steady_tokens_per_s": steady * dilation / (last - first) if last > first else None,
        "steady_s": max(0.0, last - first),
        "failed": failed,
        "acceptance": sum(s.accepted_tokens for s in done) / proposed if proposed else None,
        "k_mean": proposed / max(1, sum(s.rounds for s in done)),
        "sessions_mean": statistics.mean(loads) if loads else None,
        "targets_used": sorted({s.target_replica for s in done}),
        "queued_ms_mean": statistics.mean(s.queued_ms for s in done) / dilation if done else 0.0,
        "reprefills": sum(s.reprefills for s in done),
    }


def sweep(emulated: Emulation, logs: Path, requests: int) -> list[dict]:
    rows = []
    with ExitStack() as stack:
        services, channel = emulated_stack(emulated, 1, 1, logs / "sweep", stack)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        load(stub, 2, [request(PROMPTS[0], CHOSEN, 8)] * 2)  # warm-up
        for clients in SWEEP_CLIENTS:
            work = {k: [request(PROMPTS[i % len(PROMPTS)], k) for i in range(requests)] for k in (CHOSEN, 0)}
            order = (CHOSEN, 0) if clients % 2 else (0, CHOSEN)
            result = {k: load(stub, clients, work[k], emulated.dilation) for k in order}
            row = {"clients": clients, "chosen": result[CHOSEN], "target_only": result[0]}
            row["ratio"] = result[CHOSEN]["tokens_per_s"] / result[0]["tokens_per_s"]
            print(
                f"sweep N={clients:2d}: defaults {result[CHOSEN]['tokens_per_s']:7.1f} tok/s, "
                f"K=0 {result[0]['tokens_per_s']:7.1f} tok/s, {row['ratio']:.2f}x",
                flush=True,
            )
            rows.append(row)
        rows[0]["overruns"] = overruns(services.drafts[0], services.targets[0])
    return rows


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used so far (/proc/PID/stat)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def kv_budget(pair) -> int:
    """Target --max-kv-bytes holding KV_SESSIONS of the longest request (prompt, NEW_TOKENS
    and a verify's rows: what the coordinator reserves for each, `Pool.reservation`)."""
    per_token = kv_bytes_per_token(load_causal_lm(str(pair.target), "float32", "cpu").model)
    tokens = max(len(prompt) for prompt in PROMPTS) + NEW_TOKENS + MAX_K + 1
    return KV_SESSIONS * tokens * per_token


def scale(emulated: Emulation, logs: Path, requests: int, kv_bytes: int = 0) -> list[dict]:
    """SCALE's stacks under SCALE_CLIENTS clients; `kv_bytes`: every target replica's KV budget."""
    rows = []
    target_args = ("--max-kv-bytes", str(kv_bytes)) if kv_bytes else ()
    part = "kv" if kv_bytes else "scale"
    for targets, drafts in SCALE:
        with ExitStack() as stack:
            services, channel = emulated_stack(
                emulated, targets, drafts, logs / f"{part}-{targets}t{drafts}d", stack, target_args
            )
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            load(stub, 2, [request(PROMPTS[0], CHOSEN, 8)] * 2)
            work = [request(PROMPTS[i % len(PROMPTS)], CHOSEN) for i in range(requests)]
            pids = [p.process.pid for p in services.processes] + [os.getpid()]  # the clients run here
            cpu_before = cpu_seconds(pids)
            result = load(stub, SCALE_CLIENTS, work, emulated.dilation)
            # How busy the host was: CPU seconds of every service, the coordinator and the clients
            # over the wall time times the cores.
            result["host_busy"] = (cpu_seconds(pids) - cpu_before) / (result["wall_s"] * (os.cpu_count() or 1))
            result.update(
                targets=targets,
                drafts=drafts,
                overruns=[overruns(services.drafts[0], t) for t in services.targets],
                evicted=sum(model_infos(services.drafts[0], t)["target"].evicted_sessions for t in services.targets),
            )
            print(
                f"{part} {targets} targets, {drafts} drafts, {SCALE_CLIENTS} clients: "
                f"{result['tokens_per_s']:7.1f} tok/s, waited {result['queued_ms_mean']:.0f} ms a request, "
                f"{result['evicted']} sessions evicted",
                flush=True,
            )
            rows.append(result)
    return rows


def failover(emulated: Emulation, logs: Path, requests: int) -> dict:
    """16 clients streaming over 4 target replicas; one replica killed a third of the way.
    Times in the accelerators' time (Emulation.dilation)."""
    with ExitStack() as stack:
        services, channel = emulated_stack(emulated, 4, 1, logs / "failover", stack)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        reference = {
            tuple(p): list(stub.Generate(request(p, 0), timeout=300).token_ids) for p in PROMPTS
        }  # target-only, greedy
        work = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
        done = threading.Event()
        finished: list[dict] = []
        lock = threading.Lock()

        def stream(prompt: list[int]) -> None:
            times, tokens, stats, error = [], [], None, None
            try:
                for chunk in stub.GenerateStream(request(prompt, CHOSEN), timeout=900):
                    times.append(time.perf_counter())
                    tokens += chunk.token_ids
                    if chunk.HasField("stats"):
                        stats = chunk.stats
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            gaps = [(b - a) / emulated.dilation for a, b in zip(times, times[1:])]
            with lock:
                finished.append(
                    {
                        "same": tokens == reference[tuple(prompt)],
                        "error": error,
                        "moves": stats.replica_moves if stats else 0,
                        "longest_gap_s": max(gaps, default=0.0),
                        "median_gap_s": statistics.median(gaps) if gaps else 0.0,
                    }
                )
                if len(finished) >= requests // 3:
                    done.set()

        with ThreadPoolExecutor(FAILOVER_CLIENTS) as pool:
            started = time.perf_counter()
            futures = [pool.submit(stream, prompt) for prompt in work]
            done.wait()
            killed_at = (time.perf_counter() - started) / emulated.dilation
            victim = services.targets[1]
            victim.process.kill()
            victim.process.wait()
            for future in futures:
                future.result()
            wall = (time.perf_counter() - started) / emulated.dilation
    moved = [r for r in finished if r["moves"]]
    result = {
        "clients": FAILOVER_CLIENTS,
        "requests": requests,
        "killed_at_s": killed_at,
        "wall_s": wall,
        "failed": [r["error"] for r in finished if r["error"]],
        "outputs_differing": sum(not r["same"] for r in finished if not r["error"]),
        "moved": len(moved),
        "recover_s_max": max((r["longest_gap_s"] for r in moved), default=None),
        "recover_s_median": statistics.median([r["longest_gap_s"] for r in moved]) if moved else None,
        "chunk_gap_s_median": statistics.median([r["median_gap_s"] for r in finished]),
    }
    print(
        f"failover: {len(result['failed'])} failed, {result['outputs_differing']} outputs differ, "
        f"{len(moved)} moved, longest stall {result['recover_s_max']}",
        flush=True,
    )
    return result


def real_pair(config, logs: Path) -> list[dict]:
    """The Qwen pair on this CPU: defaults against K = 0 at 1, 4 and 8 clients, for the int8
    model drafter (the draft service's default drafter) and the hybrid (`make run`'s), each in
    a stack of its own."""
    rows = []
    for drafter in REAL_DRAFTERS:
        samples = real_samples(config, logs / drafter, drafter)
        for clients in REAL_CLIENTS:
            rates = {
                k: [s["tokens_per_s"] for s in samples if s["clients"] == clients and s["k"] == k] for k in (CHOSEN, 0)
            }
            k_means = [s["k_mean"] for s in samples if s["clients"] == clients and s["k"] is CHOSEN]
            rows.append(
                {
                    "drafter": drafter,
                    "clients": clients,
                    "chosen": rates[CHOSEN],
                    "target_only": rates[0],
                    "ratios": [a / b for a, b in zip(rates[CHOSEN], rates[0])],
                    "k_mean": statistics.mean(k_means),
                    "failed": sum(len(s["failed"]) for s in samples if s["clients"] == clients),
                }
            )
    return rows


def real_samples(config, logs: Path, drafter: str) -> list[dict]:
    model_args, env = model_service_args(config.device, config.threads)
    with ExitStack() as stack:
        services = Stack(logs, stack)
        batch = ["--max-batch-size", str(max(REAL_CLIENTS))]
        draft_model = ["--model", str(config.draft_model), *drafter_args(drafter, config)]
        services.drafts.append(services.spawn("draft", [*draft_model, *model_args, *batch], env))
        services.drafts[0].wait_healthy(900)  # before the target loads: calibration times the passes
        services.targets.append(services.spawn("target", [*target_service_args(config), *model_args, *batch], env))
        services.targets[0].wait_healthy(900)
        stub = coordinator_pb2_grpc.CoordinatorStub(services.coordinator(config.target_model))
        texts = [
            "Write a Python function that checks whether a string is a palindrome.",
            "Explain what a hash map is in two sentences.",
            "def fibonacci(n):",
            "List three uses of a queue in operating systems.",
        ] * 2
        load(stub, 2, [request(texts[0], CHOSEN, 4)] * 2)
        samples = []
        for repeat in range(config.repeats):
            for clients in REAL_CLIENTS:
                order = (CHOSEN, 0) if (repeat + clients) % 2 else (0, CHOSEN)
                for k in order:
                    result = load(stub, clients, [request(text, k, config.max_new_tokens) for text in texts])
                    result.update(k=k, repeat=repeat)
                    print(
                        f"real pair ({drafter}) N={clients}, K={'chosen' if k is None else k}: "
                        f"{result['tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
                    samples.append(result)
    return samples


def run_pools(config, machine: dict, parts: tuple[str, ...] = ("sweep", "scale", "failover", "real")) -> dict:
    logs = config.out_dir / "logs"
    pair, alpha = pair_with_acceptance(ROOT / ".cache/bench-accelerator", 0.8)
    emulated = Emulation.build(pair, config.out_dir / "profiles", config.dilation)
    results: dict = {"suite": "pools", "machine": machine, "alpha_measured": alpha, "dilation": emulated.dilation}
    # Which parts' figures are emulated (tiny pairs paced to accelerator profiles) and which real.
    results["emulated_parts"] = [part for part in parts if part != "real"]
    if "sweep" in parts:
        results["sweep"] = sweep(emulated, logs, 32)
    if "scale" in parts:
        results["scale"] = scale(emulated, logs, SCALE_CLIENTS * SCALE_REQUESTS_PER_CLIENT)
    if "kv" in parts:
        results["kv_budget"] = kv_budget(pair)
        results["kv"] = scale(emulated, logs, SCALE_CLIENTS * SCALE_REQUESTS_PER_CLIENT, results["kv_budget"])
    if "failover" in parts:
        results["failover"] = failover(emulated, logs, 48)
    if "real" in parts:
        results["real"] = real_pair(config, logs)
    return results


def scale_requests(rows: list[dict]) -> str:
    """How many requests each row's clients sent, and what its two tok/s count."""
    requests = rows[0]["tokens"] // NEW_TOKENS
    return (
        f"Each row: {requests} requests of {NEW_TOKENS} tokens, {requests // SCALE_CLIENTS} a client in turn; tok/s "
        "over the whole run, its start and tail included; steady tok/s over the tokens that arrived while every "
        "client had a request in flight (`load`)."
    )


def steady(row: dict, base: float | None) -> str:
    """A row's steady tok/s and its ratio to the first row's, as two table cells."""
    value = row.get("steady_tokens_per_s")
    if value is None or not base:
        return "— | —"
    return f"{value:.1f} | {value / base:.2f}×"


def markdown(results: dict) -> str:
    machine = results["machine"]
    lines = [
        f"Replica pools (`--suite pools`), {machine['date']}: {machine['cpu']} ({machine['cpu_flags']}), "
        f"{machine['cores']} cores, no GPU; torch {machine['torch']}. Emulated rows: the synthetic pair at "
        f"α {results['alpha_measured']:.2f} held to the {TARGET_PROFILE} / {DRAFT_PROFILE} profiles, greedy, "
        f"{NEW_TOKENS} tokens a request, loopback, every process sharing the two cores.",
        "",
    ]
    dilation = results.get("dilation", 1.0)
    if dilation != 1.0:
        lines[0] += (
            f" **Time-dilated ×{dilation:g}**: every emulated pass took {dilation:g}× its profile's time, and the "
            f"emulated figures are in the accelerators' time (tok/s × {dilation:g}, waits ÷ {dilation:g}), so this "
            f"host's own work weighs 1/{dilation:g} of what it does undilated (bench.pools). Host CPU busy is "
            "this host's, in its own time."
        )
    if "sweep" in results:
        lines += [
            "**Concurrency sweep, one target and one draft (emulated).** Aggregate tok/s over the same 32 requests "
            "(failed: requests of the two samples that got an error; their tokens are not counted).",
            "",
            "| clients | defaults (K chooser) | K = 0 | defaults ÷ K = 0 | mean K | sessions costed | failed |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in results["sweep"]:
            chosen, zero = row["chosen"], row["target_only"]
            lines.append(
                f"| {row['clients']} | {chosen['tokens_per_s']:.1f} | {zero['tokens_per_s']:.1f} | "
                f"{row['ratio']:.2f}× | {chosen['k_mean']:.2f} | {chosen['sessions_mean'] or 0:.1f} | "
                f"{len(chosen['failed']) + len(zero['failed'])} |"
            )
        lines.append("")
    if "scale" in results:
        base = results["scale"][0]["tokens_per_s"]
        lines += [
            f"**Scaling, {SCALE_CLIENTS} clients, defaults (emulated).** {scale_requests(results['scale'])}",
            "",
            "| target replicas | draft replicas | tok/s | × one target | targets used | failed | host CPU busy |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in results["scale"]:
            busy = f"{row['host_busy']:.0%}" if "host_busy" in row else "—"
            lines.append(
                f"| {row['targets']} | {row['drafts']} | {row['tokens_per_s']:.1f} | "
                f"{row['tokens_per_s'] / base:.2f}× | {len(row['targets_used'])} | {len(row['failed'])} | {busy} |"
            )
        lines.append("")
    if "kv" in results:
        base = results["kv"][0]["tokens_per_s"]
        lines += [
            f"**Scaling where a replica saturates by memory, {SCALE_CLIENTS} clients, defaults (emulated).** Every "
            f"target replica's KV budget (--max-kv-bytes {results['kv_budget']}) holds {KV_SESSIONS} of these "
            "requests; the coordinator admits what fits and the rest wait (`Pool.admit`). "
            f"{scale_requests(results['kv'])}",
            "",
            "| target replicas | draft replicas | tok/s | × one target | steady tok/s | × one target | "
            "waited a request, mean | sessions evicted | re-prefills | failed | host CPU busy |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        steady_base = results["kv"][0].get("steady_tokens_per_s")
        for row in results["kv"]:
            lines.append(
                f"| {row['targets']} | {row['drafts']} | {row['tokens_per_s']:.1f} | "
                f"{row['tokens_per_s'] / base:.2f}× | {steady(row, steady_base)} | {row['queued_ms_mean']:.0f} ms | "
                f"{row['evicted']} | {row['reprefills']} | {len(row['failed'])} | {row['host_busy']:.0%} |"
            )
        lines.append("")
    if "failover" in results:
        f = results["failover"]
        lines += [
            f"**A target replica killed mid-load (emulated).** 4 targets, 1 draft, {f['clients']} streaming clients, "
            f"{f['requests']} requests; one replica killed at {f['killed_at_s']:.1f} s: {len(f['failed'])} failed, "
            f"{f['outputs_differing']} outputs differing from target-only, {f['moved']} requests moved; the longest "
            f"stall a moved request saw {f['recover_s_max'] or 0:.2f} s (median {f['recover_s_median'] or 0:.2f} s; "
            f"a chunk every {f['chunk_gap_s_median'] * 1e3:.0f} ms otherwise).",
            "",
        ]
    if "real" in results:
        lines += [
            "**The real pair on this CPU** (int8 Qwen2.5-Coder 0.5B draft, 1.5B target; 8 chat prompts per sample; "
            "drafter int8: the model, int8+lookup: the hybrid, prompt lookup where it finds a match). "
            "Aggregate tok/s, each repeat's defaults and K = 0 run back to back.",
            "",
            "| drafter | clients | defaults tok/s | K = 0 tok/s | defaults ÷ K = 0 per repeat | mean K | failed |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in results["real"]:
            lines.append(
                f"| {row.get('drafter', 'int8')} | {row['clients']} | "
                f"{' / '.join(f'{r:.1f}' for r in row['chosen'])} | "
                f"{' / '.join(f'{r:.1f}' for r in row['target_only'])} | "
                f"{' / '.join(f'{r:.2f}×' for r in row['ratios'])} | {row['k_mean']:.2f} | "
                f"{row.get('failed', '—')} |"
            )
    return "\n".join(lines) + "\n"
