"""python -m bench: run the benchmark, write results.json, table.md and plots, print the table.
`python -m bench report DIR` re-summarises a finished run."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from bench import accelerator, concurrency, overhead
from bench.harness import load_prompts, machine_info, parse_args, run_bench
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
    elif config.suite == "concurrency":
        torch.set_num_threads(config.threads)
        results = concurrency.run_concurrency(config, load_prompts(config), machine_info(config))
    else:
        results = run_bench(config)
    return _write(results, config.out_dir)


def _write(results: dict, out_dir: Path) -> int:
    if results.get("suite") == "overhead":
        return overhead.write(results, out_dir)
    if results.get("suite") == "accelerator":
        return accelerator.write(results, out_dir)
    if results.get("suite") == "concurrency":
        return _write_concurrency(results, out_dir)
    summary = summarise(results)
    results["summary"] = {str(t): rows for t, rows in summary.items()}
    table = markdown_table(summary, results["machine"], by_kind(results))
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.md").write_text(table + "\n")
    plots = plot(summary, out_dir)
    print("\n" + table)
    print(f"results: {out_dir}/results.json, table.md, {', '.join(plots)}")
    return 0


def _write_concurrency(results: dict, out_dir: Path) -> int:
    rows = concurrency.summarise(results)
    results["summary"] = rows
    table = concurrency.markdown_table(rows, results["machine"], results["config"])
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.md").write_text(table)
    plots = concurrency.plot(rows, out_dir)
    print("\n" + table)
    print(f"results: {out_dir}/results.json, table.md, {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
