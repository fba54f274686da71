"""`--suite live-costs`: what the K chooser gains from live pass costs (`RoundRules.live_costs`) when the
costs a target calibrated no longer hold.

One draft and one target (the real pair, the hybrid drafter, as `make run` starts them) start
while, in the `disturbed` case, a neighbour process copies memory in a loop, as another tenant's
job would; it stops once both have calibrated. Two coordinators then serve over the same two
services: one costs greedy requests from the services' live pass costs (the default), one
from the calibrated ones (`rule:live_costs=off`, bench.rules_coordinator). `make run`'s three prompts go to
one, then the other, greedy, the order alternating from repeat to repeat, so both see the same
machine and the same services; each coordinator's turn starts once the other's sessions are
gone from its view (two pool refreshes), or it would cost its first request as sharing the
services. The `undisturbed` case does the same with nothing beside the services at start-up:
there the calibrated costs hold, and live costs should change nothing.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from contextlib import ExitStack

import grpc

from bench.demo_prompts import QUESTIONS
from bench.modes import model_infos, pair_stack
from bench.multiturn import STACKS, chat, generate, geometric_interval
from bench.rules_coordinator import coordinator_module
from specdec.tools.launch import spawn_coordinator
from specdec.v1 import coordinator_pb2_grpc

REPEATS = 6
CHOOSERS = {"live": [], "calibrated": ["rule:live_costs=off"]}  # bench.rules_coordinator
QUIET_S = 2 * 2.0 + 0.5  # two of the coordinators' pool refreshes (--pool-refresh 2 s), and a margin
# A neighbour copying 64 MiB in a loop: it takes one of the two cores and most of the memory
# bandwidth while the services calibrate.
NEIGHBOUR = "import numpy as np\na = np.ones(2**23)\nb = np.empty_like(a)\nwhile True:\n    np.copyto(b, a)"


def run_case(config, disturbed: bool, logs) -> dict:
    samples = []
    with ExitStack() as stack:
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if disturbed else None
        try:
            services = stack.enter_context(
                pair_stack(config, logs, draft_args=STACKS["hybrid"][0])  # its coordinator: live costs
            )
            calibrated = spawn_coordinator(
                services["draft"],
                services["target"],
                config.target_model,
                logs / "coordinator-calibrated.log",
                CHOOSERS["calibrated"],
                module=coordinator_module(CHOOSERS["calibrated"]),
            )
            stack.callback(calibrated.stop)
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        before = model_infos(services["draft"], services["target"])
        stubs = {}
        for name, service in (("live", services["coordinator"]), ("calibrated", calibrated)):
            stubs[name] = coordinator_pb2_grpc.CoordinatorStub(
                stack.enter_context(grpc.insecure_channel(service.address))
            )
            generate(stubs[name], chat(("user", "Say hi.")), None, 4)  # warm-up
        for repeat in range(REPEATS):
            for name in list(CHOOSERS) if repeat % 2 == 0 else list(reversed(CHOOSERS)):
                # Each coordinator counts the other's sessions as load until its pool refresh
                # sees them gone, and a request that starts under load never copies: wait that out.
                time.sleep(QUIET_S)
                for index, question in enumerate(QUESTIONS):
                    sample = generate(stubs[name], chat(("user", question)), None, config.max_new_tokens)
                    sample.update(chooser=name, index=index, repeat=repeat)
                    samples.append(sample)
                    print(
                        f"{'disturbed' if disturbed else 'undisturbed'} {name} prompt {index + 1} repeat {repeat + 1}: "
                        f"{sample['tokens'] / sample['total_ms'] * 1e3:.1f} tok/s, {sample['rounds']} rounds",
                        flush=True,
                    )
        after = model_infos(services["draft"], services["target"])
    costs = {
        role: {"calibrated": list(before[role].calibrated_pass_ms), "live": list(after[role].live_pass_ms)}
        for role in ("target", "draft")
    }
    return {"samples": samples, "costs": costs}


def run_live_costs(config, machine: dict) -> dict:
    cases = {}
    for case, disturbed in (("disturbed", True), ("undisturbed", False)):
        cases[case] = run_case(config, disturbed, config.out_dir / "logs" / case)
    # The summary is bench.__main__'s to add, as for a re-summarised run (`python -m bench report`).
    return {"suite": "live-costs", "machine": machine, "max_new_tokens": config.max_new_tokens, "cases": cases}


def summarise(results: dict) -> dict:
    """Per case and prompt: live ÷ calibrated tok/s repeat by repeat (geometric mean, 95%
    interval), each chooser's mean rounds, and whether every output was the same."""
    summary = {}
    for case, figures in results["cases"].items():
        rows = []
        for index in sorted({s["index"] for s in figures["samples"]}):
            runs = [s for s in figures["samples"] if s["index"] == index]
            by = {(s["chooser"], s["repeat"]): s for s in runs}
            repeats = sorted({s["repeat"] for s in runs})
            logs = [
                math.log(
                    (by["live", r]["tokens"] / by["live", r]["total_ms"])
                    / (by["calibrated", r]["tokens"] / by["calibrated", r]["total_ms"])
                )
                for r in repeats
            ]
            rows.append(
                {
                    "prompt": index + 1,
                    "ratio": geometric_interval(logs),
                    "rounds": {
                        name: sum(s["rounds"] for s in runs if s["chooser"] == name) / len(repeats) for name in CHOOSERS
                    },
                    "identical": len({tuple(s["token_ids"]) for s in runs}) == 1,
                }
            )
        summary[case] = rows
    return summary


def markdown(results: dict) -> str:
    machine = results["machine"]
    lines = [
        f"Live pass costs against calibrated ones (`--suite live-costs`), {machine['date']}: {machine['cpu']} "
        f"({machine['cpu_flags']}), {machine['cores']} cores, no GPU; torch {machine['torch']}. The Qwen2.5-Coder "
        f"pair, the hybrid drafter, `make run`'s prompts, greedy, {results['max_new_tokens']} tokens, "
        f"{REPEATS} repeats; two coordinators over the same two services.",
        "",
        "| case | prompt | live ÷ calibrated tok/s (95% interval) | rounds, live | rounds, calibrated | identical |",
        "|---|---|---|---|---|---|",
    ]
    for case, rows in results["summary"].items():
        for row in rows:
            mean, low, high = row["ratio"]
            lines.append(
                f"| {case} | {row['prompt']} | {mean:.2f}× ({low:.2f}-{high:.2f}) | {row['rounds']['live']:.1f} | "
                f"{row['rounds']['calibrated']:.1f} | {'yes' if row['identical'] else 'no'} |"
            )
    lines += ["", "Pass costs, ms by new tokens (1 to 9): calibrated at start-up, and live at the end:", ""]
    lines += ["| case | model | calibrated | live |", "|---|---|---|---|"]
    for case, figures in results["cases"].items():
        for role, costs in figures["costs"].items():
            shown = {kind: " ".join(f"{ms:.0f}" for ms in values) for kind, values in costs.items()}
            lines.append(f"| {case} | {role} | {shown['calibrated']} | {shown['live']} |")
    return "\n".join(lines) + "\n"
