"""What the benchmark runs: its settings, the modes of each suite, and one measured sample."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specdec.tools.launch import ServiceProcess, local_stack
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]

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
        # Prompt lookup where the sequence's last n-gram recurs, the int8 model otherwise.
        "int8+lookup": ["--dtype", "float32", "--quantize", "int8", "--drafter", "hybrid"],
        "int8@1thread": ["--dtype", "float32", "--quantize", "int8", "--threads", "1"],
        # The nodes suite: the draft's own "node" is core 0 (the target's is core 1).
        "int8@core0": ["--dtype", "float32", "--quantize", "int8", *PLACEMENTS["pinned"]["draft"].args],
    }[name]


def target_service_args(config: BenchConfig) -> list[str]:
    """The benchmark target's model and setting flags (`python -m target_service`)."""
    return [
        "--model",
        str(config.target_model),
        "--dtype",
        config.target_dtype,
        "--quantize",
        config.target_quantize,
    ]


def pair_stack(
    config: BenchConfig,
    log_dir: Path,
    *,
    draft_model: Path | None = None,
    draft_args: Sequence[str] = (),
    target_args: Sequence[str] = (),
) -> AbstractContextManager[dict[str, ServiceProcess]]:
    """The bench's pair as three local services (specdec.tools.launch.local_stack): the draft
    (`draft_model`, by default the bench's) quantised to int8, and the target at the bench's
    setting; `draft_args` and `target_args` follow those flags."""
    return local_stack(
        draft_model or config.draft_model,
        config.target_model,
        log_dir,
        draft_dtype="float32",
        target_dtype=config.target_dtype,
        device=config.device,
        threads=config.threads,
        draft_args=["--quantize", "int8", *draft_args],
        target_args=["--quantize", config.target_quantize, *target_args],
        cwd=ROOT,
    )


def model_infos(draft: ServiceProcess, target: ServiceProcess, timeout: float = 30) -> dict[str, common_pb2.ModelInfo]:
    """What the draft and the target report of themselves (their Info RPC), by role."""
    found = {}
    for role, service, stub_class in (
        ("draft", draft, draft_pb2_grpc.DraftStub),
        ("target", target, target_pb2_grpc.TargetStub),
    ):
        with grpc.insecure_channel(service.address) as channel:
            found[role] = stub_class(channel).Info(common_pb2.InfoRequest(), timeout=timeout)
    return found


@dataclass(frozen=True)
class Placement:
    """Where one service runs: the cores (specdec.tools.launch.spawn's `cpus`; () = every one)
    and the flags that go with them."""

    cpus: tuple[int, ...] = ()
    args: tuple[str, ...] = ()


# Where the services run. "shared": every service may use every core (torch --threads each).
# "pinned": one machine standing in for separate nodes, the draft on core 0 and the target on
# core 1, one thread each. The coordinator shares the target's core: it works between a
# verify's reply and the next verify, exactly when the target's core is idle.
PLACEMENTS: dict[str, dict[str, Placement]] = {
    "shared": {"draft": Placement(), "target": Placement(), "coordinator": Placement()},
    "pinned": {
        "draft": Placement((0,), ("--threads", "1")),
        "target": Placement((1,), ("--threads", "1")),
        "coordinator": Placement((1,)),
    },
}


def drafter_cpus(name: str) -> tuple[int, ...]:
    """The cores a draft service variant runs on (the nodes suite's draft: its own core)."""
    return PLACEMENTS["pinned"]["draft"].cpus if name == "int8@core0" else ()


def overlap_flags(pipeline: str = "off", hedges: int = 0, bonus_guesses: int = 1) -> list[str]:
    """A coordinator's overlap, fixed: these suites name the mode they measure, where the
    default (auto) would choose one per request (coordinator.overlap)."""
    return ["--pipeline", pipeline, "--hedges", str(hedges), "--bonus-guesses", str(bonus_guesses)]


# Coordinator variants: extra flags for `python -m coordinator`.
COORDINATORS = {
    "sequential": overlap_flags(),
    "pipelined": overlap_flags("on"),
    "adaptive": overlap_flags(),  # the K chooser: requests that leave K unset
    "pipelined+adaptive": overlap_flags("on"),
    "hedged1": overlap_flags(hedges=1),
    "hedged2": overlap_flags(hedges=2),
    "pipelined+hedged1": overlap_flags("on", 1),
    "pipelined+hedged2": overlap_flags("on", 2),
    # Without catch-up steps: a round with no drafts ready waits for fresh ones.
    "pipelined-waiting": [*overlap_flags("on"), "rule:catch_up=off"],  # bench.rules_coordinator
    "tree-chooser": [*overlap_flags(), "--tree-chooser", "on"],
    "default": [],  # no flags: the overlap and K chosen per request
}


# The in-process HF baseline's draft for each variant that has a model.
HF_DRAFTS = {
    "model": "as --draft-dtype",
    "int8": "float32 weights, int8 Linear layers (specdec.engine.quantize, as the draft service)",
}


