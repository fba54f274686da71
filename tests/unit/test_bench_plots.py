"""The headline plots (bench.plots): each draws from its committed results.json, plots what table.md
says, and is shown in docs/benchmarks.md."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from bench.plots import HEADLINES, RESULTS, SUITE_PLOTS, links_panels, multiturn_panels, plot_suite, pools_panels

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
# table.md rounds tok/s to 0.1 and ms to 1.
TENTH = 0.051


def results(folder: str) -> dict:
    return json.loads((RESULTS / folder / "results.json").read_text())


def table_rows(folder: str, after: str) -> list[list[str]]:
    """The cells of the first Markdown table in folder's table.md after the line that holds `after`."""
    lines = (RESULTS / folder / "table.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[1:]  # past the header


def numbers(cell: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", cell)]


def series(panel) -> dict[str, tuple[list[float], list[float]]]:
    return {s.label: (s.x, s.y) for s in panel.series}


@pytest.mark.parametrize("folder", HEADLINES)
def test_each_headline_draws_a_png_from_its_results(folder, tmp_path):
    name = plot_suite(results(folder), tmp_path)
    assert name == SUITE_PLOTS[results(folder)["suite"]][0]
    data = (tmp_path / name).read_bytes()
    assert data.startswith(PNG)
    assert 10_000 < len(data) < 200_000


@pytest.mark.parametrize("folder", HEADLINES)
def test_each_headline_png_is_committed_and_shown_in_the_docs(folder):
    name = SUITE_PLOTS[results(folder)["suite"]][0]
    assert (RESULTS / folder / name).read_bytes().startswith(PNG)
    assert f"(../bench/results/{folder}/{name})" in (ROOT / "docs" / "benchmarks.md").read_text()


def test_pools_plots_the_sweep_the_scaling_and_the_real_pair_of_table_md():
    sweep, scale, real = pools_panels(results("pools"))
    rows = table_rows("pools", "Concurrency sweep")
    lines = series(sweep)
    assert lines["defaults (K chooser)"][0] == [int(row[0]) for row in rows]
    assert lines["defaults (K chooser)"][1] == pytest.approx([float(row[1]) for row in rows], abs=TENTH)
    assert lines["K = 0 (target-only)"][1] == pytest.approx([float(row[2]) for row in rows], abs=TENTH)
    rows = table_rows("pools", "Scaling, 32 clients")
    plotted = {(x, label): y for label, (xs, ys) in series(scale).items() for x, y in zip(xs, ys)}
    assert plotted == pytest.approx(
        {(int(row[0]), f"{row[1]} draft replica{'s' if row[1] != '1' else ''}"): float(row[2]) for row in rows},
        abs=TENTH,
    )
    assert "emulated" in sweep.title and "emulated" in scale.title and "measured" in real.title


@pytest.mark.parametrize("folder", ["pools", "pools-real-avx2"])
def test_pools_plots_the_real_pair_as_the_median_and_range_of_its_repeats(folder):
    panels = pools_panels(results(folder))
    real = panels[-1]
    if folder == "pools-real-avx2":
        assert len(panels) == 1  # that run had the real part only
    rows = table_rows(folder, "The real pair on this CPU")
    for s in real.series:
        drafter, _, mode = s.label.partition(" drafter, ")
        column = {"defaults": 2, "K = 0": 3}[mode]
        mine = [row for row in rows if row[0] == drafter]
        assert s.x == [int(row[1]) for row in mine]
        repeats = [numbers(row[column]) for row in mine]
        assert s.y == pytest.approx([statistics.median(r) for r in repeats], abs=TENTH)
        assert s.low == pytest.approx([min(r) for r in repeats], abs=TENTH)
        assert s.high == pytest.approx([max(r) for r in repeats], abs=TENTH)


@pytest.mark.parametrize("folder", ["multiturn", "multiturn-avx2"])
def test_multiturn_plots_time_to_first_token_by_turn_as_table_md_sums_it(folder):
    (panel,) = multiturn_panels(results(folder))
    summary = results(folder)["summary"]["ttft"]
    rows = {row[0]: row for row in table_rows(folder, "Time to first token, the edit conversations")}
    lines = series(panel)
    assert set(lines) == set(rows)
    for stack, (turns, ttft) in lines.items():
        assert turns == [1, 2, 3]
        # Three conversations at each turn, so turns 2-3's mean is the mean of turn 2's and turn 3's.
        assert ttft[0] == pytest.approx(summary[f"{stack} first"])
        assert statistics.mean(ttft[1:]) == pytest.approx(summary[f"{stack} later"])
        assert ttft[0] == pytest.approx(numbers(rows[stack][1])[0], abs=0.51)
        assert statistics.mean(ttft[1:]) == pytest.approx(numbers(rows[stack][2])[0], abs=0.51)


def test_links_plots_greedy_tok_s_against_the_delay_for_each_topology_as_table_md():
    panels = links_panels(results("cpu-links"))
    assert [p.title for p in panels] == ["three hosts, greedy", "coordinator on the target's host, greedy"]
    for panel, heading in zip(panels, ("### three hosts", "### coordinator on the target's host")):
        rows = {row[0]: row for row in table_rows("cpu-links", heading) if row[1] == "0"}
        lines = series(panel)
        assert set(lines) == set(rows)
        for mode, (delays, rates) in lines.items():
            assert delays == [0.05, 0.5, 2.0]
            assert rates == pytest.approx([float(cell) for cell in rows[mode][2:5]], abs=TENTH)
