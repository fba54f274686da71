"""Where a forward pass's time goes on a device: is it the device's work, or the host's launching
of it? For a model folder (random weights of its shape when it has none, as bench.gpu_check):

- the target runner's pass after 128 cached tokens, by new tokens, keeping every row's logits
  and keeping one (min / median ms of `--repeats`);
- the bare transformers model on a DynamicCache, with SDPA and with eager attention;
- torch.profiler tables of a one- and a two-token bare pass: host time, device time, op calls
  and kernel launches.

    python -m bench.pass_anatomy --device cuda --dtype bfloat16 --model .gpu/models/target

It prints; bench/results/gpu-h200/ holds what it printed on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from bench.gpu_check import synchronize, with_weights
from target_service.config import parse_config
from target_service.loading import load_runner

CONTEXT = 128


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", default="1,2,3,4,8,16,64", help="new tokens per timed pass")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    on_gpu = args.device.startswith("cuda")

    def timed(run, n: int) -> str:
        times = []
        for repeat in range(args.repeats + 2):  # two warm-ups
            synchronize(args.device)
            started = time.perf_counter()
            run(n)
            synchronize(args.device)
            if repeat >= 2:
                times.append((time.perf_counter() - started) * 1e3)
        return f"min/med ms {min(times):.2f} / {statistics.median(times):.2f}"

    checked = with_weights("target", args.model, args.dtype, Path(tempfile.mkdtemp()), 0)
    flags = ["--model", str(checked.folder), "--device", args.device, "--dtype", args.dtype]
    runner = load_runner(parse_config([*flags, "--calibrate", "off", "--max-speculative-tokens", "16"]))
    model, device = runner.model, runner.loaded.device
    print("attn", model.config._attn_implementation, "dtype", model.dtype, flush=True)
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.loaded.vocab_size, (CONTEXT + max(sizes),), generator=seeded).tolist()

    session = runner.sessions.open("anatomy", 0)
    runner.forward(session, session.extend(0, ids[:CONTEXT]), 1)

    def via_runner(n: int, keep: int | None = None) -> None:
        runner.forward(session, session.extend(CONTEXT, ids[CONTEXT : CONTEXT + n]), keep or n)

    for n in sizes:
        print(f"runner keep_all n={n}: {timed(via_runner, n)}", flush=True)
    for n in sizes[:4]:
        print(f"runner keep_1   n={n}: {timed(lambda k: via_runner(k, 1), n)}", flush=True)

    def bare(attention: str):
        model.set_attn_implementation(attention)
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids[:CONTEXT]], device=device), past_key_values=cache, logits_to_keep=1)

        def step(n: int) -> None:
            with torch.inference_mode():
                model(
                    input_ids=torch.tensor([ids[CONTEXT : CONTEXT + n]], device=device),
                    past_key_values=cache,
                    cache_position=torch.arange(CONTEXT, CONTEXT + n, device=device),
                    use_cache=True,
                    logits_to_keep=n,
                )
            cache.crop(-n)

        return step

    for attention in ("sdpa", "eager"):
        step = bare(attention)
        for n in sizes[:4]:
            print(f"bare {attention:5s} n={n}: {timed(step, n)}", flush=True)
    step = bare("sdpa")
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for n in (1, 2):
        step(n)
        step(n)
        synchronize(args.device)
        with profile(activities=activities) as prof:
            step(n)
            synchronize(args.device)
        averages = prof.key_averages()
        print(f"\n=== profile bare sdpa n={n}: {sum(e.count for e in averages)} op calls")
        print(averages.table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=60))
        if on_gpu:
            print(averages.table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
