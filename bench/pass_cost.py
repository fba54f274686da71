"""What one batched forward pass costs against one session's: the ceiling on what batching
can give on this machine. `python -m bench.pass_cost [--threads N]` loads the real pair as the
services do and times `forward_batch` over B sessions (B = 1, 2, 4, 8) that each hold a
100-token past: the target scoring K + 1 = 4 tokens per session, the draft one token per
session (one draft step). Median of 5 passes after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec.tools.real_models import DRAFT, TARGET

MODELS = Path(__file__).resolve().parents[1] / ".cache/models"


def time_passes(runner, batch: int, new_tokens: int, repeats: int = 5) -> float:
    """Median ms of one pass over `batch` sessions appending `new_tokens` each."""
    vocab = runner.loaded.vocab_size
    sessions = []
    for index in range(batch):
        session = runner.sessions.open(f"s{index}", 0)
        past = torch.randint(100, vocab - 100, (100,), generator=torch.Generator().manual_seed(index)).tolist()
        runner.forward(session, session.extend(0, past), logits_to_keep=1)
        sessions.append(session)
    times = []
    for repeat in range(repeats + 1):
        feeds = [session.extend(100, list(range(1000 + repeat, 1000 + repeat + new_tokens))) for session in sessions]
        start = time.perf_counter()
        runner.forward_batch(sessions, feeds, [new_tokens] * batch)
        if repeat:  # the first pass warms up
            times.append((time.perf_counter() - start) * 1e3)
    for index in range(batch):
        runner.end_session(f"s{index}")
    return statistics.median(times)


def main() -> None:
    from draft_service.config import parse_config as draft_config
    from draft_service.server import load_runner as load_draft
    from target_service.config import parse_config as target_config
    from target_service.server import load_runner as load_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    threads = ["--threads", str(args.threads)] if args.threads else []
    runners = {
        "target (bf16, 4 tokens per session)": (
            load_target(target_config(["--model", str(MODELS / TARGET.name), "--dtype", "bfloat16", *threads])),
            4,
        ),
        "draft (int8, 1 token per session)": (
            load_draft(draft_config(["--model", str(MODELS / DRAFT.name), *threads])),
            1,
        ),
    }
    print("| model | B=1 ms | B=2 | B=4 | B=8 | B=8 pass / B=1 pass |")
    print("|---|---|---|---|---|---|")
    for name, (runner, new_tokens) in runners.items():
        ms = {batch: time_passes(runner, batch, new_tokens) for batch in (1, 2, 4, 8)}
        cells = " | ".join(f"{ms[b]:.0f}" for b in (1, 2, 4, 8))
        print(f"| {name} | {cells} | {ms[8] / ms[1]:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
