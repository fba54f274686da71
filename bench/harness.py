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
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from specdec.costs import cpu_flags, cpu_model
from specdec.launch import free_port, model_service_args, spawn, spawn_coordinator
from specdec.modeling import DTYPES
from specdec.quantize import quantize_int8
from specdec.real_models import DRAFT, TARGET
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc
from target_service.pick import FLAGS, pick_in_subprocess

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench")

OURS_TARGET_ONLY = "ours target-only (K=0)"
HF_TARGET_ONLY = "HF generate target-only"


# Draft service variants, by name: extra flags for `python -m draft_service` (the draft's
# --dtype comes first, from --draft-dtype, so a variant's own --dtype wins).
def drafter_args(name: str, config: BenchConfig) -> list[str]:
    return {
        "model": ["--quantize", "none"],  # the draft model at --draft-dtype
        "int8": ["--dtype", "float32", "--quantize", "int8"],
        "int8+vocab": ["--dtype", "float32", "--quantize", "int8", "--draft-vocab", str(config.draft_vocab)],
        "ngram": ["--drafter", "ngram"],
        "int8@1thread": ["--dtype", "float32", "--quantize", "int8", "--threads", "1"],
        # The nodes suite: the draft's own "node" is core 0 (the target's is core 1).
        "int8@core0": ["--dtype", "float32", "--quantize", "int8", *PLACEMENTS["pinned"]["draft"]],
    }[name]


# Where the services run. "shared": every service may use every core (torch --threads each).
# "pinned": one machine standing in for separate nodes, the draft on core 0 and the target on
# core 1, one thread each. The coordinator shares the target's core: it works between a
# verify's reply and the next verify, exactly when the target's core is idle.
PLACEMENTS = {
    "shared": {"draft": [], "target": [], "coordinator": []},
    "pinned": {
        "draft": ["--cpus", "0", "--threads", "1"],
        "target": ["--cpus", "1", "--threads", "1"],
        "coordinator": ["--cpus", "1"],
    },
}


# Coordinator variants: extra flags for `python -m coordinator`.
COORDINATORS = {
    "sequential": [],
    "pipelined": ["--pipeline", "on"],
    "adaptive": ["--adaptive-k", "on"],
    "pipelined+adaptive": ["--pipeline", "on", "--adaptive-k", "on"],
    "hedged1": ["--hedges", "1"],
    "hedged2": ["--hedges", "2"],
    "pipelined+hedged1": ["--pipeline", "on", "--hedges", "1"],
    "pipelined+hedged2": ["--pipeline", "on", "--hedges", "2"],
}


# The in-process HF baseline's draft for each variant that has a model.
HF_DRAFTS = {
    "model": "as --draft-dtype",
    "int8": "float32 weights, int8 Linear layers (specdec.quantize, as the draft service)",
}


@dataclass(frozen=True)
class BenchConfig:
    draft_model: Path
    target_model: Path
    draft_dtype: str
    target_dtype: str
    device: str
    threads: int
    max_new_tokens: int
    repeats: int
    ks: tuple[int, ...]
    hf_assisted: tuple[str, ...]  # "default" (HF's own schedule) or a fixed K
    temperatures: tuple[float, ...]
    prompts_file: Path
    out_dir: Path
    seed: int
    suite: str = "k-sweep"  # or "drafters", "modes", "concurrency"
    only: tuple[str, ...] = ()  # keep only modes whose name contains one of these (plus ours K=0)
    draft_vocab: int = 32768  # the reduced-vocabulary drafter's head size
    sessions: tuple[int, ...] = (1, 2, 4, 8)  # concurrency suite: generations at once
    batch_window_ms: float = 2.0  # concurrency suite: the batching target's --batch-window-ms
    requests: int = 0  # concurrency suite: requests per sample (0 = the largest --sessions)
    target_quantize: str = "none"  # the target service's --quantize; "int8" also for the HF baselines' target
    target_pick: str = ""  # why this target setting: target_service.pick's table and reason (--target-setting auto)


