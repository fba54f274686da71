"""Turns benchmark samples into per-mode figures, a Markdown table and plots.

Throughput per repeat is Σ tokens / Σ time over all prompts, so long and short prompts weigh by
their tokens; the median and range are over repeats. Ratios are taken between modes of the same
run and temperature: the median over repeats of each repeat's ratio, where both modes ran the
same repeats (a repeat runs every mode on each prompt in turn, so the machine's drift between
repeats cancels), else the ratio of the medians.

Theoretical speedup (Leviathan et al.): S = (1 − α^(K+1)) / ((1 − α)(K·c + 1)). There α is the
per-token acceptance probability: a draft token is only evaluated if every earlier one in its
round was accepted, so α is estimated as Σ accepted / Σ drafts evaluated (each round's, from
its K and its accepted count: the geometric model's maximum-likelihood estimate, whatever K
each round had). Plain accepted/proposed, the "acceptance" column, also counts positions never
evaluated and understates α for large K. Tree rounds have no chain α, so tree rows show no α
and no bound. c = draft step time / target step time, both measured inside the services in
this run (draft: compute per proposed token; target: compute per K=0 round).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.modes import HF_TARGET_ONLY, OURS_TARGET_ONLY  # noqa: E402


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    if k == 0:
        return 1.0
    expected_tokens = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected_tokens / (k * c + 1)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(results: dict) -> dict[float, list[dict]]:
    """{temperature: [row per mode]} in mode order."""
    modes = results["modes"]
    by_key: dict[tuple[float, str], list[dict]] = defaultdict(list)
    for sample in results["samples"]:
        by_key[sample["temperature"], sample["mode"]].append(sample)
    summary: dict[float, list[dict]] = {}
    for temperature in sorted({s["temperature"] for s in results["samples"]}):
        rows = []
        for mode in modes:
            samples = by_key[temperature, mode["name"]]
            per_repeat: dict[int, list[dict]] = defaultdict(list)
            for s in samples:
                per_repeat[s["repeat"]].append(s)
            throughput = [
                sum(s["tokens"] for s in group) / (sum(s["total_ms"] for s in group) / 1e3)
                for group in per_repeat.values()
            ]
            proposed = sum(s["proposed"] for s in samples)
            accepted = sum(s["accepted"] for s in samples)
            rounds = sum(s["rounds"] for s in samples)
            per_position, alpha = _acceptance(samples)
            row = {
                "mode": mode["name"],
                "family": mode["family"],
                "k": mode["k"],
                "drafter": mode.get("drafter", "model"),
                "tokens_per_s": _median(throughput),
                "repeat_tokens_per_s": dict(zip(per_repeat, throughput)),
                "tokens_per_s_min": min(throughput) if throughput else None,
                "tokens_per_s_max": max(throughput) if throughput else None,
                "acceptance": accepted / proposed if proposed else None,
                "alpha": alpha,
                "mean_accepted_length": (accepted + rounds) / rounds if rounds and mode["family"] == "ours" else None,
                "per_position_acceptance": per_position,
                "ttft_ms": _median([s["ttft_ms"] for s in samples]),
                "tpot_ms": _median(
                    [(s["total_ms"] - s["ttft_ms"]) / (s["tokens"] - 1) for s in samples if s["tokens"] > 1]
                ),
                "overhead_per_round_ms": _median([_overhead(s) / s["rounds"] for s in samples if s["rounds"]])
                if mode["family"] == "ours"
                else None,
                "degraded": sum(bool(s.get("degraded")) for s in samples),
                "requests": len(samples),
                "predraft_hit_rate": _ratio(samples, "predraft_hits", "predrafts"),
                "predraft_cancel_rate": _ratio(samples, "predraft_cancelled", "predrafts"),
                "hedge_hit_rate": _ratio(samples, "hedge_hits", "hedges"),  # per hedge started
                "rejections_hedged": _ratio(samples, "hedge_hits", "recovered")
                if any(s.get("hedges") for s in samples)
                else None,
                # K per round, catch-up steps (target-only rounds of a pipelined K) left out.
                "mean_k": sum(k for s in samples for k in s.get("k_per_round", []))
                / sum(len(s.get("k_per_round", [])) - s.get("catch_up_rounds", 0) for s in samples)
                if any(len(s.get("k_per_round", [])) > s.get("catch_up_rounds", 0) for s in samples)
                else None,
                "draft_step_ms": sum(s["draft_compute_ms"] for s in samples) / proposed if proposed else None,
                "target_round_ms": sum(s["target_compute_ms"] for s in samples) / rounds if rounds else None,
                **_round_split(samples, rounds),
            }
            rows.append(row)
        _add_ratios(rows)
        summary[temperature] = rows
    return summary


def _acceptance(samples: list[dict]) -> tuple[list[float], float | None]:
    """Per-position acceptance (of the rounds that proposed draft i, the share that accepted
    it) and α, the geometric model's maximum-likelihood estimate: Σ accepted / Σ drafts the
    target evaluated (a round evaluates its drafts up to and including the first rejection).
    Per round from k_per_round and accepted_per_round; results without accepted_per_round
    give α only where every drafted round proposed the same K (a varying K cannot be told
    apart from rejections there)."""
    proposed: list[int] = []  # index i: rounds that proposed draft i
    accepted: list[int] = []  # ... and accepted it
    evaluated = 0
    known = True
    for s in samples:
        known = known and not s.get("tree_rounds")
        ks = s.get("k_per_round") or [max(len(s["accepted_per_position"]), 1)] * s["rounds"]
        for k in ks:
            proposed.extend([0] * (k - len(proposed)))
            for i in range(k):
                proposed[i] += 1
        per_round = s.get("accepted_per_round")
        if per_round and len(per_round) == len(ks):
            evaluated += sum(min(a + 1, k) for k, a in zip(ks, per_round) if k)
        else:
            known = known and len({k for k in ks if k}) <= 1
            # Every drafted round evaluates its first draft, then one more per accepted draft
            # short of K: Σ accepted at i over positions before the last.
            k = max(ks, default=0)
            evaluated += sum(1 for x in ks if x) + sum(s["accepted_per_position"][: max(k - 1, 0)])
        for i, count in enumerate(s["accepted_per_position"]):
            accepted.extend([0] * (i + 1 - len(accepted)))
            accepted[i] += count
    per_position = [accepted[i] / proposed[i] if i < len(accepted) else 0.0 for i in range(len(proposed))]
    return per_position, sum(accepted) / evaluated if known and evaluated else None


def _overhead(sample: dict) -> float:
    """The framework's time in a request: the coordinator's own round_overhead_ms where the
    sample has it (round time less the services' model work, pre-drafts the round waited for
    included: GenerationStats.work_ms_since), else total less the calls' compute."""
    if sample.get("overhead_ms") is not None:
        return sample["overhead_ms"]
    return sample["total_ms"] - sample["draft_compute_ms"] - sample["target_compute_ms"]


