"""The EAGLE head against the 0.5B draft, the hybrid drafter, prompt lookup and the target
alone (issue 68), on the bench's own prompts whose answers do not copy their prompt (code, chat,
prose), greedy and sampled:

    python -m bench.eagle --head DIR [--out bench/results/eagle] [--repeats 3] [--max-new-tokens 128]

Four stacks over the real pair's target, started side by side and used in turn: `make run`'s
(the hybrid drafter: prompt lookup, else the int8 0.5B draft), the int8 0.5B draft alone, prompt
lookup alone (`--drafter ngram`, no weights) and one whose draft service runs the head
(`--drafter eagle`). Per prompt, temperature and repeat, five generations in an order that
alternates from repeat to repeat: target-only (K = 0 through the first stack) and each drafter
with the coordinator's defaults (K chosen). Reports tok/s ratios (geometric means),
mean accepted length per drafted round, and the head's calibrated step against the target's
one-token pass. Figures are this machine's; `lscpu` flags go with them."""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from bench.modes import ROOT, model_infos
from specdec.tools.launch import local_stack
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

MODELS = ROOT / ".cache" / "models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct"
KINDS = ("code", "chat", "prose")  # the bench prompts whose answers do not copy their prompt
# Each stack's draft service flags; None: the head's.
SYSTEMS = {
    "hybrid": ["--quantize", "int8", "--drafter", "hybrid"],
    "model": ["--quantize", "int8"],
    "lookup": ["--drafter", "ngram"],
    "eagle": None,
}
# (label, stack, K): target-only runs through make run's stack at K = 0; None: the K chooser.
RUNS = [
    ("target-only", "hybrid", 0),
    ("hybrid", "hybrid", None),
    ("0.5B draft", "model", None),
    ("prompt lookup", "lookup", None),
    ("eagle head", "eagle", None),
]


def cpu_flags() -> str:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((row for row in flags.splitlines() if row.startswith("Flags")), "")
    keep = [flag for flag in line.split() if flag.startswith(("avx", "amx", "fma"))]
    return " ".join(keep)


def prompts() -> list[dict]:
    data = json.loads((ROOT / "bench" / "prompts.json").read_text())
    return [prompt for prompt in data["prompts"] if prompt["kind"] in KINDS]


def generate(stub, text: str, k: int | None, temperature: float, seed: int, max_new_tokens: int) -> dict:
    response = stub.Generate(
        pb.GenerateRequest(
            prompt=text,
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=k,
            temperature=temperature,
            seed=seed if temperature else None,
        ),
        timeout=900,
    )
    s = response.stats
    drafted = [k for k in s.k_per_round if k]
    return {
        "tokens": s.generated_tokens,
        "total_ms": s.total_ms,
        "rounds": s.rounds,
        "drafted_rounds": len(drafted),
        "proposed": s.proposed_tokens,
        "accepted": s.accepted_tokens,
        "token_ids": list(response.token_ids),
    }


def run(args) -> dict:
    samples = []
    with ExitStack() as stack:
        stubs, services = {}, {}
        for name, flags in SYSTEMS.items():
            draft_model = TARGET if flags is None else DRAFT
            draft_args = ["--quantize", "int8", "--drafter", "eagle", "--draft-head", str(args.head)]
            services[name] = stack.enter_context(
                local_stack(
                    draft_model,
                    TARGET,
                    args.out / "logs" / name,
                    draft_dtype="float32",
                    target_dtype="float32",
                    device="cpu",
                    threads=0,
                    draft_args=draft_args if flags is None else flags,
                    target_args=["--quantize", "int8"],
                    cwd=ROOT,
                )
            )
            channel = stack.enter_context(grpc.insecure_channel(services[name]["coordinator"].address))
            stubs[name] = coordinator_pb2_grpc.CoordinatorStub(channel)
            generate(stubs[name], "Say hi.", None, 0.0, 0, 4)  # warm-up
        infos = {name: model_infos(services[name]["draft"], services[name]["target"]) for name in SYSTEMS}
        for repeat in range(args.repeats):
            for temperature in args.temperatures:
                for index, prompt in enumerate(prompts()):
                    order = RUNS if repeat % 2 == 0 else list(reversed(RUNS))
                    for label, system, k in order:
                        sample = generate(
                            stubs[system], prompt["text"], k, temperature, 1000 * repeat + index, args.max_new_tokens
                        )
                        sample.update(run=label, kind=prompt["kind"], temperature=temperature, repeat=repeat)
                        samples.append(sample)
                        print(
                            f"{label:12s} {prompt['kind']:12s} T={temperature} repeat {repeat + 1}: "
                            f"{sample['tokens'] / sample['total_ms'] * 1e3:.2f} tok/s, accepted {sample['accepted']}"
                            f"/{sample['proposed']} in {sample['drafted_rounds']} drafted rounds",
                            flush=True,
                        )
    head_ms = list(infos["eagle"]["draft"].calibrated_pass_ms)
    target_ms = list(infos["eagle"]["target"].calibrated_pass_ms)
    return {
        "machine": {
            "date": time.strftime("%Y-%m-%d"),
            "cpu": platform.processor() or platform.machine(),
            "cpu_flags": cpu_flags(),
            "cores": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
        },
        "head": str(args.head),
        "max_new_tokens": args.max_new_tokens,
        "head_step_ms": head_ms[:1],
        "target_pass_ms": target_ms[:1],
        "samples": samples,
    }


def summarise(results: dict) -> dict:
    """Per kind and temperature: each drafter's tok/s over target-only's (geometric mean over
    the repeats), the head's over the 0.5B draft's and over the hybrid's (`make run`'s
    defaults, issue 68's comparison), and each drafter's mean accepted tokens per drafted round."""
    out = {}
    samples = results["samples"]
    for kind in KINDS:
        for temperature in sorted({s["temperature"] for s in samples}):
            rows = [s for s in samples if s["kind"] == kind and s["temperature"] == temperature]
            if not rows:
                continue
            ran = [label for label, *_ in RUNS[1:] if any(s["run"] == label for s in rows)]
            row: dict[str, float | bool] = {
                f"{label} / target-only": _ratio(rows, label, "target-only") for label in ran
            }
            for base in ("0.5B draft", "hybrid"):
                if base in ran and "eagle head" in ran:
                    row[f"head / {base}"] = _ratio(rows, "eagle head", base)
            row.update({f"accepted per drafted round, {label}": _accepted(rows, label) for label in ran})
            row["greedy identical"] = temperature == 0 and len({tuple(s["token_ids"]) for s in rows}) == 1
            out[f"{kind} T={temperature}"] = row
    return out


def _ratio(rows: list[dict], a: str, b: str) -> float:
    """a's tok/s over b's, the geometric mean over the repeats."""
    by = {(s["run"], s["repeat"]): s["tokens"] / s["total_ms"] for s in rows}
    repeats = sorted({s["repeat"] for s in rows})
    return round(math.exp(sum(math.log(by[a, r] / by[b, r]) for r in repeats) / len(repeats)), 3)


def _accepted(rows: list[dict], run: str) -> float:
    mine = [s for s in rows if s["run"] == run]
    return round(sum(s["accepted"] for s in mine) / max(1, sum(s["drafted_rounds"] for s in mine)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eagle")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    results["summary"] = summarise(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(
        json.dumps(
            {
                "head_step_ms": results["head_step_ms"],
                "target_pass_ms": results["target_pass_ms"],
                **results["summary"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