@dataclass(frozen=True)
class Mode:
    name: str
    family: str  # "ours" or "hf"
    k: int = 0  # ours: num_speculative_tokens
    assisted: str | None = None  # hf: None (target only), "default", a fixed K, or "lookup" (prompt lookup)
    drafter: str = "model"  # ours: the draft service variant (drafter_args); hf: the assistant (HF_DRAFTS)
    coordinator: str = "sequential"  # ours: the coordinator variant (COORDINATORS)
    adaptive: bool = False  # ours: leave K to the coordinator (k is then only a label)
    placement: str = "shared"  # ours: PLACEMENTS


@dataclass
class Sample:
    mode: str
    kind: str
    temperature: float
    repeat: int
    tokens: int
    total_ms: float
    ttft_ms: float
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_compute_ms: float = 0.0
    target_compute_ms: float = 0.0
    predrafts: int = 0
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_cancelled: int = 0
    k_per_round: list[int] = field(default_factory=list)
    recovered: int = 0  # rounds that ended in a rejection
    hedges: int = 0
    hedge_hits: int = 0
    draft_ms: float = 0.0  # waiting on draft calls (the draft on the critical path)
    target_ms: float = 0.0  # waiting on verify calls
    branch_wait_ms: float = 0.0  # waiting on pre-draft/hedge replies after verifies
    ready_rounds: int = 0  # rounds whose drafts came from a pre-draft or hedge
    predraft_wasted_tokens: int = 0
    hedge_wasted_tokens: int = 0


def build_modes(config: BenchConfig) -> list[Mode]:
    modes = _suite_modes(config)
    if config.only:
        modes = [m for m in modes if m.name == OURS_TARGET_ONLY or any(part in m.name for part in config.only)]
    return modes


def _suite_modes(config: BenchConfig) -> list[Mode]:
    if config.suite == "drafters":
        return drafter_modes()
    if config.suite == "modes":
        return coordinator_modes()
    if config.suite == "concurrency":
        return [Mode(f"ours int8 K={k}", "ours", k, drafter="int8") for k in config.ks]
    if config.suite == "nodes":
        return node_modes()
    modes = [Mode(OURS_TARGET_ONLY, "ours", 0), Mode(HF_TARGET_ONLY, "hf")]
    modes += [Mode(f"HF assisted ({a if a == 'default' else 'K=' + a})", "hf", assisted=a) for a in config.hf_assisted]
    modes += [Mode(f"ours K={k}", "ours", k) for k in config.ks]
    return modes


def drafter_modes() -> list[Mode]:
    """Each drafter against target-only and against HF's best peers with the same drafts:
    assisted generation with the int8 draft, and HF's own prompt lookup."""
    return [
        Mode(OURS_TARGET_ONLY, "ours", 0, drafter="ngram"),
        Mode("HF assisted int8 (default)", "hf", assisted="default", drafter="int8"),
        Mode("HF assisted int8 (K=4)", "hf", assisted="4", drafter="int8"),
        Mode("HF prompt lookup (10)", "hf", assisted="lookup"),
        Mode("ours model K=2", "ours", 2, drafter="model"),
        Mode("ours int8 K=3", "ours", 3, drafter="int8"),
        Mode("ours int8 K=5", "ours", 5, drafter="int8"),
        Mode("ours int8+reduced vocab K=4", "ours", 4, drafter="int8+vocab"),
        Mode("ours ngram K=4", "ours", 4, drafter="ngram"),
        Mode("ours ngram K=8", "ours", 8, drafter="ngram"),
    ]


