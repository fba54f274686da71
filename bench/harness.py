"""Benchmark harness: our services against plain transformers and Hugging Face assisted
generation, interleaved in one invocation, on the same prompts, pair and cores.

Every mode runs each prompt once per repeat, round-robin across modes, so machine noise
lands on all modes alike and every ratio is taken within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.modes import HF_DRAFTS, POOLS_PARTS, ROOT, BenchConfig, Sample, build_modes, drafter_args
from bench.runners import HFRunner, OursRunner
from specdec.config.settings import number, saying_why
from specdec.engine.costs import cpu_flags, cpu_model
from specdec.tools.real_models import DRAFT, TARGET
from target_service.pick import FLAGS, OUTPUT, pick_in_subprocess

logger = logging.getLogger("bench")


def machine_info(config: BenchConfig) -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "target_setting": config.target_pick,
        "device": config.device,
        "gpu": torch.cuda.get_device_name(0) if config.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": {
            "draft_service": config.threads,
            "target_service": config.threads,
            "in_process_hf": config.threads,
            "note": (
                "pinned modes: draft on core 0 (1 thread), target and coordinator on core 1 (1 thread); shared modes "
                "and HF: "
                f"every core, {config.threads} threads"
                if config.suite == "nodes"
                else (
                    "rounds are sequential, so the draft and target services never compute at the same time; "
                    "every mode uses the same cores"
                )
            ),
        },
        "drafters": {
            "ours": {m.drafter: drafter_args(m.drafter, config) for m in build_modes(config) if m.family == "ours"},
            "hf": {
                m.drafter: HF_DRAFTS[m.drafter]
                for m in build_modes(config)
                if m.family == "hf" and m.assisted not in (None, "lookup")
            },
        },
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def load_prompts(config: BenchConfig) -> list[dict]:
    return json.loads(config.prompts_file.read_text())["prompts"]


def run_bench(config: BenchConfig) -> dict:
    """The k-sweep, drafters, modes and nodes suites (the others have modules of their own)."""
    prompts = load_prompts(config)
    modes = build_modes(config)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    logger.info("starting services and loading in-process models")
    ours_variants = list(dict.fromkeys((m.drafter, m.coordinator, m.placement) for m in modes if m.family == "ours"))
    hf_drafts = list(dict.fromkeys(m.drafter for m in modes if m.family == "hf" and m.assisted not in (None, "lookup")))
    ours = OursRunner(config, ours_variants, config.out_dir / "logs")
    try:
        hf = HFRunner(config, hf_drafts) if any(m.family == "hf" for m in modes) else None
        runners: dict[str, OursRunner | HFRunner] = {"ours": ours, **({"hf": hf} if hf is not None else {})}
        for mode in modes:  # warm-up: first calls pay one-off costs
            runners[mode.family].run(mode, prompts[0]["text"], 4, 0.0, config.seed)
        per_mode = len(prompts) * config.repeats * len(config.temperatures)
        bars = {
            mode.name: tqdm(total=per_mode, desc=f"{mode.name:32s}", position=i, leave=True)
            for i, mode in enumerate(modes)
        }
        samples: list[Sample] = []
        # Temperatures innermost: greedy and sampled figures then come from the same stretch of
        # a run (a VM's speed drifts over a run; with temperature outermost, the sampled half
        # ran later and its ratios to greedy mixed the drift in).
        for repeat in range(config.repeats):
            for p_index, prompt in enumerate(prompts):
                seed = config.seed + 1000 * repeat + p_index
                for temperature in config.temperatures:
                    for mode in modes:
                        sample = runners[mode.family].run(
                            mode, prompt["text"], config.max_new_tokens, temperature, seed
                        )
                        sample.kind, sample.repeat = prompt["kind"], repeat
                        samples.append(sample)
                        bars[mode.name].update()
        for bar in bars.values():
            bar.close()
    finally:
        ours.close()
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "machine": machine_info(config),
        "prompts": [p["kind"] for p in prompts],
        "modes": [asdict(m) for m in modes],
        "samples": [asdict(s) for s in samples],
    }


def resolve_target_setting(setting: str, target_model: Path, threads: int, device: str) -> tuple[str, str, str]:
    """(--dtype, --quantize, why) for the target; `auto` measures on CPU, bfloat16 on a GPU."""
    if setting == "auto" and device != "cpu":
        setting = "bfloat16"
    if setting != "auto":
        return (*FLAGS[setting], f"{setting} (--target-setting); {OUTPUT[setting]}")
    choice = pick_in_subprocess(target_model, threads, cwd=ROOT)
    logger.info("target setting: %s\n%s\n%s\n%s", *(choice[key] for key in ("setting", "table", "reason", "output")))
    return (
        choice["dtype"],
        choice["quantize"],
        f"{choice['table']}\npicked {choice['setting']}: {choice['reason']}; {choice['output']}",
    )


def _at_least(kind: type, low: float) -> Callable[[str], Any]:
    """An argparse type: a finite `kind` number no less than `low`, else a usage error saying so."""
    return saying_why(number(kind, low))


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    models = ROOT / ".cache/models"
    parser.add_argument("--draft-model", type=Path, default=models / DRAFT.name)
    parser.add_argument("--target-model", type=Path, default=models / TARGET.name)
    parser.add_argument("--draft-dtype", default="bfloat16")
    parser.add_argument(
        "--target-setting",
        choices=["auto", "float32", "bfloat16", "int8"],
        default="auto",
        help=(
            "the target for every mode (ours and HF); auto times the three on this machine "
            "(python -m target_service.pick) and uses the fastest"
        ),
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda; results are written per device, never mixed")
    parser.add_argument(
        "--threads", type=_at_least(int, 1), default=os.cpu_count() or 1, help="torch threads for every mode"
    )
    parser.add_argument("--max-new-tokens", type=_at_least(int, 1), default=64)
    parser.add_argument("--repeats", type=_at_least(int, 1), default=2)
    parser.add_argument(
        "--ks",
        type=_at_least(int, 0),
        nargs="+",
        default=None,
        help="our K sweep (default 1 2 3 4 6 8; concurrency and relaxed suites: 4)",
    )
    parser.add_argument(
        "--hf-assisted", nargs="+", default=["default", "4"], help="HF assisted settings: default or a fixed K"
    )
    parser.add_argument("--temperatures", type=_at_least(float, 0), nargs="+", default=[0.0, 0.7])
    parser.add_argument("--prompts-file", type=Path, default=ROOT / "bench/prompts.json")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<device>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--suite",
        choices=[
            "k-sweep",
            "drafters",
            "modes",
            "all",
            "concurrency",
            "overhead",
            "nodes",
            "trees",
            "accelerator",
            "links",
            "pools",
            "multiturn",
            "live-costs",
            "relaxed",
            "drafts",
        ],
        default="k-sweep",
        help=(
            "k-sweep: our K sweep vs HF (draft at --draft-dtype); drafters: each draft-service drafter vs HF's "
            "int8 assisted and prompt lookup; modes: sequential vs pipelined vs adaptive K (int8 draft); all: those "
            "three in one interleaved run, sharing their services; "
            "concurrency: aggregate tokens/s with --sessions generations at once, the target batching Verify calls "
            "or not (int8 draft, greedy); nodes: each service on its own core (pinned) sequential, pipelined and "
            "hedged, against HF assisted with the same int8 pair on all cores; accelerator: tiny pairs of chosen "
            "acceptance whose passes are held to pass-cost profiles (published H100 ones, or the H200 our runners "
            "were measured on; emulated), every mode against the bounds (--pairs: only those pairs' cells); "
            "links: the 70B/1B accelerator cell with each service on its own network host (namespaces, as root) at "
            "each --link-ms; pools: replica pools and speculation under load, emulated (a concurrency sweep, 1 and "
            "4 target replicas, the same with replicas whose KV budget holds 8 requests, a replica killed "
            "mid-load) and with the real pair at 1, 4 and 8 clients "
            "(--pools-parts picks); multiturn: multi-turn edits, an agent loop and make run's prompts with and "
            "without the prefix cache and the suffix drafter (real pair); relaxed: exact against relaxed acceptance "
            "at a few (top_n, delta) settings, greedy at the last of --ks: speed, agreement with the exact output "
            "and perplexity under the target; "
            "drafts: the 0.5B draft against "
            "SmolLM2-135M, a draft of another family (make models MODELS_EXTRA=smollm2), through the services and in HF"
        ),
    )
    parser.add_argument(
        "--pools-parts",
        nargs="+",
        choices=POOLS_PARTS,
        default=list(POOLS_PARTS),
        help="pools suite: the parts to run",
    )
    parser.add_argument(
        "--dilation",
        type=float,
        default=1.0,
        help=(
            "pools suite, emulated parts: every pass takes this many times its profile's time and the figures are "
            "given in the accelerators' time, so this host's own work weighs 1/dilation (time dilation; labelled in "
            "the tables)"
        ),
    )
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=[],
        help="accelerator suite: only the cells of these profile pairs (bench.accelerator.PAIRS; default: every cell)",
    )
    parser.add_argument(
        "--link-ms",
        type=_at_least(float, 0),
        nargs="+",
        default=[0.05, 0.5, 2.0],
        help="links suite: one-way link delays to run",
    )
    parser.add_argument(
        "--sessions",
        type=_at_least(int, 1),
        nargs="+",
        default=[1, 2, 4, 8],
        help="concurrency suite: generations at once",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=_at_least(float, 0),
        default=2.0,
        help="concurrency suite: the batching target's window",
    )
    parser.add_argument(
        "--requests",
        type=_at_least(int, 0),
        default=0,
        help="concurrency suite: requests per sample, the same at every N (0 = the largest --sessions)",
    )
    parser.add_argument(
        "--only", nargs="+", default=[], help="run only modes whose name contains one of these (ours K=0 always runs)"
    )
    parser.add_argument(
        "--draft-vocab",
        type=_at_least(int, 1),
        default=32768,
        help="drafters suite: head size of the reduced-vocabulary draft",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few minutes: 2 prompts, 32 tokens, 1 repeat, K in {2,4}, greedy"
    )
    args = parser.parse_args(argv)
    if args.dilation <= 0:
        parser.error(f"--dilation must be above 0, not {args.dilation:g}")
    if bad := [k for k in args.hf_assisted if k != "default" and not (k.isdigit() and int(k) > 0)]:
        parser.error(f"--hf-assisted takes default or a K above 0, not {' '.join(bad)}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device is cpu or cuda (cuda:N), not {args.device!r}")
    if args.ks is None:
        args.ks = [4] if args.suite in ("concurrency", "relaxed") else [1, 2, 3, 4, 6, 8]
    if args.quick:
        args.max_new_tokens, args.repeats, args.ks, args.temperatures = 32, 1, [2, 4], [0.0]
        args.hf_assisted = ["default"]
    # These suites run tiny models of their own (the pools suite's emulated parts too): no
    # target to pick, and no real pair needed, so they run on any machine with more cores.
    emulated = args.suite in ("overhead", "accelerator", "links") or (
        args.suite == "pools" and "real" not in args.pools_parts
    )
    setting = "float32" if emulated else args.target_setting
    target_dtype, target_quantize, target_pick = resolve_target_setting(
        setting, args.target_model, args.threads, args.device
    )
    folder = args.device + ("" if args.suite == "k-sweep" else f"-{args.suite}")
    out = args.out or ROOT / "bench/results" / (f"{folder}-quick" if args.quick else folder)
    config = BenchConfig(
        draft_model=args.draft_model,
        target_model=args.target_model,
        draft_dtype=args.draft_dtype,
        target_dtype=target_dtype,
        target_quantize=target_quantize,
        target_pick=target_pick,
        device=args.device,
        threads=args.threads,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        ks=tuple(args.ks),
        hf_assisted=tuple(args.hf_assisted),
        temperatures=tuple(args.temperatures),
        prompts_file=args.prompts_file,
        out_dir=out,
        seed=args.seed,
        suite=args.suite,
        draft_vocab=args.draft_vocab,
        only=tuple(args.only),
        sessions=tuple(args.sessions),
        batch_window_ms=args.batch_window_ms,
        requests=args.requests,
        quick=args.quick,
        link_ms=tuple(args.link_ms),
        pools_parts=tuple(args.pools_parts),
        pairs=tuple(args.pairs),
        dilation=args.dilation,
    )
    if args.quick:
        prompts = json.loads(config.prompts_file.read_text())["prompts"][:2]
        quick_file = out / "prompts-quick.json"
        out.mkdir(parents=True, exist_ok=True)
        quick_file.write_text(json.dumps({"prompts": prompts}))
        config = BenchConfig(**{**asdict(config), "prompts_file": quick_file})
    return config
