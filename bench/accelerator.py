"""`--suite accelerator`: the design where it is meant to run, emulated.

Each model service runs a tiny model and holds every pass to a published H100 profile
(bench.emulated, bench/profiles/), so a pass leaves the host idle and a 16-token verify
costs about what a 1-token step does, as on a GPU. The draft and the target run pinned to a core
each, one torch thread, on loopback (same-host links). The pairs come from bench.synthetic, with
the draft's greedy agreement α set to about 0.6, 0.8 or 0.9.

For each profile pair × α it runs target-only, sequential speculation at fixed K and with the K
chooser, pipelined rounds, pipelined with 2 hedges and with a hedge at every position, and trees, and reports tok/s,
× target-only, × the best sequential fixed K, the framework's overhead as a share of a round,
and two bounds from the profiles and the measured α (Leviathan et al.):

    sequential:      E(K) · T(1) / (K · d + T(K + 1))       E(K) = (1 − α^(K+1)) / (1 − α)
    fully overlapped: E(K) · T(1) / T(K + 1)                 (drafting entirely hidden)

with T(n) the target's pass over n new tokens and d the draft's step, best over K ≤ 8. These are
emulated figures: the emulation leaves out the accelerators' own variance, host-device copies,
and any network beyond loopback.
"""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.emulated import service_command
from bench.modes import model_infos, overlap_flags
from bench.synthetic import pair_with_acceptance
from specdec.engine.pace import PassCostProfile, load_profile
from specdec.rpc.ports import free_port
from specdec.tools.delay_link import LinkDelay
from specdec.tools.launch import ServiceProcess, spawn, spawn_coordinator, stop_all
from specdec.tools.testbed import Testbed, available
from specdec.v1 import coordinator_pb2 as pb
from specdec.v1 import coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "bench/profiles"
PAIRS = {
    "70b+1b": ("h100-70b-tp4", "h100-1b"),
    "8b+0.5b": ("h100-8b", "h100-0.5b"),
    "8b+3b": ("h100-8b", "h100-3b"),
    # EAGLE-3 heads as their own drafts' profiles (issue 68): the step's cost only; the drafts
    # come from the same synthetic pair at the same α, and the features' bytes are not carried.
    "70b+eagle3": ("h100-70b-tp4", "h100-70b-eagle3"),
    "8b+eagle3": ("h100-8b", "h100-8b-eagle3"),
    # Measured, not published: our own captured passes on one H200 (random weights of the real
    # pair's shapes; bench/results/gpu-h200-captured), with the real pair's acceptance on CPU.
    "h200-1.5b+0.5b": ("h200-captured-1.5b", "h200-captured-0.5b"),
}
CELLS = [
    ("70b+1b", 0.6),
    ("70b+1b", 0.8),
    ("70b+1b", 0.9),
    ("8b+0.5b", 0.8),
    ("8b+3b", 0.8),
    ("70b+eagle3", 0.8),
    ("8b+eagle3", 0.8),
    ("h200-1.5b+0.5b", 0.8),
]
QUICK_CELLS = [("70b+1b", 0.8)]
# Coordinator variants: extra flags for `python -m coordinator`.
COORDINATORS = {
    "sequential": overlap_flags(),
    "pipelined": overlap_flags("on"),
    "hedged": overlap_flags("on", 2),
    # The 12 likeliest rejection outcomes, runner-ups fanned out, and the bonus token guessed 3 ways.
    "hedged-all": overlap_flags("on", 12, 3),
    "tree-chooser": [*overlap_flags(), "--tree-chooser", "on"],
    "default": [],  # no flags: the overlap and K chosen per request (coordinator.overlap)
}
PROMPTS = [[5, 17, 99], [40, 41, 42, 43], [250, 3], [120, 77, 77, 1]]
SAMPLED = 0.7
K_MAX = 8


@dataclass(frozen=True)
class Mode:
    name: str
    coordinator: str
    k: int | None  # None: the K chooser
    tree: tuple[int, ...] = ()
    sampled: bool = False  # also run at T = 0.7

    def request(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            num_speculative_tokens=None if self.k is None or self.tree else self.k,
            tree_widths=list(self.tree),
        )


