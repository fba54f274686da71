"""`--suite overhead`: what the framework costs per round, outside the models.

A tiny random model with Qwen's 151,936-id vocabulary (built at run time with transformers'
own classes, saved and loaded back through the services' real --model path, the pair's real
tokenizer beside it) serves as both draft and target, so model compute is small and every
draft is accepted: what remains of a round's wall time after the compute the services report
is RPCs, serialisation, queueing and the coordinator's own work. For greedy and sampled
decoding at K = 0 and K = 4 it prints p50 and p90 of that overhead per round and per call,
from every round but each request's first (which carries the prompt). A K = 4 round makes two
calls; a K = 0 call steps up to four rounds (the coordinator's target_only_steps), and the
stats share its time evenly among them, so its rounds are told apart by their equal figures.

It also times the floor under those figures from a grpc.aio client, the kind the coordinator
uses (FLOORS): a bare unary call, a message on an open call stream answered from the model
thread without model work, and the same after 10 ms idle. A round with K > 0 makes two calls
in a row, each to a service that sat idle while the other worked, so it cannot cost less than
twice the last. Beside them, the same message and answer without gRPC (`serve_framed`): 4-byte
length frames on an asyncio TCP connection to a process that parses the message and answers it
from a worker thread, as the service's model thread does, without the servicer's own code:
what a leaner transport would cost on the same machine (docs/design.md, "Framework overhead").

And the CPU each process spends per round outside the model passes (`thread_cpu_ms`: every
thread's run time from /proc, the event loop's apart from the rest, less the compute the
services report): the part of the overhead that is work, whatever the wall time adds by
waiting for threads and idle vCPUs to wake.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specdec.rpc.ports import free_port
from specdec.tools.launch import ServiceProcess, spawn, spawn_coordinator
from specdec.v1 import common_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
QWEN_VOCAB = 151_936
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
CELLS = [("greedy", 0.0, 0), ("greedy", 0.0, 4), ("sampled", 0.7, 0), ("sampled", 0.7, 4)]


def build_tiny_model(folder: Path, tokenizer_source: Path) -> Path:
    """A 1-layer Qwen2 with the full vocabulary: the output head is as wide as the real one."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=QWEN_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)
    return folder


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile; None for no values (every request one round: no round after the first)."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


FLOORS = {
    "unary": "a bare unary call (health Check, no handler work)",
    "stream": "a message on an open ProposeStream that the service refuses on its model thread (unknown session)",
    "stream_idle": "the same message after 10 ms idle, as a round's call finds a service that waited for the other",
    "framed": "the same message without gRPC: length-framed on asyncio TCP, answered from a worker thread "
    "(serve_framed, no servicer code)",
    "framed_idle": "that after 10 ms idle",
}
FRAME = struct.Struct("<I")  # serve_framed: each message's length, then the message