def coordinator_modes() -> list[Mode]:
    """Sequential against pipelined, hedged and adaptive K, all with the int8 draft."""
    return [
        Mode(OURS_TARGET_ONLY, "ours", 0, drafter="int8"),
        Mode("HF assisted int8 (K=4)", "hf", assisted="4", drafter="int8"),
        Mode("ours int8 K=3 sequential", "ours", 3, drafter="int8"),
        Mode("ours int8 K=3 pipelined", "ours", 3, drafter="int8", coordinator="pipelined"),
        Mode("ours int8 (1 thread) K=3 pipelined", "ours", 3, drafter="int8@1thread", coordinator="pipelined"),
        Mode("ours int8 adaptive K", "ours", 0, drafter="int8", coordinator="adaptive", adaptive=True),
        Mode(
            "ours int8 adaptive K pipelined", "ours", 0, drafter="int8", coordinator="pipelined+adaptive", adaptive=True
        ),
        Mode("ours int8 K=3 hedged (1)", "ours", 3, drafter="int8", coordinator="hedged1"),
        Mode("ours int8 K=3 hedged (2)", "ours", 3, drafter="int8", coordinator="hedged2"),
        Mode("ours int8 K=3 pipelined+hedged (1)", "ours", 3, drafter="int8", coordinator="pipelined+hedged1"),
    ]


def node_modes() -> list[Mode]:
    """Each service on its own node, emulated by pinning, against the same pair in one process:
    target-only and HF assisted generation (int8 draft and int8 target, all cores), ours with
    shared cores, and ours pinned sequential, pipelined and pipelined with hedges, each with K
    fixed and with the K chooser."""
    pinned = dict(drafter="int8@core0", placement="pinned")
    modes = [
        Mode(OURS_TARGET_ONLY, "ours", 0, drafter="int8"),
        Mode("HF assisted int8 (default)", "hf", assisted="default", drafter="int8"),
        Mode("HF assisted int8 (K=2)", "hf", assisted="2", drafter="int8"),
        Mode("HF assisted int8 (K=4)", "hf", assisted="4", drafter="int8"),
        Mode("ours shared sequential, K chooser", "ours", 0, drafter="int8", adaptive=True),
        Mode("ours shared pipelined+2 hedges K=2", "ours", 2, drafter="int8", coordinator="pipelined+hedged2"),
    ]
    for name, coordinator in (
        ("sequential", "sequential"),
        ("pipelined", "pipelined"),
        ("pipelined+2 hedges", "pipelined+hedged2"),
    ):
        modes.append(Mode(f"ours pinned {name} K=2", "ours", 2, coordinator=coordinator, **pinned))
        modes.append(
            Mode(f"ours pinned {name}, K chooser", "ours", 0, coordinator=coordinator, adaptive=True, **pinned)
        )
    return modes


