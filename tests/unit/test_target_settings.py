"""The target's --quantize and the measured choice of a target setting (target_service.pick)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from specdec.engine.quantize import RowwiseInt8Linear
from target_service import pick
from target_service import server as target_server
from target_service.config import TargetConfig, parse_config
from tests.stack import model_service_config


def test_the_target_serves_the_model_as_given_unless_int8_is_asked_for_by_name():
    """The target's numerics are the output's: no default quantises it (issue 39)."""
    assert parse_config(["--model", "m"], env={}).resolved_quantize() == "none"
    for device, dtype in (("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "bfloat16")):
        config = parse_config(["--model", "m", "--device", device, "--dtype", dtype], env={})
        assert config.quantize == "none" and config.resolved_quantize() == "none"
    assert parse_config(["--model", "m", "--quantize", "int8"], env={}).resolved_quantize() == "int8"


def test_auto_asked_for_means_int8_on_cpu_float32_and_never_for_a_split_model():
    base = parse_config(["--model", "m", "--quantize", "auto"], env={})
    assert base.quantize == "auto" and base.resolved_quantize() == "int8"
    assert dataclasses.replace(base, dtype="bfloat16").resolved_quantize() == "none"
    assert dataclasses.replace(base, device="cuda").resolved_quantize() == "none"
    assert dataclasses.replace(base, device="auto").resolved_quantize() == "none"
    assert parse_config(["--model", "m", "--quantize", "none"], env={}).resolved_quantize() == "none"
    assert parse_config(["--model", "m"], env={"SPECDEC_TARGET_QUANTIZE": "auto"}).quantize == "auto"
    for bad in (["--quantize", "int8", "--dtype", "bfloat16"], ["--quantize", "int8", "--tensor-parallel", "2"]):
        with pytest.raises(SystemExit):
            parse_config(["--model", "m", *bad], env={})


def test_int8_target_is_quantised_and_says_so(tiny_pair):
    runner = target_server.load_runner(model_service_config(TargetConfig, tiny_pair.target, quantize="int8"))
    assert any(isinstance(m, RowwiseInt8Linear) for m in runner.model.modules())
    description = runner.describe()
    assert description.dtype == "float32" and description.quantization.startswith("int8")
    assert description.numerics == "int8 (per-channel weights, per-token activations), float32 elsewhere"


def test_pick_times_every_setting_and_names_the_fastest(tiny_pair, capsys):
    assert pick.main(["--model", str(tiny_pair.target), "--k", "2", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    choice = json.loads(lines[-1])
    assert choice["setting"] in {"float32", "bfloat16", "int8"} and choice["reason"]
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| setting")]
    assert [row.split("|")[1].strip() for row in table] == ["float32", "bfloat16", "int8"]
    assert all(len(row.split("|")) == 2 + 3 + 2 for row in table)  # 1..K+1 tokens and the score
