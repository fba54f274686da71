"""bench.rules_coordinator: the benchmarks' round rules reach the coordinator, and nothing
else of its command line changes."""

from __future__ import annotations

import pytest

from bench.modes import COORDINATORS
from bench.rules_coordinator import coordinator_module, main, rules_and_args
from coordinator.rounds import RoundRules


def test_rule_words_set_the_rules_and_the_rest_is_the_coordinators():
    rules, args = rules_and_args(["--metrics-port", "0", "rule:catch_up=off", "--pipeline", "on", "rule:live_costs=on"])
    assert rules == RoundRules(catch_up=False, live_costs=True)
    assert args == ["--metrics-port", "0", "--pipeline", "on"]
    assert rules_and_args(["--pipeline", "on"]) == (RoundRules(), ["--pipeline", "on"])


@pytest.mark.parametrize("word", ["rule:catch_up=no", "rule:nothing=off", "rule:catch_up"])
def test_a_malformed_rule_stops_with_the_rules_named(word):
    with pytest.raises(SystemExit, match="catch_up"):
        rules_and_args([word])


def test_only_variants_with_rules_run_the_rules_module():
    assert coordinator_module(COORDINATORS["pipelined-waiting"]) == "bench.rules_coordinator"
    assert coordinator_module(COORDINATORS["pipelined"]) == "coordinator"


def test_the_module_runs_the_coordinators_own_command_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["rule:catch_up=off", "--help"])
    assert stopped.value.code == 0 and "--num-speculative-tokens" in capsys.readouterr().out
