"""`--suite multiturn`: what the services have already seen (issue 37), with the real pair.

Workloads, all chat requests through the coordinator, greedy:
- edits: code conversations of three turns, each turn asking to change the previous answer
  (the whole conversation is re-sent every turn, as chat clients do);
- agent: one task repeated on new inputs (a fixed system prompt of instructions, a new record
  each time), as an agent loop runs it;
- demo: `make run`'s three prompts.

Stacks, all up at once on this machine (each service calibrates alone at start-up), every
request sent to each stack in turn so that the machine's drift falls on all alike:
- hybrid: `--drafter hybrid`, no prefix cache (today's `make run`). Each request runs twice,
  with K = 0 (target-only) and with the coordinator's defaults.
- suffix: `--drafter suffix`, no prefix cache: the drafter's own effect.
- hybrid+prefix: the hybrid with `--prefix-cache-bytes` on both services: time to first token
  against hybrid's, outputs compared.
- suffix+prefix: `--drafter suffix` with both prefix caches.

A conversation's next turn holds the previous answer the hybrid stack's default run gave, so
every stack sees the same prompts; each stack's outputs are compared with that one. Each stack
keeps its own caches, so what one stack learned never reaches another.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from scipy import stats

from bench.demo_prompts import QUESTIONS, SYSTEM
from bench.modes import model_infos, pair_stack
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

PREFIX_CACHE = ["--prefix-cache-bytes", "2GiB"]
DEMO_REPEATS = 6  # runs of `make run`'s prompts: one 69-token answer takes about a second, where runs vary by 10%
STACKS = {  # name: (draft service flags, target service flags)
    "hybrid": (["--drafter", "hybrid"], []),
    "suffix": (["--drafter", "suffix"], []),
    "hybrid+prefix": (["--drafter", "hybrid", *PREFIX_CACHE], PREFIX_CACHE),
    "suffix+prefix": (["--drafter", "suffix", *PREFIX_CACHE], PREFIX_CACHE),
}

MODULES = [
    """import json


def load(path):
    with open(path) as f:
        data = json.load(f)
    return data


def total_price(data):
    total = 0
    for item in data:
        total += item["price"] * item["quantity"]
    return total


def cheapest(data):
    best = None
    for item in data:
        if best is None or item["price"] < best["price"]:
            best = item
    return best


def save(data, path):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
""",
    """import re
from collections import Counter


def words(text):
    return re.findall(r"[a-z']+", text.lower())


def top_words(text, n):
    counts = Counter(words(text))
    return counts.most_common(n)


def average_length(text):
    found = words(text)
    if not found:
        return 0
    return sum(len(w) for w in found) / len(found)


def longest_line(text):
    lines = text.splitlines()
    return max(lines, key=len) if lines else ""
""",
    """class Account:
    def __init__(self, owner, balance):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        self.balance += amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        self.history.append(("withdraw", amount))

    def statement(self):
        return [f"{kind}: {amount}" for kind, amount in self.history]
