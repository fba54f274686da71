"""Can one machine stand in for two nodes? `python -m bench.contention` pins the int8 target to
one core and the int8 draft to another (as `--suite nodes` does), times each model's passes
alone and then both at once, and prints how much each slows the other. Cores share memory
bandwidth (and, on a VM, maybe a physical core), and both models are memory-bound: where the
target slows down markedly beside the draft, overlapping them (pipelining, hedges) cannot pay
on this machine, whatever the pinning.

Target: a pass over 4 new tokens (K = 3), draft: one-token steps, both over a 128-token cached
context; medians over `--seconds` of back-to-back passes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from specdec.tools.real_models import DRAFT, TARGET

MODELS = Path(__file__).resolve().parents[1] / ".cache/models"


PHASES = ("target", "draft", "together")  # who times passes: each model alone, then both


def _worker(role: str, model: str, core: int, new_tokens: int, seconds: float, ready, go, results) -> None:
    os.sched_setaffinity(0, (core,))  # before torch starts its threads: they inherit it
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from specdec.engine.modeling import with_cache
    from specdec.engine.quantize import quantize_int8

    torch.set_num_threads(1)
    model_ = quantize_int8(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval())
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        past = DynamicCache(config=model_.config)  # filled in place by the prefill below
        model_(torch.randint(100, 1000, (1, 128), generator=generator), **with_cache(model_, past), use_cache=True)
        for phase in PHASES:
            ready.wait()  # both loaded, and the previous phase over
            go[phase].wait()
            if phase not in (role, "together"):
                continue  # idle while the other model is timed alone
            times = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                started = time.perf_counter()
                model_(
                    torch.randint(100, 1000, (1, new_tokens), generator=generator),
                    **with_cache(model_, past),
                    use_cache=True,
                )
                past.crop(-new_tokens)
                times.append((time.perf_counter() - started) * 1e3)
            results.put((role, phase, statistics.median(times)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target-core", type=int, default=1)
    parser.add_argument("--draft-core", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(3)
    go = {phase: context.Event() for phase in PHASES}
    results = context.Queue()
    workers = [
        context.Process(
            target=_worker,
            args=("target", str(MODELS / TARGET.name), args.target_core, 4, args.seconds, ready, go, results),
        ),
        context.Process(
            target=_worker,
            args=("draft", str(MODELS / DRAFT.name), args.draft_core, 1, args.seconds, ready, go, results),
        ),
    ]
    for worker in workers:
        worker.start()
    figures = {}
    for phase in PHASES:
        ready.wait()
        go[phase].set()
        for _ in range(2 if phase == "together" else 1):
            role, timed, median = results.get()
            figures[role, "alone" if timed != "together" else "together"] = median
    for worker in workers:
        worker.join()
    print(
        f"target on core {args.target_core} (4-token passes), draft on core {args.draft_core} (1-token steps), 1 "
        "thread each; ms, median"
    )
    for role in ("target", "draft"):
        alone, together = figures[role, "alone"], figures[role, "together"]
        print(f"  {role:6s} alone {alone:6.1f}   beside the other {together:6.1f}   ({together / alone:.2f}×)")


if __name__ == "__main__":
    main()
