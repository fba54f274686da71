"""`python -m bench.rules_coordinator rule:NAME=on|off ... COORDINATOR ARGS`: the coordinator
with other round rules (coordinator.rounds.RoundRules), for the benchmarks that compare
against them: rule:catch_up=off (pipelined rounds wait for fresh drafts), rule:live_costs=off
(the K chooser uses the calibrated pass costs only). They are not coordinator flags: the
defaults were measured better where they act. A benchmark puts the rule words among a
variant's coordinator arguments; `coordinator_module` names the module that reads them."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from coordinator.rounds import RoundRules
from coordinator.server import main as coordinator_main

PREFIX = "rule:"
RULES = {item.name for item in dataclasses.fields(RoundRules)}


def rules_and_args(argv: Sequence[str]) -> tuple[RoundRules, list[str]]:
    """The rules the `rule:` words set, and the coordinator's own arguments (the rest)."""
    values, args = {}, []
    for word in argv:
        if not word.startswith(PREFIX):
            args.append(word)
            continue
        name, _, value = word.removeprefix(PREFIX).partition("=")
        if name not in RULES or value not in ("on", "off"):
            raise SystemExit(f"{word!r}: give {PREFIX}NAME=on|off with NAME one of {sorted(RULES)}")
        values[name] = value == "on"
    return RoundRules(**values), args


def coordinator_module(args: Sequence[str]) -> str:
    """The module to run a coordinator variant's arguments with."""
    return "bench.rules_coordinator" if any(word.startswith(PREFIX) for word in args) else "coordinator"


def main(argv: Sequence[str]) -> None:
    rules, args = rules_and_args(argv)
    coordinator_main(args, rules)


if __name__ == "__main__":
    main(sys.argv[1:])