def serve_framed(port: int) -> None:
    """The floor of a transport without gRPC's layers (FLOORS' framed lines): reads
    length-framed ProposeRequests on asyncio TCP, hands each to a worker thread (the hop to a
    service's model thread), which refuses it as the draft service refuses an unknown
    session, and writes back the framed BranchResult. Runs until killed."""
    worker = ThreadPoolExecutor(max_workers=1)

    def refuse(payload: bytes) -> bytes:
        request = draft_pb2.ProposeRequest.FromString(payload)
        return draft_pb2.BranchResult(
            error_code=grpc.StatusCode.NOT_FOUND.value[0], error_message=f"unknown session {request.session_id}"
        ).SerializeToString()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                (length,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                reply = await loop.run_in_executor(worker, refuse, await reader.readexactly(length))
                writer.write(FRAME.pack(len(reply)) + reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(serve())


def spawn_framed(port: int, log: Path) -> ServiceProcess:
    """`serve_framed` in a process of its own (one torch-free thread plus its worker), once it accepts."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"from bench.overhead import serve_framed; serve_framed({port})"],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    framed = ServiceProcess("the framed floor's server", f"127.0.0.1:{port}", process, log)
    try:
        framed.wait_listening(60)
    except BaseException:
        process.kill()
        raise
    return framed


async def floor_ms(
    address: str, framed_port: int, calls: int = 300, server_pids: dict[str, int] | None = None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The transport under the figures, in ms per call (after 20 to warm up): see FLOORS.
    `framed_port`: where serve_framed listens. Also the CPU of each line per call, ms: [this
    client process, the server] where `server_pids` names the servers' processes ("grpc": the
    draft service, "framed": serve_framed's), else [client] alone."""
    ghost = draft_pb2.ProposeRequest(
        session_id="overhead-floor", keep_tokens=1, new_tokens=[1], num_tokens=1, sampling=GREEDY
    )
    frame = FRAME.pack(ghost.ByteSize()) + ghost.SerializeToString()
    floors: dict[str, list[float]] = {name: [] for name in FLOORS}
    cpu: dict[str, list[float]] = {}
    reader, writer = await asyncio.open_connection("127.0.0.1", framed_port)
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stream = draft_pb2_grpc.DraftStub(channel).ProposeStream()
        for name in FLOORS:
            server = (server_pids or {}).get("framed" if name.startswith("framed") else "grpc")
            for i in range(calls + 20):
                if i == 20:
                    client_before = time.process_time()
                    server_before = sum(thread_cpu_ms(server).values()) if server else 0.0
                if name.endswith("_idle"):
                    await asyncio.sleep(0.01)
                started = time.perf_counter()
                if name == "unary":
                    await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                    reply = None
                elif name.startswith("framed"):
                    writer.write(frame)
                    (length,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                    reply = draft_pb2.BranchResult.FromString(await reader.readexactly(length))
                else:
                    await stream.write(ghost)
                    reply = await stream.read()
                assert reply is None or reply.error_code == grpc.StatusCode.NOT_FOUND.value[0], reply
                if i >= 20:
                    floors[name].append((time.perf_counter() - started) * 1e3)
            cpu[name] = [(time.process_time() - client_before) * 1e3 / calls]
            if server:
                cpu[name].append((sum(thread_cpu_ms(server).values()) - server_before) / calls)
        stream.cancel()
    writer.close()
    return floors, cpu


PROCESSES = ("coordinator", "draft", "target")


THREAD_KINDS = ("loop", "other", "model")


def thread_cpu_ms(pid: int) -> dict[str, float]:
    """CPU time a process has run so far, ms, by thread: "loop" its main thread (the event
    loop), "model" a model service's model thread and the torch threads it started (their OS
    name ends in "-model": specdec.rpc.model_thread.name_os_thread), "other" every other live
    thread (gRPC's, executors'). From each thread's /proc schedstat (nanoseconds); threads that
    have exited are not counted."""
    spent = dict.fromkeys(THREAD_KINDS, 0.0)
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ms = int(f.read().split()[0]) / 1e6
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited meanwhile
        spent["loop" if int(task) == pid else "model" if name.endswith("-model") else "other"] += ms
    return spent


def run_overhead(config, prompts: list[dict], machine: dict) -> dict:
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(ROOT / ".cache/bench-overhead/tiny-qwen-vocab", config.target_model)  # not committed
    logs = out / "logs"
    service_args = [
        "--model",
        str(model),
        "--calibrate",
        "off",
        "--quantize",
        "none",
        "--threads",
        "1",
        "--max-speculative-tokens",
        "8",
    ]
    env = {"OMP_NUM_THREADS": "1"}
    samples = []
    with ExitStack() as stack:
        services = {}
        for role in ("draft", "target"):
            services[role] = spawn(role, f"{role}_service", service_args, free_port(), logs / f"{role}.log", env, ROOT)
            stack.callback(services[role].stop)
            services[role].wait_healthy(300)
        coordinator = spawn_coordinator(
            services["draft"], services["target"], model, logs / "coordinator.log", ["--metrics-port", "-1"], ROOT
        )
        stack.callback(coordinator.stop)
        channel = stack.enter_context(grpc.insecure_channel(coordinator.address))
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stub.Generate(pb.GenerateRequest(prompt="warm up", max_new_tokens=8, num_speculative_tokens=4), timeout=60)
        framed_port = free_port()
        framed = spawn_framed(framed_port, logs / "framed.log")
        stack.callback(framed.stop)
        pids = {"coordinator": coordinator.process.pid, **{role: services[role].process.pid for role in services}}
        server_pids = {"grpc": pids["draft"], "framed": framed.process.pid}
        floors, floor_cpu = asyncio.run(floor_ms(services["draft"].address, framed_port, server_pids=server_pids))
        for repeat in range(config.repeats):
            for index, prompt in enumerate(prompts):
                for decoding, temperature, k in CELLS:
                    before = {name: thread_cpu_ms(pid) for name, pid in pids.items()}
                    response = stub.Generate(
                        pb.GenerateRequest(
                            prompt=prompt["text"],
                            max_new_tokens=config.max_new_tokens,
                            temperature=temperature,
                            seed=config.seed + 1000 * repeat + index,
                            num_speculative_tokens=k,
                            # A random model is unsure of every token: with the draft's default
                            # confidence stop a K = 4 round would carry one draft.
                            draft_min_confidence=0.0,
                        ),
                        timeout=600,
                    )
                    after = {name: thread_cpu_ms(pid) for name, pid in pids.items()}
                    s = response.stats
                    samples.append(
                        {
                            "decoding": decoding,
                            "k": k,
                            "repeat": repeat,
                            "kind": prompt["kind"],
                            "round_ms": list(s.round_ms)[1:],
                            "round_overhead_ms": list(s.round_overhead_ms)[1:],
                            "k_per_round": list(s.k_per_round)[1:],
                            # The whole request, its first round included: CPU and compute alike.
                            "rounds_total": len(s.round_ms),
                            "cpu_ms": {
                                name: {kind: after[name][kind] - before[name][kind] for kind in THREAD_KINDS}
                                for name in PROCESSES
                            },
                            "compute_ms": {"draft": s.draft_compute_ms, "target": s.target_compute_ms},
                        }
                    )
    return {
        "suite": "overhead",
        "config": {"max_new_tokens": config.max_new_tokens, "repeats": config.repeats},
        "machine": machine,
        "samples": samples,
        "floor_ms": floors,
        "floor_cpu_ms": floor_cpu,
    }


def call_overheads(round_ms: list[float], overhead_ms: list[float]) -> list[float]:
    """Per call, the overhead of a K = 0 request's calls: a call's rounds follow each other
    with the same figures (its time shared evenly)."""
    calls: list[float] = []
    previous = None
    for whole, overhead in zip(round_ms, overhead_ms):
        if (whole, overhead) == previous:
            calls[-1] += overhead
        else:
            calls.append(overhead)
        previous = (whole, overhead)
    return calls


def summarise(results: dict) -> list[dict]:
    rows = []
    for decoding, _, k in CELLS:
        overheads = [
            ms for s in results["samples"] if (s["decoding"], s["k"]) == (decoding, k) for ms in s["round_overhead_ms"]
        ]
        rounds = [ms for s in results["samples"] if (s["decoding"], s["k"]) == (decoding, k) for ms in s["round_ms"]]
        drafts = [d for s in results["samples"] if (s["decoding"], s["k"]) == (decoding, k) for d in s["k_per_round"]]
        if k == 0:  # one call, several rounds: the call's overhead is its rounds' together
            calls = [
                call
                for s in results["samples"]
                if (s["decoding"], s["k"]) == (decoding, k)
                for call in call_overheads(s["round_ms"], s["round_overhead_ms"])
            ]
        else:  # one round, two calls
            calls = [ms / 2 for ms in overheads]
        rows.append(
            {
                "decoding": decoding,
                "k": k,
                "rounds": len(overheads),
                "drafts_per_round": statistics.fmean(drafts) if drafts else 0.0,
                "round_ms_p50": percentile(rounds, 50),
                "overhead_ms_p50": percentile(overheads, 50),
                "overhead_ms_p90": percentile(overheads, 90),
                "per_rpc_ms_p50": percentile(calls, 50),
                "per_rpc_ms_p90": percentile(calls, 90),
                **cpu_per_round([s for s in results["samples"] if (s["decoding"], s["k"]) == (decoding, k)]),
            }
        )
    return rows


def cpu_per_round(samples: list[dict]) -> dict:
    """Per round of these requests, the CPU each process spent outside the model passes, ms:
    {"cpu_ms_per_round": {process: {"loop", "other", "model"}}, "cpu_total_ms_per_round"}.
    "model" is the model thread's CPU less the compute the service reports (the passes' wall
    time, which also counts time the thread waited for a core, so on a busy host it can come
    out below 0); the total is the event loops' and the other threads' alone. Empty for
    samples without CPU figures (runs before they were taken)."""
    if not samples or any("cpu_ms" not in s for s in samples):
        return {}
    rounds = sum(s["rounds_total"] for s in samples)
    per_round = {
        name: {
            kind: sum(
                s["cpu_ms"][name][kind] - (s["compute_ms"].get(name, 0.0) if kind == "model" else 0.0) for s in samples
            )
            / rounds
            for kind in THREAD_KINDS
        }
        for name in PROCESSES
    }
    return {
        "cpu_ms_per_round": per_round,
        "cpu_total_ms_per_round": sum(parts["loop"] + parts["other"] for parts in per_round.values()),
    }


def markdown_table(
    rows: list[dict],
    machine: dict,
    floors: dict[str, list[float]] | None = None,
    floor_cpu: dict[str, list[float]] | None = None,
) -> str:
    """`floor_cpu`: per floor line, [client, server] CPU per call in ms (floor_ms)."""
    lines = [
        f"Machine: {machine['cpu']} ({machine.get('cpu_flags', '')}), {machine['cores']} cores; torch "
        f"{machine['torch']}; {machine['date']}",
        "",
        "Framework overhead per round: round wall time minus the model compute the services report "
        f"(tiny {QWEN_VOCAB}-id model as draft and target, 1 thread each, loopback):",
        "",
        "| decoding | K | drafts/round | rounds | round p50 ms | overhead p50 ms | overhead p90 ms | per call p50 ms "
        "| per call p90 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['decoding']} | {r['k']} | {r.get('drafts_per_round', 0):.1f} | {r['rounds']} | "
            + " | ".join(
                "—" if r[name] is None else f"{r[name]:.2f}"
                for name in ("round_ms_p50", "overhead_ms_p50", "overhead_ms_p90", "per_rpc_ms_p50", "per_rpc_ms_p90")
            )
            + " |"
        )
    if any("cpu_ms_per_round" in r for r in rows):
        lines += [
            "",
            "CPU per round outside the model passes, ms, each thread's run time from /proc: loop, the event loop's "
            "thread; other, gRPC's and the rest; model, a service's model thread less the passes' reported time "
            "(which counts waits for a core, so a busy host can take it below 0). Total: the loops and others.",
            "",
            "| decoding | K | coordinator loop | coordinator other | draft loop | draft other | draft model | "
            "target loop | target other | target model | total |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "cpu_ms_per_round" in r:
                spent = r["cpu_ms_per_round"]
                parts = [spent["coordinator"]["loop"], spent["coordinator"]["other"]]
                parts += [spent[role][kind] for role in ("draft", "target") for kind in ("loop", "other", "model")]
                cells = " | ".join(f"{ms:.2f}" for ms in parts)
                lines.append(f"| {r['decoding']} | {r['k']} | {cells} | {r['cpu_total_ms_per_round']:.2f} |")
    if floors:
        lines += [
            "",
            "Floor: what the transport alone costs per call on the same loopback (the draft service; the framed "
            "lines a process of their own):",
            "",
        ]
        for name, times in floors.items():
            cpu = (floor_cpu or {}).get(name) or []
            spent = [f"client {cpu[0]:.2f} ms"] + [f"server {ms:.2f} ms" for ms in cpu[1:]] if cpu else []
            lines.append(
                f"- {FLOORS.get(name, name)}: {percentile(times, 50):.2f} ms p50, {percentile(times, 90):.2f} ms p90 "
                f"({len(times)} calls{'; CPU a call: ' + ', '.join(spent) if spent else ''})"
            )
    return "\n".join(lines) + "\n"