POOLS_PARTS = ("sweep", "scale", "kv", "failover", "real")  # the pools suite's parts (bench.pools)


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
    suite: str = "k-sweep"  # or "drafters", "modes", "all" (those three), "concurrency", "overhead", "nodes", "trees"
    only: tuple[str, ...] = ()  # keep only modes whose name contains one of these (plus ours K=0)
    draft_vocab: int = 32768  # the reduced-vocabulary drafter's head size
    sessions: tuple[int, ...] = (1, 2, 4, 8)  # concurrency suite: generations at once
    batch_window_ms: float = 2.0  # concurrency suite: the batching target's --batch-window-ms
    requests: int = 0  # concurrency suite: requests per sample (0 = the largest --sessions)
    target_quantize: str = "none"  # the target service's --quantize; "int8" also for the HF baselines' target
    target_pick: str = ""  # why this target setting: target_service.pick's table and reason (--target-setting auto)
    quick: bool = False  # --quick: a few minutes
    link_ms: tuple[float, ...] = (0.05, 0.5, 2.0)  # links suite: one-way link delays
    pools_parts: tuple[str, ...] = POOLS_PARTS  # pools suite: parts to run
    dilation: float = 1.0  # pools suite, emulated parts: time dilation (bench.pools.Emulation)
    pairs: tuple[str, ...] = ()  # accelerator suite: only the cells of these profile pairs (bench.accelerator.PAIRS)


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
    tree: tuple[int, ...] = ()  # ours: tree speculation with these widths (GenerateRequest.tree_widths)


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
    tree_rounds: int = 0  # rounds that verified a token tree
    catch_up_rounds: int = 0  # pipelined rounds run target-only while the draft drafted the next
    accepted_per_round: list[int] = field(default_factory=list)  # beside k_per_round
    overhead_ms: float | None = None  # Σ the coordinator's round_overhead_ms (None: not reported)
    degraded: bool = False  # the draft failed or was skipped: some rounds ran target-only
    fallback_rounds: int = 0
    draft_failures: int = 0


def build_modes(config: BenchConfig) -> list[Mode]:
    modes = _suite_modes(config)
    if config.only:
        modes = [m for m in modes if m.name == OURS_TARGET_ONLY or any(part in m.name for part in config.only)]
    return modes


# The suites `--suite all` runs together, sharing their processes.
SHARED_SUITES = ("k-sweep", "drafters", "modes")


def _suite_modes(config: BenchConfig) -> list[Mode]:
    if config.suite == "all":
        # One interleaved run of the three suites: one target, one draft service per drafter
        # and one coordinator per coordination mode serve every mode that needs them.
        merged: dict[str, Mode] = {}
        for suite in SHARED_SUITES:
            for mode in _suite_modes(dataclasses.replace(config, suite=suite)):
                merged.setdefault(mode.name, mode)
        return list(merged.values())
    if config.suite == "drafters":
        return drafter_modes()
    if config.suite == "modes":
        return coordinator_modes()
    if config.suite == "concurrency":
        return [Mode(f"ours int8 K={k}", "ours", k, drafter="int8") for k in config.ks]
    if config.suite == "nodes":
        return node_modes()
    if config.suite == "trees":
        return tree_modes()
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
        Mode("ours int8+lookup K=3", "ours", 3, drafter="int8+lookup"),
        Mode("ours int8, K chooser", "ours", 0, drafter="int8", adaptive=True),
        Mode("ours int8+lookup, K chooser", "ours", 0, drafter="int8+lookup", adaptive=True),
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


def tree_modes() -> list[Mode]:
    """Token trees against chains with the same int8 draft and target (issue 19): tokens per
    target pass and tok/s, so a tree shows whether its extra nodes pay for their verify."""
    modes = [Mode(OURS_TARGET_ONLY, "ours", 0, drafter="int8")]
    modes += [Mode(f"ours int8 chain K={k}", "ours", k, drafter="int8") for k in (2, 3, 4, 5)]
    for widths in ((2, 1), (2, 1, 1), (2, 1, 1, 1), (2, 2), (2, 2, 1)):
        label = "x".join(map(str, widths))
        modes.append(Mode(f"ours int8 tree {label}", "ours", len(widths), drafter="int8", tree=widths))
    modes.append(Mode("ours int8, K chooser", "ours", 0, drafter="int8", adaptive=True))
    modes.append(
        Mode("ours int8, K/tree chooser", "ours", 0, drafter="int8", coordinator="tree-chooser", adaptive=True)
    )
    return modes


def node_modes() -> list[Mode]:
    """Each service on its own node, emulated by pinning, against the same pair in one process:
    target-only and HF assisted generation (int8 draft and int8 target, all cores), ours with
    shared cores, and ours pinned sequential, pipelined and pipelined with hedges, each with K
    fixed and with the K chooser."""
    pinned = Mode("", "ours", drafter="int8@core0", placement="pinned")  # the draft on core 0, the target on core 1
    modes = [
        Mode(OURS_TARGET_ONLY, "ours", 0, drafter="int8"),
        Mode("HF assisted int8 (default)", "hf", assisted="default", drafter="int8"),
        Mode("HF assisted int8 (K=2)", "hf", assisted="2", drafter="int8"),
        Mode("HF assisted int8 (K=4)", "hf", assisted="4", drafter="int8"),
        Mode("ours shared sequential K=2", "ours", 2, drafter="int8"),
        Mode("ours shared sequential, K chooser", "ours", 0, drafter="int8", adaptive=True),
        Mode("ours shared pipelined+2 hedges K=2", "ours", 2, drafter="int8", coordinator="pipelined+hedged2"),
    ]
    for name, coordinator in (
        ("sequential", "sequential"),
        ("pipelined, waiting", "pipelined-waiting"),
        ("pipelined", "pipelined"),
        ("pipelined+2 hedges", "pipelined+hedged2"),
    ):
        modes.append(dataclasses.replace(pinned, name=f"ours pinned {name} K=2", k=2, coordinator=coordinator))
        modes.append(
            dataclasses.replace(pinned, name=f"ours pinned {name}, K chooser", coordinator=coordinator, adaptive=True)
        )
    return modes
