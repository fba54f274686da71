"""scripts/run_demo.py (`make run`): asked to draft with an EAGLE head that was never trained,
it says where it looked and how to make one, before it starts anything; a head given to another
drafter is refused, not ignored."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_demo():
    spec = importlib.util.spec_from_file_location("run_demo", ROOT / "scripts" / "run_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eagle_without_a_head_names_the_folder_and_make_head(tmp_path, monkeypatch, capsys):
    demo = load_demo()
    started = []
    monkeypatch.setattr(demo, "local_stack", lambda *args, **kwargs: started.append(args))
    monkeypatch.setattr(sys, "argv", ["run_demo.py", "--models-dir", str(tmp_path), "--drafter", "eagle"])
    assert demo.main() == 2
    err = capsys.readouterr().err
    assert f"no EAGLE head in {tmp_path / demo.HEAD_NAME}" in err and "make head" in err
    assert started == []


def test_a_head_for_another_drafter_is_refused(tmp_path, monkeypatch, capsys):
    demo = load_demo()
    started = []
    monkeypatch.setattr(demo, "local_stack", lambda *args, **kwargs: started.append(args))
    argv = ["run_demo.py", "--models-dir", str(tmp_path), "--draft-head", str(tmp_path / "head")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        demo.main()
    assert stopped.value.code == 2 and "--drafter eagle" in capsys.readouterr().err
    assert started == []


def test_the_make_head_folder_is_the_one_the_demo_reads():
    makefile = (ROOT / "Makefile").read_text()
    assert f"HEAD_DIR ?= $(MODELS_DIR)/{load_demo().HEAD_NAME}\n" in makefile
