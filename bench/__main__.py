"""python -m bench: run the benchmark, write results.json, table.md and plots, print the table.
`python -m bench report DIR` re-summarises a finished run."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from bench import accelerator, concurrency, drafts, live_costs, multiturn, overhead, pools, relaxed
from bench.harness import load_prompts, machine_info, parse_args, run_bench
from bench.plots import plot_suite
from bench.report import by_kind, markdown_table, plot, summarise


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        # python -m bench report DIR: re-summarise a finished run's samples without re-running it.
        out_dir = Path(argv[1])
        results = json.loads((out_dir / "results.json").read_text())
        return _write(results, out_dir)
    config = parse_args(argv)
    if config.suite == "overhead":
        results = overhead.run_overhead(config, load_prompts(config), machine_info(config))
    elif config.suite == "accelerator":
        results = accelerator.run_accelerator(config, machine_info(config), quick=config.quick)
    elif config.suite == "links":
        results = accelerator.run_links(config, machine_info(config), config.link_ms)
    elif config.suite == "pools":
        results = pools.run_pools(config, machine_info(config), tuple(config.pools_parts))
    elif config.suite == "multiturn":
        results = multiturn.run_multiturn(config, machine_info(config))
    elif config.suite == "live-costs":
        results = live_costs.run_live_costs(config, machine_info(config))
    elif config.suite == "relaxed":
        results = relaxed.run_relaxed(config, machine_info(config))
    elif config.suite == "drafts":
        results = drafts.run_drafts(config, machine_info(config))
    elif config.suite == "concurrency":
        torch.set_num_threads(config.threads)
        results = concurrency.run_concurrency(config, load_prompts(config), machine_info(config))
    else:
        results = run_bench(config)
    return _write(results, config.out_dir)


def _write(results: dict, out_dir: Path) -> int:
    if results.get("suite") == "overhead":
        rows = overhead.summarise(results)
        results["summary"] = rows
        return _save(
            results,
            overhead.markdown_table(rows, results["machine"], results.get("floor_ms"), results.get("floor_cpu_ms")),
            out_dir,
        )
    if results.get("suite") == "accelerator":
        return _save(results, accelerator.markdown(results), out_dir, accelerator.plot(results, out_dir))
    if results.get("suite") == "links":
        return _save(results, accelerator.links_markdown(results), out_dir, plot_suite(results, out_dir))
    if results.get("suite") == "multiturn":
        return _save(results, multiturn.markdown(results), out_dir, plot_suite(results, out_dir))
    if results.get("suite") == "live-costs":
        results["summary"] = live_costs.summarise(results)
        return _save(results, live_costs.markdown(results), out_dir)
    if results.get("suite") == "drafts":
        return _save(results, drafts.markdown(results), out_dir)
    if results.get("suite") == "pools":
        return _save(results, pools.markdown(results), out_dir, plot_suite(results, out_dir))
    if results.get("suite") == "relaxed":
        return _save(results, relaxed.markdown(results), out_dir)
    if results.get("suite") == "concurrency":
        rows = concurrency.summarise(results)
        results["summary"] = rows
        table = concurrency.markdown_table(rows, results["machine"], results["config"])
        return _save(results, table, out_dir, *concurrency.plot(rows, out_dir))
    summary = summarise(results)
    results["summary"] = {str(t): rows for t, rows in summary.items()}
    table = markdown_table(summary, results["machine"], by_kind(results))
    return _save(results, table, out_dir, *plot(summary, out_dir))


def _save(results: dict, table: str, out_dir: Path, *plots: str | None) -> int:
    """Every suite's output: results.json, table.md and its plots, the table printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.md").write_text(table.rstrip("\n") + "\n")
    print("\n" + table)
    print(f"results: {out_dir}/results.json, table.md" + "".join(f", {name}" for name in plots if name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
