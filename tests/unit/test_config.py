"""Each service's frozen config: flags over environment variables over defaults."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from coordinator import server as coordinator_server
from coordinator.config import CoordinatorConfig
from coordinator.config import parse_config as coordinator_config
from draft_service.config import parse_config as draft_config
from specdec.config.services import parse_kv_budget
from specdec.engine.modeling import check_device
from target_service.config import parse_config as target_config


def test_environment_sets_defaults_and_flags_win():
    env = {"SPECDEC_DRAFT_MODEL": "/models/draft", "SPECDEC_DRAFT_PORT": "6000", "SPECDEC_DRAFT_DTYPE": "bfloat16"}
    config = draft_config(["--port", "7000"], env)
    assert (config.model, config.port, config.dtype) == ("/models/draft", 7000, "bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


def test_target_device_auto_and_defaults():
    config = target_config(["--model", "m", "--device", "auto"], {})
    assert config.device_map == "auto" and config.dtype == "float32" and config.problem() is None
    assert target_config(["--model", "m"], {}).device_map is None
    with pytest.raises(SystemExit):
        draft_config(["--model", "m", "--device", "auto"], {})
    with pytest.raises(SystemExit):
        target_config(["--model", "m", "--device", "auto", "--tensor-parallel", "2"], {})


def test_malformed_environment_value_is_a_clear_start_up_error():
    with pytest.raises(SystemExit, match="SPECDEC_TARGET_PORT='abc' is invalid"):
        target_config(["--model", "m"], {"SPECDEC_TARGET_PORT": "abc"})


def test_environment_values_outside_the_choices_are_refused():
    """argparse checks choices only on flags; a variable must not slip past them."""
    with pytest.raises(
        SystemExit, match="SPECDEC_TARGET_DTYPE='bf16' is invalid: choose from float32, bfloat16, float16"
    ):
        target_config(["--model", "m"], {"SPECDEC_TARGET_DTYPE": "bf16"})
    base = {
        "SPECDEC_COORDINATOR_DRAFT": "a:1",
        "SPECDEC_COORDINATOR_TARGET": "b:2",
        "SPECDEC_COORDINATOR_TOKENIZER": "t",
    }
    with pytest.raises(SystemExit, match="SPECDEC_COORDINATOR_PIPELINE='yes' is invalid"):
        coordinator_config([], {**base, "SPECDEC_COORDINATOR_PIPELINE": "yes"})
    assert coordinator_config([], {**base, "SPECDEC_COORDINATOR_PIPELINE": "on"}).pipeline


@pytest.mark.parametrize(
    "parse, argv, said",
    [
        (coordinator_config, ["--hedges", "two"], "argument --hedges: 'two' is neither auto nor a whole number"),
        (coordinator_config, ["--pipeline", "yes"], "argument --pipeline: 'yes': choose from auto, on, off"),
        (target_config, ["--max-kv-bytes", "2XB"], "argument --max-kv-bytes: '2XB' is not a size; use bytes"),
        (target_config, ["--max-kv-bytes", "120%"], "more than 0% and at most 100%; got 120%"),
        (target_config, ["--port", "abc"], "argument --port: 'abc' is not a whole number"),
        # Values outside what they can mean: refused by name, before any model loads.
        (target_config, ["--port", "70000"], "argument --port: '70000' is not in [0, 65535]"),  # gRPC: port 4464
        (draft_config, ["--metrics-port", "-2"], "argument --metrics-port: '-2' is not in [-1, 65535]"),
        (target_config, ["--threads", "-2"], "argument --threads: '-2' is not in [0, ∞]"),
        (target_config, ["--max-sessions", "0"], "argument --max-sessions: '0' is not in [1, ∞]"),
        (target_config, ["--batch-window-ms", "nan"], "argument --batch-window-ms: 'nan' is not in [0, ∞]"),
        (target_config, ["--log-level", "verbose"], "argument --log-level: 'verbose': choose from DEBUG, INFO"),
        (coordinator_config, ["--http-port", "65536"], "argument --http-port: '65536' is not in [-1, 65535]"),
        (coordinator_config, ["--target-timeout", "0"], "argument --target-timeout: '0' is not in [0.001, ∞]"),
        (coordinator_config, ["--pool-refresh", "nan"], "argument --pool-refresh: 'nan' is not in [0.01, ∞]"),
        (coordinator_config, ["--max-new-tokens-limit", "0"], "argument --max-new-tokens-limit: '0' is not in"),
        (coordinator_config, ["--shutdown-grace", "-1"], "argument --shutdown-grace: '-1' is not in [0, ∞]"),
    ],
)
def test_a_malformed_flag_says_what_is_accepted(parse, argv, said, capsys):
    """argparse shows only "invalid parse_bytes value" for a parser's ValueError: the services
    show the parser's own message, as for an environment variable."""
    required = (
        ["--draft", "a:1", "--target", "b:2", "--tokenizer", "t"] if parse is coordinator_config else ["--model", "m"]
    )
    with pytest.raises(SystemExit):
        parse([*required, *argv], {})
    assert said in capsys.readouterr().err


