"""`--suite overhead`: what the framework costs per round, outside the models.

A tiny random model with Qwen's 151,936-id vocabulary (built at run time with transformers'
own classes, saved and loaded back through the services' real --model path, the pair's real
tokenizer beside it) serves as both draft and target, so model compute is small and every
draft is accepted: what remains of a round's wall time after the compute the services report
is RPCs, serialisation, queueing and the coordinator's own work. For greedy and sampled
decoding at K = 0 and K = 4 it prints p50 and p90 of that overhead per round and per RPC
(K = 0 makes one call per round, K = 4 two), from every round but each request's first
(which carries the prompt).

It also times the floor under those figures: a bare gRPC round trip (the standard health
Check, no model and no handler work) from a grpc.aio client, the kind the coordinator uses, to
the target service on the same loopback. A round with K > 0 makes two model-service calls, so
it cannot cost less than twice that.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from specdec.launch import free_port, spawn, spawn_coordinator
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
QWEN_VOCAB = 151_936
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


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


async def bare_rpc_ms(address: str, calls: int = 300) -> list[float]:
    """Wall time of `calls` health checks in a row (after 20 to warm up), in ms."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        times = []
        for i in range(calls + 20):
            started = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            if i >= 20:
                times.append((time.perf_counter() - started) * 1e3)
    return times


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
        floor = asyncio.run(bare_rpc_ms(services["target"].address))
        for repeat in range(config.repeats):
            for index, prompt in enumerate(prompts):
                for decoding, temperature, k in CELLS:
                    response = stub.Generate(
                        pb.GenerateRequest(
                            prompt=prompt["text"],
                            max_new_tokens=config.max_new_tokens,
                            temperature=temperature,
                            seed=config.seed + 1000 * repeat + index,
                            num_speculative_tokens=k,
                        ),
                        timeout=600,
                    )
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
                        }
                    )
    return {
        "suite": "overhead",
        "config": {"max_new_tokens": config.max_new_tokens, "repeats": config.repeats},
        "machine": machine,
        "samples": samples,
        "bare_rpc_ms": floor,
    }


def summarise(results: dict) -> list[dict]:
    rows = []
    for decoding, _, k in CELLS:
        overheads = [
            ms for s in results["samples"] if (s["decoding"], s["k"]) == (decoding, k) for ms in s["round_overhead_ms"]
        ]
        rounds = [ms for s in results["samples"] if (s["decoding"], s["k"]) == (decoding, k) for ms in s["round_ms"]]
        rpcs = 1 if k == 0 else 2
        rows.append(
            {
                "decoding": decoding,
                "k": k,
                "rounds": len(overheads),
                "round_ms_p50": percentile(rounds, 50),
                "overhead_ms_p50": percentile(overheads, 50),
                "overhead_ms_p90": percentile(overheads, 90),
                "per_rpc_ms_p50": percentile(overheads, 50) / rpcs,
                "per_rpc_ms_p90": percentile(overheads, 90) / rpcs,
            }
        )
    return rows


def markdown_table(rows: list[dict], machine: dict, bare_rpc_ms: list[float] | None = None) -> str:
    lines = [
        f"Machine: {machine['cpu']} ({machine.get('cpu_flags', '')}), {machine['cores']} cores; torch "
        f"{machine['torch']}; {machine['date']}",
        "",
        "Framework overhead per round: round wall time minus the model compute the services report "
        f"(tiny {QWEN_VOCAB}-id model as draft and target, 1 thread each, loopback):",
        "",
        "| decoding | K | rounds | round p50 ms | overhead p50 ms | overhead p90 ms | per RPC p50 ms | per RPC p90 ms "
        "|",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['decoding']} | {r['k']} | {r['rounds']} | {r['round_ms_p50']:.2f} | {r['overhead_ms_p50']:.2f} | "
            f"{r['overhead_ms_p90']:.2f} | {r['per_rpc_ms_p50']:.2f} | {r['per_rpc_ms_p90']:.2f} |"
        )
    if bare_rpc_ms:
        lines += [
            "",
            f"Floor: a bare gRPC round trip (health Check, grpc.aio client to the target service, loopback) takes "
            f"{percentile(bare_rpc_ms, 50):.2f} ms p50, {percentile(bare_rpc_ms, 90):.2f} ms p90 ({len(bare_rpc_ms)} "
            "calls).",
        ]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: Path) -> int:
    rows = summarise(results)
    results["summary"] = rows
    table = markdown_table(rows, results["machine"], results.get("bare_rpc_ms"))
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.md").write_text(table)
    print("\n" + table)
    print(f"results: {out_dir}/results.json, table.md")
    return 0
