"""Which target setting is fastest on this machine: float32, bfloat16 or int8, measured.

Whether bf16 or int8 pays depends on the CPU (AVX512-BF16 runs bf16 passes flat in the
number of tokens; an AVX2-only CPU runs them 3x dearer at 5 tokens, while its int8 GEMM stays
flat), so `make run` and the benchmark measure instead of assuming. Each setting is loaded as
the target service loads it and timed with the service's own start-up calibration
(specdec.engine.costs) over 1..K+1 new tokens; the score is the mean of a 1-token pass (a
target-only step) and a K+1-token pass (a verify), the two the K chooser trades between.
Ties within 5% go to the more precise setting.

    python -m target_service.pick --model FOLDER [--threads N] [--k 4]

prints the table and, last, one JSON line: {"dtype": ..., "quantize": ..., "reason": ..., "output": ...}
(what the setting makes of the output: only float32 is the checkpoint's own distribution).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import signal
import subprocess
import sys
from pathlib import Path

import torch

from specdec.engine.calibration import calibrate_costs
from specdec.engine.modeling import load_causal_lm
from specdec.engine.quantize import INT8_LABEL, int8_supported, quantize_int8
from target_service.runner import TargetRunner

# (label, dtype, quantize), most precise first: the tie-break order.
SETTINGS = (("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"), ("int8", "float32", "int8"))
# A setting's target service flags: --dtype and --quantize.
FLAGS = {label: (dtype, quantize) for label, dtype, quantize in SETTINGS}
TIE = 1.05
# What each setting makes of the output: the target's numerics are the output's distribution.
OUTPUT = {
    "float32": "the output is the checkpoint's own distribution (greedy: token-identical to its own decoding)",
    "bfloat16": "the output is the bfloat16 model's distribution, not the float32 checkpoint's; greedy output can "
    "drift from the checkpoint's own (a K+1-token pass rounds differently from a 1-token one)",
    "int8": "the output is the int8 target's distribution, not the float32 checkpoint's: its perplexity is within "
    "0.32% of float32's on the 1.5B target (docs/design.md, An int8 target); --target-setting float32 gives the "
    "checkpoint's own",
}


def pick_in_subprocess(model: str | Path, threads: int, cwd=None) -> dict:
    """Runs this module in a process of its own (the three loads' memory is freed after) and
    returns its choice, with its printed table under "table"."""
    command = [sys.executable, "-m", "target_service.pick", "--model", str(model), "--threads", str(threads)]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        code = result.returncode
        how = f"was killed by {signal.Signals(-code).name} (out of memory?)" if code < 0 else f"exited with {code}"
        raise RuntimeError(f"python -m target_service.pick {how}: {result.stderr.strip()[-1000:] or 'no output'}")
    return {**json.loads(lines[-1]), "table": "\n".join(lines[:-1])}


def measure(model: str, dtype: str, quantize: str, k: int) -> tuple[float, ...]:
    loaded = load_causal_lm(model, dtype, "cpu")
    if quantize == "int8":
        quantize_int8(loaded.model)
        loaded = dataclasses.replace(loaded, quantization=INT8_LABEL)
    runner = TargetRunner(loaded, max_sessions=1, session_ttl_s=60.0, max_speculative_tokens=k)
    costs = calibrate_costs(runner, keep_all_logits=True).calibrated_ms
    del runner, loaded
    gc.collect()
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_service.pick", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--k", type=int, default=4, help="the verify size scored is K + 1 tokens")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for label, dtype, quantize in SETTINGS:
        if quantize == "int8" and not int8_supported():
            continue
        costs = measure(args.model, dtype, quantize, args.k)
        rows.append((label, dtype, quantize, costs, (costs[0] + costs[-1]) / 2))
    print(
        f"target pass cost, ms, by new tokens (threads {torch.get_num_threads()}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}):"
    )
    print("| setting | " + " | ".join(str(n) for n in range(1, args.k + 2)) + " | score |")
    print("|---|" + "---|" * (args.k + 2))
    for label, _, _, costs, score in rows:
        print(f"| {label} | " + " | ".join(f"{ms:.0f}" for ms in costs) + f" | {score:.0f} |")
    fastest = min(score for *_, score in rows)
    label, dtype, quantize, costs, score = next(row for row in rows if row[-1] <= TIE * fastest)
    others = ", ".join(f"{row[0]} {row[-1]:.0f} ms" for row in rows if row[0] != label)
    reason = f"{label} scores {score:.0f} ms (mean of a 1-token and a {args.k + 1}-token pass) against {others}" + (
        "; within 5% of the fastest, the more precise wins" if score > fastest else ""
    )
    print(
        json.dumps({"dtype": dtype, "quantize": quantize, "setting": label, "reason": reason, "output": OUTPUT[label]})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