def test_a_log_level_is_taken_in_either_case_from_a_flag_or_the_environment():
    assert target_config(["--model", "m", "--log-level", "debug"], {}).log_level == "DEBUG"
    assert draft_config(["--model", "m"], {"SPECDEC_DRAFT_LOG_LEVEL": "warning"}).log_level == "WARNING"
    with pytest.raises(SystemExit, match="SPECDEC_DRAFT_LOG_LEVEL='loud' is invalid: 'loud': choose from"):
        draft_config(["--model", "m"], {"SPECDEC_DRAFT_LOG_LEVEL": "loud"})


def test_required_settings_are_named(capsys):
    with pytest.raises(SystemExit):
        coordinator_config(["--draft", "a:1", "--target", "b:2"], {})
    assert "--tokenizer is required" in capsys.readouterr().err
    config = coordinator_config(
        [],
        {"SPECDEC_COORDINATOR_DRAFT": "a:1", "SPECDEC_COORDINATOR_TARGET": "b:2", "SPECDEC_COORDINATOR_TOKENIZER": "t"},
    )
    assert (config.draft_address, config.target_address, config.default_num_speculative_tokens) == ("a:1", "b:2", None)
    fixed = {"SPECDEC_COORDINATOR_NUM_SPECULATIVE_TOKENS": "6"}
    assert (
        coordinator_config(
            ["--draft", "a:1", "--target", "b:2", "--tokenizer", "t"], fixed
        ).default_num_speculative_tokens
        == 6
    )
    assert (
        coordinator_config(
            ["--draft", "a:1", "--target", "b:2", "--tokenizer", "t", "--num-speculative-tokens", "auto"], fixed
        ).default_num_speculative_tokens
        is None
    )
    with pytest.raises(SystemExit):
        coordinator_config(
            ["--draft", "a:1", "--target", "b:2", "--tokenizer", "t", "--num-speculative-tokens", "65"], {}
        )
    assert "--num-speculative-tokens must be auto or in [0" in capsys.readouterr().err


def test_target_batching_flags_environment_and_limits():
    config = target_config(["--model", "m"], {})
    assert (config.batch_window_ms, config.max_batch_size) == (2.0, 8)
    config = target_config(["--model", "m", "--max-batch-size", "4"], {"SPECDEC_TARGET_BATCH_WINDOW_MS": "0"})
    assert (config.batch_window_ms, config.max_batch_size) == (0.0, 4)
    with pytest.raises(SystemExit):
        target_config(["--model", "m", "--batch-window-ms", "-1"], {})
    with pytest.raises(SystemExit):
        target_config(["--model", "m", "--max-batch-size", "0"], {})


def test_threads_follow_the_cores_the_process_may_use(monkeypatch):
    """No --cpus: a service started under taskset (specdec.tools.launch.spawn's `cpus`) or in a
    container's cpuset runs one torch thread per core it may use; --threads still wins."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert draft_config(["--model", "m"], {}).torch_threads == 0  # not pinned: torch's default
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})
    assert draft_config(["--model", "m"], {}).torch_threads == 2
    assert target_config(["--model", "m", "--threads", "3"]).torch_threads == 3
    for parse, args in (
        (draft_config, ["--model", "m"]),
        (coordinator_config, ["--draft", "d", "--target", "t", "--tokenizer", "k"]),
    ):
        with pytest.raises(SystemExit):
            parse([*args, "--cpus", "0"])


@pytest.mark.parametrize("folder", ["/no/such/folder", "empty"])
def test_a_coordinator_tokenizer_that_is_no_tokenizer_folder_names_the_flag(folder, tmp_path):
    """Once "Repo id must be in the form 'repo_name'..." for a mistyped path, naming no flag."""
    path = str(tmp_path) if folder == "empty" else folder
    config = CoordinatorConfig(draft_address="a:1", target_address="b:2", tokenizer=path)
    with pytest.raises(ValueError, match=f"--tokenizer {path}: "):
        asyncio.run(coordinator_server.connect(config))


def test_a_device_this_host_lacks_and_a_budget_under_a_byte_are_refused_in_words():
    """--device cuda on a host without CUDA, or a device torch cannot read, failed with a
    traceback once the weights had loaded; --max-kv-bytes 0.9 (90% meant) meant no budget."""
    check_device("cpu")
    check_device("auto")
    with pytest.raises(ValueError, match="not a torch device"):
        check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            check_device("cuda:0")
    with pytest.raises(ValueError, match="percentage"):
        parse_kv_budget("0.9")
    assert parse_kv_budget("0") == 0 and parse_kv_budget("90%").fraction == 0.9


def test_the_ngram_drafter_is_refused_what_every_drafter_is():
    for bad in (["--draft-head", "/h"], ["--min-confidence", "5"]):
        with pytest.raises(SystemExit):
            draft_config(["--model", "m", "--drafter", "ngram", "--quantize", "none", *bad], {})