""",
]
EDITS = [
    "Add type hints to every function in this module. Reply with the whole module only.\n\n```python\n{code}```",
    "Now add a one-line docstring to each function. Reply with the whole module only.",
    "Now rename the variable `data` (or `text`, or `amount`) to something clearer everywhere. Reply with the "
    "whole module only.",
]
AGENT_SYSTEM = (
    "You are a data-cleaning agent in a pipeline. For each customer record you receive, reply with one JSON "
    'object and nothing else. The object has exactly these keys, in this order: "name" (the full name with '
    'each part capitalised), "email" (lower case, or null when missing or malformed), "phone" (digits only, '
    'with the country code 44 when the number is British, or null), "city" (capitalised), "country" (an '
    'ISO 3166 alpha-2 code), "vip" (true when the record mentions more than 10 orders, else false) and '
    '"notes" (a short English summary of anything else in the record, or an empty string). Do not explain.'
)
RECORDS = [
    "name: jane  DOE; mail: Jane.Doe@Example.com; tel 07700 900123; lives in leeds, uk; 14 orders so far",
    "JOHN smith, john.smith@@mail; phone +1 (212) 555-0143; new york usa; 2 orders; prefers email contact",
    "name=maria garcia lopez | email=MGARCIA@correo.es | city=sevilla | country=spain | orders=31",
    "Ahmed Khan — ahmed.khan@example.co.uk — 020 7946 0321 — London, United Kingdom — asked for a refund",
    "li wei; no email; mobile 138 0013 8000; shanghai china; 11 orders; wants invoices in English",
    "Sophie Martin, sophie.martin@exemple.fr, Lyon France, 0 orders, signed up at the Paris fair",
]


def chat(*turns: tuple[str, str], system: str = SYSTEM) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role="system", content=system)] + [
        pb.ChatMessage(role=role, content=content) for role, content in turns
    ]


def generate(stub, messages: list[pb.ChatMessage], k: int | None, max_new_tokens: int, cache_salt: str = "") -> dict:
    started = time.perf_counter()
    response = stub.Generate(
        pb.GenerateRequest(
            messages=messages, max_new_tokens=max_new_tokens, num_speculative_tokens=k, cache_salt=cache_salt
        ),
        timeout=600,
    )
    s = response.stats
    return {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "tokens": s.generated_tokens,
        "ttft_ms": s.time_to_first_token_ms,
        "total_ms": s.total_ms,
        "wall_ms": (time.perf_counter() - started) * 1e3,
        "copied_rounds": s.copied_rounds,
        "rounds": s.rounds,
        "prompt_tokens": s.prompt_tokens,
    }


def open_stack(name: str, config, logs: Path, stack: ExitStack) -> tuple[coordinator_pb2_grpc.CoordinatorStub, dict]:
    """One stack's three services, up until `stack` closes: a warmed-up stub to its coordinator,
    and the services by role."""
    draft_extra, target_extra = STACKS[name]
    services = stack.enter_context(pair_stack(config, logs / name, draft_args=draft_extra, target_args=target_extra))
    channel = stack.enter_context(grpc.insecure_channel(services["coordinator"].address))
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    generate(stub, chat(("user", "Say hi.")), None, 4)  # warm-up
    return stub, services


def pass_costs(services: dict, field: str) -> dict[str, list[float]]:
    """The draft's and target's pass costs by new tokens, as their Info reports them: `field`
    is `calibrated_pass_ms` (start-up) or `live_pass_ms` (each size's recent one-session
    passes, specdec.engine.costs.PassCosts.live_ms)."""
    infos = model_infos(services["draft"], services["target"])
    return {role: list(getattr(info, field)) for role, info in infos.items()}


def run_multiturn(config, machine: dict) -> dict:
    """Every stack up at once (each started and calibrated alone), and every request sent to
    each in turn, so the machine's drift falls on all stacks alike: the hybrid stack's K = 0
    first, then each stack's defaults in an order that rotates from request to request (the
    hybrid's answer builds the next turn). `make run`'s prompts run DEMO_REPEATS times, each
    time in a cache namespace of its own (cache_salt), as a fresh `make run` would find the
    caches."""
    logs = config.out_dir / "logs"
    samples: list[dict] = []
    with ExitStack() as stack:
        opened = {name: open_stack(name, config, logs, stack) for name in STACKS}
        stubs = {name: stub for name, (stub, _) in opened.items()}
        calibrated = {name: pass_costs(services, "calibrated_pass_ms") for name, (_, services) in opened.items()}
        names = list(STACKS)
        sent = 0

        def run(workload: str, index: int, turn: int, messages: list[pb.ChatMessage], salt: str = "") -> dict:
            nonlocal sent
            shift = sent % len(names)
            order = [("hybrid", 0)] + [(name, None) for name in names[shift:] + names[:shift]]
            sent += 1
            result = {}
            for name, k in order:
                sample = generate(stubs[name], messages, k, config.max_new_tokens, salt)
                sample.update(stack=name, workload=workload, index=index, turn=turn, k=k)
                samples.append(sample)
                result[(name, k)] = sample
                print(
                    f"{name} {workload}[{index}] turn {turn} K={'chosen' if k is None else k}: "
                    f"{sample['tokens']} tokens, ttft {sample['ttft_ms']:.0f} ms, "
                    f"{sample['tokens'] / sample['total_ms'] * 1e3:.1f} tok/s",
                    flush=True,
                )
            return result[("hybrid", None)]

        for index, code in enumerate(MODULES):
            turns: list[tuple[str, str]] = []
            for turn, edit in enumerate(EDITS):
                turns.append(("user", edit.format(code=code)))
                turns.append(("assistant", run("edits", index, turn, chat(*turns))["text"]))
        for index, record in enumerate(RECORDS):
            run("agent", index, 0, chat(("user", record), system=AGENT_SYSTEM))
        for repeat in range(DEMO_REPEATS):
            for index, question in enumerate(QUESTIONS):
                run("demo", index, repeat, chat(("user", question)), salt=f"demo-{repeat}")
        # What the passes cost by the end, beside what calibration said at the start: on this VM
        # a one-token pass moves between two costs over minutes (docs/benchmarks.md, multiturn).
        live = {name: pass_costs(services, "live_pass_ms") for name, (_, services) in opened.items()}
    return {
        "suite": "multiturn",
        "machine": machine,
        "max_new_tokens": config.max_new_tokens,
        "demo_repeats": DEMO_REPEATS,
        "calibrated_pass_ms": calibrated,
        "live_pass_ms": live,
        "samples": samples,
    }


def _rate(samples: list[dict]) -> float:
    return sum(s["tokens"] for s in samples) / sum(s["total_ms"] for s in samples) * 1e3


def summarise(results: dict) -> dict:
    samples = results["samples"]

    def pick(stack: str, workload: str, k=None, later: bool | None = None) -> list[dict]:
        return [
            s
            for s in samples
            if s["stack"] == stack
            and s["workload"] == workload
            and s["k"] == k
            and (later is None or (s["turn"] > 0) == later)
        ]

    reference = {(s["workload"], s["index"], s["turn"]): s["token_ids"] for s in pick_all(samples, "hybrid", None)}
    rows = {}
    for workload in ("edits", "agent", "demo"):
        base = pick("hybrid", workload, 0)
        row = {"target_only": _rate(base)}
        for stack in STACKS:
            chosen = pick(stack, workload)
            row[stack] = _rate(chosen)
            row[f"{stack} identical"] = sum(
                s["token_ids"] == reference[(s["workload"], s["index"], s["turn"])] for s in chosen
            )
            row[f"{stack} copied rounds"] = sum(s["copied_rounds"] for s in chosen)
            row["requests"] = len(chosen)
        rows[workload] = row
    ttft = {}
    for stack in STACKS:
        for later in (False, True):
            chosen = pick(stack, "edits", later=later)
            ttft[f"{stack} {'later' if later else 'first'}"] = statistics.mean(s["ttft_ms"] for s in chosen)
    ttft["target_only later"] = statistics.mean(s["ttft_ms"] for s in pick("hybrid", "edits", 0, later=True))
    demo = {
        stack: [_rate([s for s in pick(stack, "demo") if s["index"] == index]) for index in range(len(QUESTIONS))]
        for stack in STACKS
    }
    return {"rates": rows, "ttft": ttft, "demo": demo, "demo_paired": paired_ratios(pick, "demo")}


def paired_ratios(pick, workload: str) -> dict[str, list[tuple[float, float, float]]]:
    """Each stack's tok/s over the hybrid's, prompt by prompt: the geometric mean over repeats of
    the ratio of one repeat's two runs (sent one after the other, so the machine's drift between
    repeats falls out), with its 95% interval (Student's t on the log ratios). Runs of one prompt
    vary by up to 10% on this VM, so a plain ratio of sums over three repeats cannot tell a 5%
    difference from noise; the interval says whether one was measured."""
    hybrid = {(s["index"], s["turn"]): s for s in pick("hybrid", workload)}
    indices = sorted({s["index"] for s in hybrid.values()})
    found: dict[str, list[tuple[float, float, float]]] = {}
    for stack in STACKS:
        per_prompt = []
        for index in indices:
            logs = [
                math.log((s["tokens"] / s["total_ms"]) / (base["tokens"] / base["total_ms"]))
                for s in pick(stack, workload)
                if s["index"] == index and (base := hybrid.get((index, s["turn"])))
            ]
            per_prompt.append(geometric_interval(logs))
        found[stack] = per_prompt
    return found


def geometric_interval(logs: list[float]) -> tuple[float, float, float]:
    """The geometric mean of ratios given as their logs, and its 95% interval (Student's t)."""
    mean = statistics.mean(logs)
    half = (
        stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    )
    return (math.exp(mean), math.exp(mean - half), math.exp(mean + half))


def pick_all(samples: list[dict], stack: str, k) -> list[dict]:
    return [s for s in samples if s["stack"] == stack and s["k"] == k]


def markdown(results: dict) -> str:
    summary = results["summary"] = summarise(results)  # from the samples, never a stale copy
    machine = results["machine"]
    rates, ttft = summary["rates"], summary["ttft"]
    lines = [
        f"What the services have already seen (`--suite multiturn`), {machine['date']}: {machine['cpu']} "
        f"({machine['cpu_flags']}), {machine['cores']} cores, no GPU; torch {machine['torch']}. The Qwen2.5-Coder "
        f"pair (int8 draft; the target as set below), greedy chat requests of at most {results['max_new_tokens']} "
        "tokens, one at a time, each sent to every stack in turn.",
        "",
        *(["Target setting:", "", machine["target_setting"], ""] if machine.get("target_setting") else []),
        "**Time to first token, the edit conversations** (mean over requests; turns ≥ 2 re-send the whole "
        "conversation):",
        "",
        "| stack | turn 1 | turns 2-3 | turns 2-3 vs hybrid |",
        "|---|---|---|---|",
    ]
    for stack in STACKS:
        first, later = ttft[f"{stack} first"], ttft[f"{stack} later"]
        lines.append(f"| {stack} | {first:.0f} ms | {later:.0f} ms | {ttft['hybrid later'] / later:.2f}× |")
    others = list(STACKS)[1:]
    lines += [
        "",
        "**Tokens per second** (generated tokens over the requests' total time; each stack ÷ target-only and ÷ "
        "hybrid), outputs identical to the hybrid stack's, and rounds that copied:",
        "",
        "| workload | target-only | " + " | ".join(STACKS) + " | identical (" + ", ".join(others) + ") | "
        "copied rounds (" + ", ".join(STACKS) + ") |",
        "|---|---|" + "---|" * len(STACKS) + "---|---|",
    ]
    for workload, row in rates.items():
        cells = [f"{row['target_only']:.2f}"] + [
            f"{row[stack]:.2f} ({row[stack] / row['target_only']:.2f}×, {row[stack] / row['hybrid']:.2f}×)"
            for stack in STACKS
        ]
        identical = ", ".join(str(row[f"{stack} identical"]) for stack in others) + f" of {row['requests']}"
        copied = " / ".join(str(row[f"{stack} copied rounds"]) for stack in STACKS)
        lines.append(f"| {workload} | " + " | ".join(cells) + f" | {identical} | {copied} |")
    lines += [
        "",
        f"**`make run`'s three prompts**, tok/s each over its {results.get('demo_repeats', 1)} runs (each stack ÷ "
        "hybrid):",
        "",
        "| stack | " + " | ".join(f"prompt {i + 1}" for i in range(len(summary["demo"]["hybrid"]))) + " |",
        "|---|" + "---|" * len(summary["demo"]["hybrid"]),
    ]
    for stack, values in summary["demo"].items():
        lines.append(
            f"| {stack} | "
            + " | ".join(f"{v:.2f} ({v / hybrid:.2f}×)" for v, hybrid in zip(values, summary["demo"]["hybrid"]))
            + " |"
        )
    lines += [
        "",
        "The same, each stack ÷ hybrid repeat by repeat (geometric mean of the paired ratios, and its 95% interval):",
        "",
        "| stack | " + " | ".join(f"prompt {i + 1}" for i in range(len(summary["demo"]["hybrid"]))) + " |",
        "|---|" + "---|" * len(summary["demo"]["hybrid"]),
    ]
    for stack, ratios in summary["demo_paired"].items():
        if stack != "hybrid":
            lines.append(
                f"| {stack} | " + " | ".join(f"{mean:.2f}× ({lo:.2f}-{hi:.2f})" for mean, lo, hi in ratios) + " |"
            )
    for key, title in (
        (
            "calibrated_pass_ms",
            "**Pass costs each stack's services calibrated at start-up** (ms by new tokens; the K chooser's "
            "inputs for seeded sampled requests, and with `rule:live_costs=off`):",
        ),
        (
            "live_pass_ms",
            "**The same at the end of the run, from live one-session passes** (`Info.live_pass_ms`, the K "
            "chooser's inputs for greedy and unseeded requests: each size's last 32 passes served, at their "
            "contexts, settled by lower quartile once there are 8; a size with fewer, its calibrated figure "
            "scaled as the served sizes beside it moved):",
        ),
    ):
        if costs_by_stack := results.get(key):
            lines += ["", title, "", "| stack | target, 1 to 9 tokens | draft, 1 to 9 tokens |", "|---|---|---|"]
            for stack, costs in costs_by_stack.items():
                target, draft = (" ".join(f"{ms:.1f}" for ms in costs[role]) for role in ("target", "draft"))
                lines.append(f"| {stack} | {target} | {draft} |")
    return "\n".join(lines) + "\n"