class OursRunner:
    """One target service, and a draft service plus a coordinator per drafter variant, all
    separate processes on loopback. Rounds are sequential, so at most one computes at a time."""

    def __init__(self, config: BenchConfig, variants: list[tuple[str, str, str]], log_dir: Path) -> None:
        """`variants`: (drafter, coordinator, placement); one target per placement and one
        draft service per drafter."""
        drafters = list(dict.fromkeys(drafter for drafter, _, _ in variants))
        self._processes = ExitStack()
        model_args, env = model_service_args(config.device, config.threads)
        try:
            targets = {}
            for placement in dict.fromkeys(placement for _, _, placement in variants):
                targets[placement] = self._start(
                    "target_service",
                    [
                        "--model",
                        str(config.target_model),
                        "--dtype",
                        config.target_dtype,
                        "--quantize",
                        config.target_quantize,
                        *model_args,
                        *PLACEMENTS[placement]["target"],
                    ],
                    log_dir / f"target-{placement}.log",
                    env,
                )
                # One at a time: each service times its own passes at start-up (--calibrate), which a
                # neighbour loading its weights on the same cores would skew.
                targets[placement].wait_healthy(900)
            drafts = {}
            for name in drafters:
                drafts[name] = self._start(
                    "draft_service",
                    [
                        "--model",
                        str(config.draft_model),
                        "--dtype",
                        config.draft_dtype,
                        *model_args,
                        *drafter_args(name, config),
                    ],
                    log_dir / f"draft-{name}.log",
                    env,
                )
                drafts[name].wait_healthy(900)
            self.channels: dict[tuple[str, str, str], grpc.Channel] = {}
            self.stubs: dict[tuple[str, str, str], coordinator_pb2_grpc.CoordinatorStub] = {}
            for drafter, variant, placement in variants:
                coordinator = spawn_coordinator(
                    drafts[drafter],
                    targets[placement],
                    config.target_model,
                    log_dir / f"coordinator-{drafter}-{variant}-{placement}.log",
                    [
                        "--max-num-speculative-tokens",
                        "8",
                        "--max-new-tokens-limit",
                        "4096",
                        *COORDINATORS[variant],
                        *PLACEMENTS[placement]["coordinator"],
                    ],
                    ROOT,
                )
                self._processes.callback(coordinator.stop)
                key = (drafter, variant, placement)
                self.channels[key] = grpc.insecure_channel(coordinator.address)
                self.stubs[key] = coordinator_pb2_grpc.CoordinatorStub(self.channels[key])
        except BaseException:
            self._processes.close()
            raise

    def _start(self, module: str, args: list[str], log: Path, env: dict[str, str]):
        process = spawn(module, module, args, free_port(), log, env, ROOT)
        self._processes.callback(process.stop)
        return process

    def run(self, mode: Mode, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> Sample:
        request = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        if not mode.adaptive:
            request.num_speculative_tokens = mode.k
        response = self.stubs[mode.drafter, mode.coordinator, mode.placement].Generate(request, timeout=3600)
        s = response.stats
        return Sample(
            mode.name,
            "",
            temperature,
            0,
            s.generated_tokens,
            s.total_ms,
            s.time_to_first_token_ms,
            s.rounds,
            s.proposed_tokens,
            s.accepted_tokens,
            list(s.accepted_per_position),
            s.draft_compute_ms,
            s.target_compute_ms,
            s.predrafts,
            s.predraft_hits,
            s.predraft_misses,
            s.predraft_cancelled,
            list(s.k_per_round),
            recovered=s.recovered_tokens,
            hedges=s.hedges,
            hedge_hits=s.hedge_hits,
            draft_ms=s.draft_ms,
            target_ms=s.target_ms,
            branch_wait_ms=s.branch_wait_ms,
            ready_rounds=s.ready_rounds,
            predraft_wasted_tokens=s.predraft_wasted_tokens,
            hedge_wasted_tokens=s.hedge_wasted_tokens,
        )

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self._processes.close()


class _FirstTokenTimer(BaseStreamer):
    """transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:  # the first call carries the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner:
    """The baseline a user has today: transformers in this process, same models and dtypes."""

    def __init__(self, config: BenchConfig, drafts: list[str]) -> None:
        self.device = config.device
        self.tokenizer = AutoTokenizer.from_pretrained(config.target_model)
        self.target = (
            AutoModelForCausalLM.from_pretrained(config.target_model, dtype=DTYPES[config.target_dtype])
            .to(config.device)
            .eval()
        )
        if config.target_quantize == "int8":  # the same int8 layers as the target service
            quantize_int8(self.target)
        self.drafts = {}
        for name in drafts:
            dtype = DTYPES["float32" if name == "int8" else config.draft_dtype]
            draft = AutoModelForCausalLM.from_pretrained(config.draft_model, dtype=dtype).to(config.device).eval()
            self.drafts[name] = quantize_int8(draft) if name == "int8" else draft
        self._default_assistant = (
            {
                name: getattr(next(iter(self.drafts.values())).generation_config, name, None)
                for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
            }
            if self.drafts
            else {}
        )

    def run(self, mode: Mode, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> Sample:
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
        kwargs: dict = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0)
        if temperature > 0:
            # top_k=0: transformers would otherwise apply its default top-k of 50.
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        if mode.assisted == "lookup":
            kwargs["prompt_lookup_num_tokens"] = 10  # as in transformers' docs and shared/MODELS.md
        elif mode.assisted is not None:
            draft = self.drafts[mode.drafter]
            for name, value in self._default_assistant.items():
                setattr(draft.generation_config, name, value)
            if mode.assisted != "default":
                draft.generation_config.num_assistant_tokens = int(mode.assisted)
                draft.generation_config.num_assistant_tokens_schedule = "constant"
                draft.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = draft
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(ids, streamer=timer, **kwargs)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        total_ms = (time.perf_counter() - start) * 1e3
        ttft_ms = ((timer.first_token_at or time.perf_counter()) - start) * 1e3
        return Sample(mode.name, "", temperature, 0, int(out.shape[1] - ids.shape[1]), total_ms, ttft_ms)


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
        runners = {"ours": ours, "hf": hf}
        for mode in modes:  # warm-up: first calls pay one-off costs
            runners[mode.family].run(mode, prompts[0]["text"], 4, 0.0, config.seed)
        per_mode = len(prompts) * config.repeats * len(config.temperatures)
        bars = {
            mode.name: tqdm(total=per_mode, desc=f"{mode.name:32s}", position=i, leave=True)
            for i, mode in enumerate(modes)
        }
        samples: list[Sample] = []
        for temperature in config.temperatures:
            for repeat in range(config.repeats):
                for p_index, prompt in enumerate(prompts):
                    seed = config.seed + 1000 * repeat + p_index
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
        return (*FLAGS[setting], f"{setting} (--target-setting)")
    choice = pick_in_subprocess(target_model, threads, cwd=ROOT)
    logger.info("target setting: %s\n%s\n%s", choice["setting"], choice["table"], choice["reason"])
    return choice["dtype"], choice["quantize"], f"{choice['table']}\npicked {choice['setting']}: {choice['reason']}"


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
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for every mode")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--ks", type=int, nargs="+", default=None, help="our K sweep (default 1 2 3 4 6 8; concurrency suite: 4)"
    )
    parser.add_argument(
        "--hf-assisted", nargs="+", default=["default", "4"], help="HF assisted settings: default or a fixed K"
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--prompts-file", type=Path, default=ROOT / "bench/prompts.json")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<device>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--suite",
        choices=["k-sweep", "drafters", "modes", "concurrency", "overhead", "nodes"],
        default="k-sweep",
        help=(
            "k-sweep: our K sweep vs HF (draft at --draft-dtype); drafters: each draft-service drafter vs HF's "
            "int8 assisted and prompt lookup; modes: sequential vs pipelined vs adaptive K (int8 draft); "
            "concurrency: aggregate tokens/s with --sessions generations at once, the target batching Verify calls "
            "or not (int8 draft, greedy); nodes: each service on its own core (pinned) sequential, pipelined and "
            "hedged, against HF assisted with the same int8 pair on all cores"
        ),
    )
    parser.add_argument(
        "--sessions", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrency suite: generations at once"
    )
    parser.add_argument(
        "--batch-window-ms", type=float, default=2.0, help="concurrency suite: the batching target's window"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="concurrency suite: requests per sample, the same at every N (0 = the largest --sessions)",
    )
    parser.add_argument(
        "--only", nargs="+", default=[], help="run only modes whose name contains one of these (ours K=0 always runs)"
    )
    parser.add_argument(
        "--draft-vocab", type=int, default=32768, help="drafters suite: head size of the reduced-vocabulary draft"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few minutes: 2 prompts, 32 tokens, 1 repeat, K in {2,4}, greedy"
    )
    args = parser.parse_args(argv)
    if args.ks is None:
        args.ks = [4] if args.suite == "concurrency" else [1, 2, 3, 4, 6, 8]
    if args.quick:
        args.max_new_tokens, args.repeats, args.ks, args.temperatures = 32, 1, [2, 4], [0.0]
        args.hf_assisted = ["default"]
    # The overhead suite runs a tiny model of its own: no target to pick.
    setting = "float32" if args.suite == "overhead" else args.target_setting
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
    )
    if args.quick:
        prompts = json.loads(config.prompts_file.read_text())["prompts"][:2]
        quick_file = out / "prompts-quick.json"
        out.mkdir(parents=True, exist_ok=True)
        quick_file.write_text(json.dumps({"prompts": prompts}))
        config = BenchConfig(**{**asdict(config), "prompts_file": quick_file})
    return config
