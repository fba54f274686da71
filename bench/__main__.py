"""python -m bench: run the benchmark, write results.json, table.md and plots, print the table."""

from __future__ import annotations

import json
import logging
import sys

from bench.harness import parse_args, run_bench
from bench.report import markdown_table, plot, summarise


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    results = run_bench(config)
    summary = summarise(results)
    results["summary"] = {str(t): rows for t, rows in summary.items()}
    table = markdown_table(summary, results["machine"])
    (config.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (config.out_dir / "table.md").write_text(table + "\n")
    plots = plot(summary, config.out_dir)
    print("\n" + table)
    print(f"results: {config.out_dir}/results.json, table.md, {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
