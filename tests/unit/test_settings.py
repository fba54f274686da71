"""Each setting is declared once (specdec.config.settings): the flag, its variable, its default, the
config field and the docs table all come from that one declaration."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.config import parse_config as coordinator_config
from draft_service.config import DraftConfig
from draft_service.config import parse_config as draft_config
from specdec.config.settings import declared
from target_service.config import TargetConfig
from target_service.config import parse_config as target_config

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = {
    DraftConfig: (draft_config, ["--model", "m"], {"model": "m"}),
    TargetConfig: (target_config, ["--model", "m"], {"model": "m"}),
    CoordinatorConfig: (
        coordinator_config,
        ["--draft", "d:1", "--target", "t:2", "--tokenizer", "k"],
        {"draft_address": "d:1", "target_address": "t:2", "tokenizer": "k"},
    ),
}


def configuration_docs():
    spec = importlib.util.spec_from_file_location("configuration_docs", ROOT / "scripts" / "configuration_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_configuration_tables_are_generated_from_the_configs():
    docs = configuration_docs()
    current = docs.DOC.read_text()
    assert docs.rendered(current) == current, "docs/configuration.md is out of date: run `make docs`"
    for cls in REQUIRED:
        for item in declared(cls):
            assert f"`{item.flag.name}`" in current


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda cls: cls.__name__)
def test_every_config_field_is_a_flag_whose_default_is_the_fields(cls):
    """Parsing nothing but the required flags gives exactly the dataclass's own defaults, so no
    default is written twice; `declared` raises on a field that is not a setting."""
    parse, argv, required = REQUIRED[cls]
    assert parse(argv, {}) == cls(**required)
    names = [item.flag.name for item in declared(cls)]
    assert len(names) == len(set(names)), "two fields share a flag"


def test_a_fixed_field_is_no_flag_keeps_its_default_and_code_may_set_it(capsys):
    """fixed(): no flag, no variable, nothing in --help or the docs; parsing leaves its default;
    a config built in code (tests) may still set it."""
    config = coordinator_config(["--draft", "d", "--target", "t", "--tokenizer", "k"], {})
    assert (config.breaker_failures, config.min_vocab_overlap) == (3, 0.1)
    assert "breaker" not in " ".join(item.flag.name for item in declared(CoordinatorConfig))
    with pytest.raises(SystemExit):
        coordinator_config(["--draft", "d", "--target", "t", "--tokenizer", "k", "--breaker-failures", "1"], {})
    assert "unrecognized arguments: --breaker-failures" in capsys.readouterr().err
    assert CoordinatorConfig(breaker_failures=1).breaker_failures == 1


def test_every_flag_reads_its_variable_and_says_so_in_help(capsys):
    for cls, (parse, _, _) in REQUIRED.items():
        prefix = {DraftConfig: "SPECDEC_DRAFT", TargetConfig: "SPECDEC_TARGET"}.get(cls, "SPECDEC_COORDINATOR")
        with pytest.raises(SystemExit):
            parse(["--help"], {})
        text = " ".join(capsys.readouterr().out.split())
        for item in declared(cls):
            assert item.env_name(prefix) in text
    env = {"SPECDEC_COORDINATOR_UPSTREAM_TLS_CA": "ca.pem", "SPECDEC_COORDINATOR_PIPELINE": "on"}
    config = coordinator_config(REQUIRED[CoordinatorConfig][1], env)
    assert config.upstream.tls_ca == "ca.pem" and config.pipeline is True
    assert coordinator_config([*REQUIRED[CoordinatorConfig][1], "--pipeline", "off"], env).pipeline is False
    with pytest.raises(SystemExit, match="SPECDEC_DRAFT_CALIBRATE='yes' is invalid"):
        draft_config(["--model", "m"], {"SPECDEC_DRAFT_CALIBRATE": "yes"})


def test_a_variable_of_the_services_prefix_that_names_no_setting_is_refused(capsys):
    """A misspelt variable, or one whose flag is gone (a fixed value now), stops start-up with
    its name rather than being ignored; another service's variables are left alone, as in the
    Kubernetes config map every pod reads whole."""
    others = {"SPECDEC_TARGET_MODEL": "t", "SPECDEC_COORDINATOR_TARGET": "t:1", "SPECDEC_DRAFTS": "x"}
    assert draft_config(["--model", "m"], others).model == "m"
    for gone in ("SPECDEC_DRAFT_SESSION_TTL", "SPECDEC_DRAFT_NGRAM_MIN", "SPECDEC_DRAFT_MAX_SESION"):
        with pytest.raises(SystemExit):
            draft_config(["--model", "m"], {**others, gone: "1"})
        assert f"error: {gone}: no setting of this service has that variable" in capsys.readouterr().err
    # The refusal points to --help, which then lists them, the stale variable set or not.
    with pytest.raises(SystemExit) as exited:
        draft_config(["--help"], {**others, "SPECDEC_DRAFT_SESSION_TTL": "300"})
    assert exited.value.code == 0 and "SPECDEC_DRAFT_MAX_SESSIONS" in capsys.readouterr().out


def test_a_flag_wins_over_its_variable_even_a_malformed_one():
    """docs/configuration.md: flags win. A malformed variable stops start-up only where no flag
    overrides it, as the config map of every pod may hold one a command line corrects."""
    bad = {"SPECDEC_COORDINATOR_CONNECT_TIMEOUT": "-1"}
    given = ["--draft", "d:1", "--target", "t:2", "--tokenizer", "k"]
    assert coordinator_config([*given, "--connect-timeout", "5"], bad).connect_timeout_s == 5
    with pytest.raises(SystemExit, match="SPECDEC_COORDINATOR_CONNECT_TIMEOUT='-1' is invalid"):
        coordinator_config(given, bad)