MODES = [
    Mode("target-only (K=0)", "sequential", 0, sampled=True),
    *(Mode(f"sequential K={k}", "sequential", k, sampled=k == 4) for k in (2, 4, 6, 8)),
    Mode("sequential, K chooser", "sequential", None, sampled=True),
    Mode("pipelined K=4", "pipelined", 4, sampled=True),
    Mode("pipelined, K chooser", "pipelined", None, sampled=True),
    Mode("pipelined+2 hedges K=4", "hedged", 4, sampled=True),
    Mode("tree (2,1,1,1)", "sequential", None, tree=(2, 1, 1, 1)),
    Mode("tree (3,1,1)", "sequential", None, tree=(3, 1, 1)),
    Mode("K chooser with trees", "tree-chooser", None),
    Mode("pipelined, all hedged K=6", "hedged-all", 6, sampled=True),
    Mode("pipelined, all hedged, K chooser", "hedged-all", None, sampled=True),
    Mode("no flags (overlap and K chosen)", "default", None, sampled=True),
]
QUICK_MODES = [MODES[0], MODES[2], MODES[5], MODES[7], MODES[9], MODES[-1]]


@functools.cache
def profile(name: str) -> PassCostProfile:
    """A profile of bench/profiles/ by name, read once."""
    return load_profile(str(PROFILES / f"{name}.json"))


def bounds(target: PassCostProfile, draft: PassCostProfile, alpha: float, context: int) -> dict:
    """The best sequential and fully overlapped speedups over target-only, over K = 1..K_MAX."""

    def expected(k: int) -> float:
        return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0

    step, one = draft.ms(1, context), target.ms(1, context)
    sequential = {k: expected(k) * one / (k * step + target.ms(k + 1, context)) for k in range(1, K_MAX + 1)}
    overlapped = {k: expected(k) * one / target.ms(k + 1, context) for k in range(1, K_MAX + 1)}
    best_sequential = max(sequential, key=sequential.__getitem__)
    best_overlapped = max(overlapped, key=overlapped.__getitem__)
    return {
        "sequential": sequential[best_sequential],
        "sequential_k": best_sequential,
        "overlapped": overlapped[best_overlapped],
        "overlapped_k": best_overlapped,
        "draft_step_ms": step,
        "target_pass_ms": one,
    }


def start_services(
    pair, target_profile: Path, draft_profile: Path, logs: Path, stack: ExitStack, bed: Testbed | None = None
) -> tuple:
    """The draft and the target, each on its own host of `bed` (separate network namespaces
    with their links' delays) or, without one, on loopback."""
    common = ["--threads", "1", "--max-speculative-tokens", "16"]
    # The draft as its α was measured: float32 (int8 rounding moves a tiny random model's argmax),
    # and no confidence stops (its probabilities say little about whether it is right: it
    # stopped at 1.5 drafts a round of K = 4 at α 0.78), so K means K.
    draft_only = ["--min-confidence", "0", "--quantize", "none"]
    env = {"OMP_NUM_THREADS": "1"}
    draft_args = ["--model", str(pair.draft), "--pass-cost-profile", str(draft_profile)]
    target_args = ["--model", str(pair.target), "--pass-cost-profile", str(target_profile)]

    def start(name: str, args: list[str], core: int) -> ServiceProcess:
        module, args = service_command(name, args)
        if bed is not None:  # the testbed stops what it started
            return bed.serve(name, module, args, logs / f"{name}.log", env, ROOT, cpus=(core,))
        service = spawn(name, module, args, free_port(), logs / f"{name}.log", env, ROOT, cpus=(core,))
        started.append(service)
        return service

    started: list[ServiceProcess] = []
    stack.callback(stop_all, started)
    draft = start("draft", [*draft_args, *common, *draft_only], 0)
    target = start("target", [*target_args, *common], 1)
    draft.wait_healthy(300)
    target.wait_healthy(300)
    return draft, target


def start_coordinator(
    draft, target, pair, variant: str, logs: Path, bed: Testbed | None, host: str = "coordinator"
) -> ServiceProcess:
    """A coordinator for this variant: on loopback, or on a testbed host (on the target's own
    host it reaches the target without a link)."""
    log = logs / f"coordinator-{variant}.log"
    if bed is None:
        return spawn_coordinator(draft, target, pair.target, log, COORDINATORS[variant], ROOT)
    target_address = target.local_address if host == "target" else target.address
    args = ["--draft", draft.address, "--target", target_address, "--tokenizer", str(pair.target)]
    coordinator = bed.serve(host, "coordinator", [*args, *COORDINATORS[variant]], log, cwd=ROOT)
    coordinator.wait_healthy(120)
    return coordinator


