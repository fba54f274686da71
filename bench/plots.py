"""Plots of the headline results: replica pools, multi-turn time to first token, separate network hosts.

`python -m bench.plots` redraws each from its committed results.json, next to it; `python -m bench`
draws a suite's plot when it writes that suite's results. The accelerator suite draws its own
(bench.accelerator.plot). What each plot shows comes from a pure `*_panels` function, so the tests
can hold it against results.json and table.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# The committed runs whose plots docs/benchmarks.md shows.
HEADLINES = ("pools", "pools-real-avx2", "multiturn", "multiturn-avx2", "cpu-links")
DPI = 100


@dataclass(frozen=True)
class Series:
    """One plotted line; low and high, where given, are each point's range over repeats."""

    label: str
    x: list[float]
    y: list[float]
    low: list[float] | None = None
    high: list[float] | None = None
    style: str = "o-"
    color: str | None = None


@dataclass(frozen=True)
class Panel:
    """One set of axes; its x ticks are the points' own x values."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    log_x: bool = False


def machine_label(machine: dict) -> str:
    """The machine as the docs tell the two CPUs apart: AVX-512 or AVX2 only."""
    flags = machine.get("cpu_flags", "").split()
    isa = "AVX-512" if any(f.startswith("avx512") for f in flags) else "AVX2 only" if "avx2" in flags else ""
    parts = [machine["cpu"], isa, f"{machine['cores']} cores", machine.get("gpu") or "no GPU", machine["date"][:10]]
    return ", ".join(p for p in parts if p)


def pools_panels(results: dict) -> list[Panel]:
    """`--suite pools`: aggregate tok/s against clients (emulated sweep; the real pair per drafter),
    and against target replicas (emulated scale); one panel for each part the run has."""
    emulated = f"emulated, α {results['alpha_measured']:.2f} pair on H100 profiles"
    if results.get("dilation", 1.0) != 1.0:
        emulated += f", time-dilated ×{results['dilation']:g}"
    panels = []
    if "sweep" in results:
        rows = results["sweep"]
        clients = [row["clients"] for row in rows]
        panels.append(
            Panel(
                f"1 target + 1 draft\n{emulated}",
                "concurrent clients",
                "aggregate tok/s",
                [
                    Series("defaults (K chooser)", clients, [row["chosen"]["tokens_per_s"] for row in rows]),
                    Series(
                        "K = 0 (target-only)",
                        clients,
                        [row["target_only"]["tokens_per_s"] for row in rows],
                        style="s--",
                    ),
                ],
                log_x=True,
            )
        )
    if "scale" in results:
        rows = results["scale"]
        panels.append(
            Panel(
                f"{rows[0]['clients']} clients, defaults\n{emulated}",
                "target replicas",
                "aggregate tok/s",
                [
                    Series(
                        f"{drafts} draft replica{'s' if drafts > 1 else ''}",
                        [row["targets"] for row in rows if row["drafts"] == drafts],
                        [row["tokens_per_s"] for row in rows if row["drafts"] == drafts],
                        style="o-" if drafts == 1 else "s",
                    )
                    for drafts in dict.fromkeys(row["drafts"] for row in rows)
                ],
            )
        )
    if "real" in results:
        rows = results["real"]
        repeats = len(rows[0]["chosen"])
        series = []
        for index, drafter in enumerate(dict.fromkeys(row.get("drafter", "int8") for row in rows)):
            mine = [row for row in rows if row.get("drafter", "int8") == drafter]
            for field, name, style in (("chosen", "defaults", "o-"), ("target_only", "K = 0", "s--")):
                series.append(
                    Series(
                        f"{drafter} drafter, {name}",
                        [row["clients"] for row in mine],
                        [statistics.median(row[field]) for row in mine],
                        [min(row[field]) for row in mine],
                        [max(row[field]) for row in mine],
                        style,
                        f"C{index}",
                    )
                )
        panels.append(
            Panel(
                f"real Qwen2.5-Coder 0.5B/1.5B pair, measured\nmedian of {repeats} repeats, bars their range",
                "concurrent clients",
                "aggregate tok/s",
                series,
                log_x=True,
            )
        )
    return panels


def multiturn_panels(results: dict) -> list[Panel]:
    """`--suite multiturn`: the edit conversations' mean time to first token at each turn, per
    stack (the K chooser's requests; the prefix-cache stacks dashed, one colour per drafter)."""
    edits = [s for s in results["samples"] if s["workload"] == "edits" and s["k"] is None]
    stacks = list(dict.fromkeys(s["stack"] for s in edits))
    drafters = list(dict.fromkeys(stack.split("+")[0] for stack in stacks))
    series = []
    for stack in stacks:
        turns = sorted({s["turn"] for s in edits if s["stack"] == stack})
        series.append(
            Series(
                stack,
                [turn + 1 for turn in turns],
                [statistics.mean(s["ttft_ms"] for s in edits if s["stack"] == stack and s["turn"] == t) for t in turns],
                style="s--" if "prefix" in stack else "o-",
                color=f"C{drafters.index(stack.split('+')[0])}",
            )
        )
    conversations = len({s["index"] for s in edits})
    return [
        Panel(
            f"{conversations} edit conversations, greedy, up to {results['max_new_tokens']} tokens a turn",
            "turn (each re-sends the whole conversation)",
            f"time to first token, ms (mean of {conversations})",
            series,
        )
    ]


def links_panels(results: dict) -> list[Panel]:
    """`--suite links`: greedy tok/s against the links' one-way delay, one line per mode, a panel
    per topology (where the coordinator runs), as the docs compare them; T = 0.7 stays in table.md."""
    panels = []
    for topology in dict.fromkeys(link["topology"] for link in results["links"]):
        links = sorted((link for link in results["links"] if link["topology"] == topology), key=lambda x: x["delay_ms"])
        rates = [{s["mode"]: s["tokens_per_s"] for s in link["samples"] if s["temperature"] == 0} for link in links]
        series = [
            Series(
                mode,
                [link["delay_ms"] for link, rate in zip(links, rates) if mode in rate],
                [rate[mode] for rate in rates if mode in rate],
                style="s--" if "K=0" in mode else "o-",
                color="black" if "K=0" in mode else None,
            )
            for mode in dict.fromkeys(mode for rate in rates for mode in rate)
        ]
        panels.append(Panel(f"{topology}, greedy", "one-way link delay, ms", "tok/s (emulated)", series, log_x=True))
    return panels


def draw(panels: list[Panel], title: str, path: Path) -> Path:
    """The panels side by side under one title, written as a PNG at path. Panels that plot the same
    series share one legend below them, off the lines."""
    shared = len(panels) > 1 and len({tuple(s.label for s in panel.series) for panel in panels}) == 1
    figure, axes = plt.subplots(
        1, len(panels), figsize=(max(5.2 * len(panels), 7.0), 4.7 if shared else 4.2), sharey=shared, squeeze=False
    )
    for axis, panel in zip(axes[0], panels):
        ranged = [s for s in panel.series if s.low is not None and s.high is not None]
        for s in panel.series:
            if s.low is not None and s.high is not None:
                # Series with ranges at the same x stand a little apart, so their bars do not hide each other.
                shift = 0.04 * (ranged.index(s) - (len(ranged) - 1) / 2)
                xs = [x * 2**shift if panel.log_x else x + shift for x in s.x]
                spread = [[y - lo for y, lo in zip(s.y, s.low)], [hi - y for y, hi in zip(s.y, s.high)]]
                axis.errorbar(xs, s.y, yerr=spread, fmt=s.style, color=s.color, label=s.label, capsize=3)
            else:
                axis.plot(s.x, s.y, s.style, color=s.color, label=s.label)
        if panel.log_x:
            axis.set_xscale("log", base=2 if all(float(x).is_integer() for s in panel.series for x in s.x) else 10)
        ticks = sorted({x for s in panel.series for x in s.x})
        axis.set_xticks(ticks, [f"{x:g}" for x in ticks])
        axis.minorticks_off()
        axis.margins(x=0.08)
        axis.set_ylim(0, 1.1 * max(y for p in (panels if shared else [panel]) for s in p.series for y in s.high or s.y))
        axis.set_xlabel(panel.xlabel)
        axis.set_ylabel(panel.ylabel)
        axis.set_title(panel.title, fontsize=9)
        axis.grid(alpha=0.3)
        if not shared:
            axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    if shared:
        handles, labels = axes[0][0].get_legend_handles_labels()
        figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    figure.tight_layout(rect=(0, 0.1 if shared else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return path


def plot_pools(results: dict, path: Path) -> Path:
    """`--suite pools` at path: one panel for each of the sweep, scale and real parts the run has."""
    return draw(pools_panels(results), f"Replica pools (--suite pools)\n{machine_label(results['machine'])}", path)


def plot_multiturn(results: dict, path: Path) -> Path:
    """`--suite multiturn` at path: the edit conversations' time to first token, turn by turn."""
    title = (
        "Multi-turn time to first token (--suite multiturn), measured: real Qwen2.5-Coder pair\n"
        f"{machine_label(results['machine'])}"
    )
    return draw(multiturn_panels(results), title, path)


def plot_links(results: dict, path: Path) -> Path:
    """`--suite links` at path: greedy tok/s against link delay, a panel per topology."""
    title = (
        f"Separate network hosts (--suite links), EMULATED {results['target_profile']} target + "
        f"{results['draft_profile']} draft, α {results['alpha_measured']:.2f}\n{machine_label(results['machine'])}"
    )
    return draw(links_panels(results), title, path)


# Each suite's headline plot, by the file name it takes beside results.json.
SUITE_PLOTS: dict[str, tuple[str, Callable[[dict, Path], Path]]] = {
    "pools": ("scaling.png", plot_pools),
    "multiturn": ("ttft-by-turn.png", plot_multiturn),
    "links": ("tokens-per-s-vs-link-delay.png", plot_links),
}


def plot_suite(results: dict, out_dir: Path) -> str | None:
    """The suite's headline plot in out_dir, and its file name; None for a suite without one, or
    a pools run with no part to plot (failover or kv alone)."""
    name, plot = SUITE_PLOTS.get(results.get("suite", ""), ("", None))
    if plot is None or (results["suite"] == "pools" and not pools_panels(results)):
        return None
    return plot(results, out_dir / name).name


def main() -> int:
    """Redraw every headline plot from its committed results.json."""
    for folder in HEADLINES:
        out_dir = RESULTS / folder
        name = plot_suite(json.loads((out_dir / "results.json").read_text()), out_dir)
        if name:
            print(f"{out_dir / name}: {(out_dir / name).stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