def _round_split(samples: list[dict], rounds: int) -> dict:
    """Where a round's time goes (ours): waiting on the verify, the draft on the critical path
    (draft calls plus waits on pre-draft/hedge replies), and the rest; the ready rate (rounds
    after the first whose drafts came from a branch) and wasted branch drafts per round."""
    speculating = [s for s in samples if s.get("predrafts") or s.get("hedges")]
    if not rounds:
        return {
            "verify_ms": None,
            "draft_critical_ms": None,
            "other_ms": None,
            "ready_rate": None,
            "wasted_per_round": None,
            "catch_up_rate": None,
        }
    verify = sum(s.get("target_ms", 0.0) for s in samples) / rounds
    draft = sum(s.get("draft_ms", 0.0) + s.get("branch_wait_ms", 0.0) for s in samples) / rounds
    total = sum(s["total_ms"] for s in samples) / rounds
    follow = sum(max(s["rounds"] - 1, 0) for s in speculating)
    speculating_rounds = sum(s["rounds"] for s in speculating)
    return {
        "verify_ms": verify,
        "draft_critical_ms": draft,
        "other_ms": total - verify - draft,
        "ready_rate": sum(s.get("ready_rounds", 0) for s in speculating) / follow if follow else None,
        "wasted_per_round": sum(
            s.get("predraft_wasted_tokens", 0) + s.get("hedge_wasted_tokens", 0) for s in speculating
        )
        / speculating_rounds
        if speculating
        else None,
        "catch_up_rate": sum(s.get("catch_up_rounds", 0) for s in speculating) / speculating_rounds
        if speculating
        else None,
    }