def overruns(draft: ServiceProcess, target: ServiceProcess) -> dict[str, int]:
    """Passes whose real compute overran the profile (Info.emulation_overruns): such passes ran
    slower than the accelerator would, and the figures say so."""
    return {role: info.emulation_overruns for role, info in model_infos(draft, target).items()}


def run_mode(stub, mode: Mode, temperature: float, max_new_tokens: int, seed: int) -> dict:
    tokens = rounds = proposed = accepted = first_accepted = drafted_rounds = 0
    seconds = 0.0
    shares = []
    for index, prompt in enumerate(PROMPTS):
        response = stub.Generate(mode.request(prompt, max_new_tokens, temperature, seed + index), timeout=600)
        s = response.stats
        tokens += s.generated_tokens
        seconds += s.total_ms / 1e3
        rounds += s.rounds
        proposed += s.proposed_tokens
        accepted += s.accepted_tokens
        first_accepted += s.accepted_per_position[0] if s.accepted_per_position else 0
        drafted_rounds += sum(1 for k in s.k_per_round if k)
        shares += [overhead / whole for overhead, whole in zip(s.round_overhead_ms, s.round_ms) if whole > 0][1:]
    return {
        "mode": mode.name,
        "temperature": temperature,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "rounds": rounds,
        "proposed": proposed,
        "tokens_per_round": tokens / max(1, rounds),
        "acceptance": accepted / max(1, proposed),
        "first_accepted": first_accepted,  # rounds whose first draft was accepted
        "drafted_rounds": drafted_rounds,  # rounds that carried drafts
        "overhead_share": statistics.median(shares) if shares else 0.0,
    }


def run_modes(
    draft,
    target,
    pair,
    modes: list[Mode],
    config,
    logs: Path,
    samples: list[dict],
    label: str,
    bed: Testbed | None = None,
    coordinator_host: str = "coordinator",
) -> None:
    """Every mode, greedy and (where it says so) at T = 0.7, `config.repeats` times: each
    repeat runs every mode once, in an order that rotates from one repeat to the next, so that
    modes are compared side by side and a machine slowing for a while does not land on one
    mode. Every coordinator variant is started first. A mode's sample pools its repeats
    (tokens over seconds; `repeat_tokens_per_s` keeps each one's rate)."""
    runs = [(mode, temperature) for mode in modes for temperature in ((0.0, SAMPLED) if mode.sampled else (0.0,))]
    with ExitStack() as stack:
        stubs = {}
        coordinators: list[ServiceProcess] = []
        stack.callback(stop_all, coordinators)
        for variant in dict.fromkeys(mode.coordinator for mode in modes):
            coordinator = start_coordinator(draft, target, pair, variant, logs, bed, coordinator_host)
            coordinators.append(coordinator)
            channel = stack.enter_context(grpc.insecure_channel(coordinator.address))
            stubs[variant] = coordinator_pb2_grpc.CoordinatorStub(channel)
            stubs[variant].Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_new_tokens=8), timeout=120)
        found: dict[tuple[str, float], list[dict]] = {}
        repeats = max(1, config.repeats)
        for repeat in range(repeats):
            shift = repeat * len(runs) // repeats
            for mode, temperature in runs[shift:] + runs[:shift]:
                started = time.monotonic()
                sample = run_mode(stubs[mode.coordinator], mode, temperature, config.max_new_tokens, config.seed)
                found.setdefault((mode.name, temperature), []).append(sample)
                print(
                    f"{label} {mode.name:28s} T={temperature} (repeat {repeat + 1}/{repeats}): "
                    f"{sample['tokens_per_s']:7.1f} tok/s ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    samples.extend(pooled(found[(mode.name, temperature)]) for mode, temperature in runs)


def pooled(repeats: list[dict]) -> dict:
    """One mode's repeats as one sample: totals pooled, shares and α by round weight."""
    first = repeats[0]
    tokens = sum(r["tokens"] for r in repeats)
    seconds = sum(r["seconds"] for r in repeats)
    rounds = sum(r["rounds"] for r in repeats)
    proposed = sum(r["proposed"] for r in repeats)
    return {
        "mode": first["mode"],
        "temperature": first["temperature"],
        "tokens_per_s": tokens / seconds,
        "repeat_tokens_per_s": [r["tokens_per_s"] for r in repeats],
        "tokens": tokens,
        "seconds": seconds,
        "rounds": rounds,
        "proposed": proposed,
        "tokens_per_round": tokens / max(1, rounds),
        "acceptance": sum(r["acceptance"] * r["proposed"] for r in repeats) / max(1, proposed),
        "first_accepted": sum(r["first_accepted"] for r in repeats),
        "drafted_rounds": sum(r["drafted_rounds"] for r in repeats),
        "overhead_share": statistics.median(r["overhead_share"] for r in repeats),
    }


def run_accelerator(config, machine: dict, quick: bool = False) -> dict:
    cells = QUICK_CELLS if quick and not config.pairs else CELLS
    if config.pairs:
        unknown = set(config.pairs) - set(PAIRS)
        if unknown:
            raise ValueError(f"--pairs: no pair {', '.join(sorted(unknown))}; the pairs are {', '.join(PAIRS)}")
        cells = [cell for cell in cells if cell[0] in config.pairs]
    modes = QUICK_MODES if quick else MODES
    cache = ROOT / ".cache/bench-accelerator"
    logs = config.out_dir / "logs"
    results: dict = {"suite": "accelerator", "machine": machine, "emulated": True, "cells": []}
    for pair_name, alpha in cells:
        pair, measured = pair_with_acceptance(cache, alpha)
        target_name, draft_name = PAIRS[pair_name]
        target_path, draft_path = PROFILES / f"{target_name}.json", PROFILES / f"{draft_name}.json"
        cell_logs = logs / f"{pair_name}-alpha{alpha}"
        samples: list[dict] = []
        cell = {
            "pair": pair_name,
            "target_profile": target_name,
            "draft_profile": draft_name,
            "alpha_target": alpha,
            "alpha_measured": measured,
            "bounds": bounds(profile(target_name), profile(draft_name), measured, 128),
            "samples": samples,
        }
        with ExitStack() as stack:
            draft, target = start_services(pair, target_path, draft_path, cell_logs, stack)
            run_modes(draft, target, pair, modes, config, cell_logs, samples, f"{pair_name} α {measured:.2f}")
            cell["overruns"] = overruns(draft, target)
        # α as the run met it: how often a chain round's first draft was accepted (greedy, fixed K).
        chains = [s for s in samples if s["mode"].startswith("sequential K=") and s["temperature"] == 0.0]
        if chains:
            alpha_run = sum(s["first_accepted"] for s in chains) / max(1, sum(s["drafted_rounds"] for s in chains))
            cell["alpha_run"] = alpha_run
            cell["bounds"] = bounds(profile(target_name), profile(draft_name), alpha_run, 128)
        results["cells"].append(cell)
    return results


def ideal(cell: dict, mode_name: str, tokens_per_round: float) -> float | None:
    """× target-only that a sequential round of this mode's K would give with no framework cost at
    the tokens per round it met: tokens_per_round · T(1) / (K · d + T(K + 1)). None for other modes."""
    k = next((m.k for m in MODES if m.name == mode_name and m.coordinator == "sequential" and not m.tree), None)
    if k is None:
        return None
    target, draft = profile(cell["target_profile"]), profile(cell["draft_profile"])
    return tokens_per_round * target.ms(1, 128) / (k * draft.ms(1, 128) + target.ms(k + 1, 128))


def summarise(cell: dict, temperature: float) -> list[dict]:
    """The rows at this temperature, each against target-only at it; none where target-only
    did not run at it (a run of greedy modes alone has no sampled rows to compare)."""
    samples = [s for s in cell["samples"] if s["temperature"] == temperature]
    base = next((s["tokens_per_s"] for s in samples if s["mode"].startswith("target-only")), None)
    if base is None:
        return []
    fixed = [s for s in cell["samples"] if s["mode"].startswith("sequential K=") and s["temperature"] == 0.0]
    best_sequential = max(fixed, key=lambda s: s["tokens_per_s"]) if fixed else None
    rows = []
    for s in samples:
        row = {**s, "vs_target_only": s["tokens_per_s"] / base}
        perfect = ideal(cell, s["mode"], s["tokens_per_round"])
        if perfect is not None:
            row["efficiency"] = row["vs_target_only"] / perfect
        if best_sequential is not None and temperature == 0.0:
            row["vs_best_sequential"] = s["tokens_per_s"] / best_sequential["tokens_per_s"]
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    machine = results["machine"]
    lines = [
        f"Emulated accelerators (`--suite accelerator`), {machine['date']}: {machine['cpu']} ({machine['cpu_flags']}),"
        f" {machine['cores']} cores, torch {machine['torch']}. Every figure below is EMULATED: tiny models whose passes"
        " are held to pass-cost profiles (bench/profiles/: published H100 figures, or a card our runners were"
        " measured on); the draft and the target pinned to a core each, one torch thread, loopback links.",
        "",
    ]
    for cell in results["cells"]:
        b, alpha = cell["bounds"], cell.get("alpha_run")
        # Without a greedy fixed-K sequential mode the run meets no α of its own: the teacher-forced one.
        met = (
            f"α {alpha:.2f} as the run met it (a chain round's first draft accepted)"
            if alpha is not None
            else "No greedy fixed-K chain ran, so the run met no α of its own"
        )
        lines += [
            f"### {cell['target_profile']} target, {cell['draft_profile']} draft, "
            f"α {cell['alpha_measured'] if alpha is None else alpha:.2f}",
            "",
            f"{met}; the pair was built for {cell['alpha_target']}, measured "
            f"{cell['alpha_measured']:.2f} teacher-forced. "
            f"Target pass {b['target_pass_ms']:.1f} ms, draft step {b['draft_step_ms']:.2f} ms "
            f"(c = {b['draft_step_ms'] / b['target_pass_ms']:.2f}). Bounds over target-only: sequential "
            f"{b['sequential']:.2f}× (K = {b['sequential_k']}), fully overlapped {b['overlapped']:.2f}× "
            f"(K = {b['overlapped_k']}). Emulation overruns: draft {cell['overruns']['draft']}, target "
            f"{cell['overruns']['target']}.",
            "",
            "| mode | T | tok/s | × target-only | × best sequential K | ÷ sequential bound "
            "| ÷ ideal at its tokens/round | tokens/round | acceptance | overhead share of a round |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for temperature in (0.0, SAMPLED):
            for row in summarise(cell, temperature):
                versus = f"{row['vs_best_sequential']:.2f}×" if "vs_best_sequential" in row else ""
                efficiency = f"{row['efficiency']:.2f}" if "efficiency" in row else ""
                lines.append(
                    f"| {row['mode']} | {temperature:g} | {row['tokens_per_s']:.1f} | {row['vs_target_only']:.2f}× | "
                    f"{versus} | {row['vs_target_only'] / b['sequential']:.2f} | {efficiency} | "
                    f"{row['tokens_per_round']:.2f} | "
                    f"{row['acceptance']:.2f} | {row['overhead_share'] * 100:.0f}% |"
                )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, out_dir: Path) -> str | None:
    """Speedup over target-only against α, per pair: the best sequential, the best overlapped
    mode, and the two bounds as curves."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for pair_name in dict.fromkeys(cell["pair"] for cell in results["cells"]):
        cells = [c for c in results["cells"] if c["pair"] == pair_name]
        target, draft = profile(cells[0]["target_profile"]), profile(cells[0]["draft_profile"])
        alphas = [0.5 + 0.45 * i / 40 for i in range(41)]
        curves = [bounds(target, draft, a, 128) for a in alphas]
        (line,) = axis.plot(alphas, [c["sequential"] for c in curves], "--", label=f"{pair_name} sequential bound")
        axis.plot(
            alphas,
            [c["overlapped"] for c in curves],
            ":",
            color=line.get_color(),
            label=f"{pair_name} overlapped bound",
        )
        for kind, marker in (("sequential K=", "o"), ("pipelined", "^")):
            xs, ys = [], []
            for cell in cells:
                rows = [r for r in summarise(cell, 0.0) if r["mode"].startswith(kind)]
                if rows:
                    xs.append(cell.get("alpha_run", cell["alpha_measured"]))
                    ys.append(max(r["vs_target_only"] for r in rows))
            axis.plot(xs, ys, marker, color=line.get_color(), label=f"{pair_name} best {kind.rstrip(' K=')}")
    axis.set_xlabel("α (draft's greedy agreement)")
    axis.set_ylabel("× target-only (emulated)")
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    path = out_dir / "speedup-vs-alpha.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path.name


LINK_CELL = ("70b+1b", 0.8)
LINK_MODES = [
    m
    for m in MODES
    if m.name
    in (
        "target-only (K=0)",
        "sequential K=6",
        "sequential, K chooser",
        "pipelined, K chooser",
        "pipelined+2 hedges K=4",
        "pipelined, all hedged K=6",
    )
]


# Where the coordinator runs: on a host of its own (every round crosses two links), or on the
# target's host (the usual deployment: only the draft's calls cross a link).
TOPOLOGIES = {"three hosts": "coordinator", "coordinator on the target's host": "target"}


def run_links(config, machine: dict, delays_ms: tuple[float, ...]) -> dict:
    """`--suite links`: the 70B/1B profile at α ≈ 0.8 with the services on separate network
    hosts (specdec.tools.testbed), in each topology, every link at each one-way delay in turn.
    The figures are the coordinator's own (GenerationStats.total_ms), so the benchmark's link
    to the coordinator does not enter them."""
    problem = available()
    if problem:
        raise SystemExit(f"--suite links needs separate network hosts, and none can be built here: {problem}")
    pair_name, alpha = LINK_CELL
    pair, measured = pair_with_acceptance(ROOT / ".cache/bench-accelerator", alpha)
    target_name, draft_name = PAIRS[pair_name]
    results: dict = {
        "suite": "links",
        "machine": machine,
        "emulated": True,
        "pair": pair_name,
        "target_profile": target_name,
        "draft_profile": draft_name,
        "alpha_measured": measured,
        "links": [],
    }
    for delay_ms in delays_ms:
        for topology, coordinator_host in TOPOLOGIES.items():
            samples: list[dict] = []
            logs = config.out_dir / "logs" / f"link-{delay_ms:g}ms-{coordinator_host}"
            delay = LinkDelay(delay_ms)
            hosts = dict.fromkeys(("draft", "target", coordinator_host), delay)
            with ExitStack() as stack, Testbed(hosts) as bed:
                draft, target = start_services(
                    pair, PROFILES / f"{target_name}.json", PROFILES / f"{draft_name}.json", logs, stack, bed
                )
                label = f"{delay_ms:g} ms links, {topology}:"
                run_modes(draft, target, pair, LINK_MODES, config, logs, samples, label, bed, coordinator_host)
                results["links"].append(
                    {
                        "delay_ms": delay_ms,
                        "topology": topology,
                        "samples": samples,
                        "overruns": overruns(draft, target),
                    }
                )
    return results


def links_markdown(results: dict) -> str:
    machine = results["machine"]
    delays = list(dict.fromkeys(link["delay_ms"] for link in results["links"]))
    first, last = delays[0], delays[-1]
    lines = [
        f"Separate network hosts (`--suite links`), {machine['date']}: {machine['cpu']} ({machine['cpu_flags']}), "
        f"{machine['cores']} cores, torch {machine['torch']}. EMULATED accelerators: the {results['target_profile']} "
        f"target and the {results['draft_profile']} draft profiles (bench/profiles/) on a tiny pair of α "
        f"{results['alpha_measured']:.2f} (teacher-forced). Each service runs in its own network namespace (the "
        "coordinator in its own, or on the target's host); every link holds each byte for the one-way delay given, "
        "in each direction (a user-space forwarder, which adds about 0.1 ms of its own each way). tok/s from the "
        "coordinator's own request times. Emulation overruns (draft/target): "
        + ", ".join(
            f"{link['delay_ms']:g} ms {link['topology']} {link['overruns']['draft']}/{link['overruns']['target']}"
            for link in results["links"]
        )
        + ".",
        "",
    ]
    for topology in dict.fromkeys(link["topology"] for link in results["links"]):
        by_delay = {
            link["delay_ms"]: {(s["mode"], s["temperature"]): s["tokens_per_s"] for s in link["samples"]}
            for link in results["links"]
            if link["topology"] == topology
        }
        lines += [
            f"### {topology}",
            "",
            "| mode | T | " + " | ".join(f"{d:g} ms links, tok/s" for d in delays) + f" | {last:g} ms ÷ {first:g} ms |",
            "|---|---|" + "---|" * len(delays) + "---|",
        ]
        for (mode, temperature), rate in by_delay[first].items():
            rates = [by_delay.get(d, {}).get((mode, temperature)) for d in delays]
            cells = " | ".join(f"{r:.1f}" if r is not None else "" for r in rates)
            ratio = f"{rates[-1] / rate:.2f}" if rates[-1] else ""
            lines.append(f"| {mode} | {temperature:g} | {cells} | {ratio} |")
        lines.append("")
    return "\n".join(lines)