def _ratio(samples: list[dict], numerator: str, denominator: str) -> float | None:
    total = sum(s.get(denominator, 0) for s in samples)
    return sum(s.get(numerator, 0) for s in samples) / total if total else None


def by_kind(results: dict) -> dict[float, dict[str, dict[str, float]]]:
    """{temperature: {mode: {prompt kind: tokens/s over all repeats}}}: where each drafter pays."""
    tokens: dict[tuple[float, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in results["samples"]:
        entry = tokens[s["temperature"], s["mode"], s["kind"]]
        entry[0] += s["tokens"]
        entry[1] += s["total_ms"] / 1e3
    table: dict[float, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for (temperature, mode, kind), (count, seconds) in tokens.items():
        table[temperature][mode][kind] = count / seconds
    return table


def _speedup(row: dict, base: dict) -> float | None:
    """row's tokens/s over base's: the median of the repeats' ratios where they share repeats."""
    shared = [
        row["repeat_tokens_per_s"][r] / base["repeat_tokens_per_s"][r]
        for r in row.get("repeat_tokens_per_s", {})
        if base.get("repeat_tokens_per_s", {}).get(r)
    ]
    if shared:
        return statistics.median(shared)
    return row["tokens_per_s"] / base["tokens_per_s"] if row["tokens_per_s"] and base["tokens_per_s"] else None


def _add_ratios(rows: list[dict]) -> None:
    by_mode = {row["mode"]: row for row in rows}
    assisted = [row for row in rows if row["family"] == "hf" and row["mode"] != HF_TARGET_ONLY and row["tokens_per_s"]]
    best_assisted = max(assisted, key=lambda row: row["tokens_per_s"]) if assisted else None
    target_step = by_mode[OURS_TARGET_ONLY]["target_round_ms"]
    for row in rows:
        row["speedup_vs_target_only"] = _speedup(row, by_mode[OURS_TARGET_ONLY])
        row["speedup_vs_hf_assisted"] = _speedup(row, best_assisted) if best_assisted else None
        row["best_hf_assisted"] = best_assisted["mode"] if best_assisted else None
        if row["family"] == "ours" and row["k"] and row["alpha"] is not None and target_step and row["draft_step_ms"]:
            c = row["draft_step_ms"] / target_step
            row["cost_ratio_c"] = c
            row["theoretical_speedup"] = theoretical_speedup(row["alpha"], row["k"], c)
            row["achieved_over_theoretical"] = row["speedup_vs_target_only"] / row["theoretical_speedup"]
        else:
            row["cost_ratio_c"] = row["theoretical_speedup"] = row["achieved_over_theoretical"] = None


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _kind_table(per_mode: dict[str, dict[str, float]], modes: list[str]) -> list[str]:
    kinds = list(per_mode.get(OURS_TARGET_ONLY, {}))
    base = per_mode.get(OURS_TARGET_ONLY, {})
    lines = [
        "",
        "tokens/s by prompt kind (× ours target-only on the same prompts):",
        "",
        "| Mode | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for mode in modes:
        cells = []
        for kind in kinds:
            tps = per_mode.get(mode, {}).get(kind)
            cells.append(f"{_fmt(tps)} ({_fmt(tps / base[kind] if tps and base.get(kind) else None, suffix='×')})")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def markdown_table(summary: dict[float, list[dict]], machine: dict, kinds: dict | None = None) -> str:
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores, device {machine['device']}"
        + (f" ({machine['gpu']})" if machine.get("gpu") else "")
        + f"; torch {machine['torch']}, transformers {machine['transformers']}; "
        + f"{machine['threads']['in_process_hf']} threads per mode; {machine['date']}",
        "",
    ]
    if machine.get("cpu_flags"):
        lines += [f"CPU flags: {machine['cpu_flags']}", ""]
    if machine.get("target_setting"):
        lines += ["Target setting:", "", machine["target_setting"], ""]
    for temperature, rows in summary.items():
        lines += [
            f"**{'greedy' if temperature == 0 else f'temperature {temperature}'}**",
            "",
            "| Mode | tok/s (median, range) | vs ours K=0 | vs best HF assisted | acceptance | α | tokens/round | "
            "per-position acceptance | TTFT ms | TPOT ms | overhead/round ms | c | theoretical | achieved/theoretical "
            "|",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            positions = " ".join(f"{p:.2f}" for p in row["per_position_acceptance"]) or "—"
            lines.append(
                f"| {row['mode']} | {_fmt(row['tokens_per_s'])} "
                f"({_fmt(row['tokens_per_s_min'])}–{_fmt(row['tokens_per_s_max'])}) "
                f"| {_fmt(row['speedup_vs_target_only'], suffix='×')} | "
                f"{_fmt(row['speedup_vs_hf_assisted'], suffix='×')} "
                f"| {_fmt(row['acceptance'])} | {_fmt(row['alpha'])} | {_fmt(row['mean_accepted_length'])} | "
                f"{positions} "
                f"| {_fmt(row['ttft_ms'], '.0f')} | {_fmt(row['tpot_ms'], '.0f')} | "
                f"{_fmt(row['overhead_per_round_ms'], '.1f')} "
                f"| {_fmt(row['cost_ratio_c'])} | {_fmt(row['theoretical_speedup'], suffix='×')} | "
                f"{_fmt(row['achieved_over_theoretical'], '.0%')} |"
            )
        degraded = [f"{row['mode']} {row['degraded']} of {row['requests']}" for row in rows if row.get("degraded")]
        if degraded:
            lines += [
                "",
                "**Degraded requests** (the draft failed or was skipped, so some of their rounds ran "
                "target-only; they are in the figures above): " + "; ".join(degraded) + ".",
            ]
        pipelined = [
            row
            for row in rows
            if row["predraft_hit_rate"] is not None
            or row.get("hedge_hit_rate") is not None
            or (row["mean_k"] and row["k"] == 0)
        ]
        if pipelined:
            lines += [
                "",
                "| Mode | mean K | pre-drafts used | pre-drafts cancelled (rejection) | hedges used | rejected rounds "
                "hedged |",
                "|---|---|---|---|---|---|",
            ]
            for row in pipelined:
                lines.append(
                    f"| {row['mode']} | {_fmt(row['mean_k'])} | {_fmt(row['predraft_hit_rate'], '.0%')} | "
                    f"{_fmt(row['predraft_cancel_rate'], '.0%')} "
                    f"| {_fmt(row.get('hedge_hit_rate'), '.0%')} | {_fmt(row.get('rejections_hedged'), '.0%')} |"
                )
        split = [row for row in rows if row["family"] == "ours" and row.get("verify_ms") is not None]
        if split and any(row.get("ready_rate") is not None for row in split):
            lines += [
                "",
                "Round time split (ms per round, medians are not used: Σ over all rounds / rounds; verify "
                "includes the prompt's prefill, shared by fewer rounds the more tokens a round carries) and "
                "branch use (catch-up steps: target-only rounds while the draft drafted the next):",
                "",
                "| Mode | verify | draft on critical path | other (overhead) | ready rate | catch-up steps | "
                "wasted branch drafts/round |",
                "|---|---|---|---|---|---|---|",
            ]
            for row in split:
                lines.append(
                    f"| {row['mode']} | {_fmt(row['verify_ms'], '.0f')} | {_fmt(row['draft_critical_ms'], '.0f')} | "
                    f"{_fmt(row['other_ms'], '.0f')} "
                    f"| {_fmt(row.get('ready_rate'), '.0%')} | {_fmt(row.get('catch_up_rate'), '.0%')} "
                    f"| {_fmt(row.get('wasted_per_round'))} |"
                )
        if kinds and temperature in kinds:
            lines += _kind_table(kinds[temperature], [row["mode"] for row in rows])
        fastest = max((r for r in rows if r["family"] == "ours"), key=lambda r: r["tokens_per_s"] or 0, default=None)
        if fastest and fastest["speedup_vs_hf_assisted"] is not None:
            lines += [
                "",
                f"Fastest of ours: {fastest['mode']}, {_fmt(fastest['tokens_per_s'])} tok/s: "
                f"{_fmt(fastest['speedup_vs_hf_assisted'], suffix='×')} {fastest['best_hf_assisted']}, "
                f"{_fmt(fastest['speedup_vs_target_only'], suffix='×')} ours target-only.",
            ]
        best = max(
            (r for r in rows if r["family"] == "ours" and r["k"]), key=lambda r: r["tokens_per_s"] or 0, default=None
        )
        if best:
            lines += [
                "",
                f"Best K = {best['k']}: {_fmt(best['speedup_vs_target_only'], suffix='×')} ours target-only, "
                f"{_fmt(best['speedup_vs_hf_assisted'], suffix='×')} {best['best_hf_assisted']}, "
                f"{_fmt(best['achieved_over_theoretical'], '.0%')} of theoretical, "
                f"{_fmt(best['overhead_per_round_ms'], '.1f')} ms overhead per round.",
            ]
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict[float, list[dict]], out_dir) -> list[str]:
    """tokens/s vs K and acceptance vs K, one panel per temperature; baselines as lines."""
    written = []
    for metric, ylabel, filename in (
        ("tokens_per_s", "tokens/s (median over repeats)", "tokens_per_s_vs_k.png"),
        ("acceptance", "acceptance rate", "acceptance_vs_k.png"),
    ):
        fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
        for ax, (temperature, rows) in zip(axes[0], summary.items()):
            ours = [r for r in rows if r["family"] == "ours" and r["k"] and r[metric] is not None]
            drafters = list(dict.fromkeys(r["drafter"] for r in ours))
            for drafter in drafters:
                points = [r for r in ours if r["drafter"] == drafter]
                label = "ours (sequential)" if drafters == ["model"] else f"ours, {drafter} drafter"
                ax.plot([r["k"] for r in points], [r[metric] for r in points], "o-", label=label)
            if metric == "tokens_per_s":
                baselines = [r for r in rows if not (r["family"] == "ours" and r["k"])]
                styles = zip(
                    ("--", ":", "-.", (0, (3, 1, 1, 1)), (0, (1, 1))),
                    ("black", "tab:orange", "tab:green", "tab:red", "tab:purple"),
                )
                for r, (style, color) in zip(baselines, styles):
                    if r["tokens_per_s"]:
                        ax.axhline(r["tokens_per_s"], linestyle=style, color=color, label=r["mode"])
            ax.set_xlabel("K (draft tokens per round)")
            ax.set_ylabel(ylabel)
            ax.set_title("greedy" if temperature == 0 else f"temperature {temperature}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=110)
        plt.close(fig)
        written.append(filename)
    return written
