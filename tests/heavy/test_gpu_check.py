"""bench.gpu_check, the command a session with a GPU runs, run here on the CPU with the tiny
pair: it writes profiles the services accept, finds every mode's greedy output identical to
target-only's, and gives a folder without weights random ones of its shape."""

from __future__ import annotations

import json
import shutil

from bench import gpu_check
from specdec.engine.pace import load_profile

QUICK = ["--device", "cpu", "--dtype", "float32", "--sizes", "1,4,16", "--contexts", "16,128"]
QUICK += ["--pass-repeats", "3", "--repeats", "1", "--prompts", "2", "--max-new-tokens", "16", "--threads", "1"]
QUICK += ["--batch-sessions", "4", "--graph-settings", "off,on"]  # compiled: tests/heavy/test_compiled_passes.py


def test_the_gpu_check_runs_and_reports_on_the_cpu(tiny_pair, tmp_path):
    shapes_only = tmp_path / "draft-shape"
    shutil.copytree(tiny_pair.draft, shapes_only)
    for weights in shapes_only.glob("model*.safetensors"):
        weights.unlink()
    out, logs = tmp_path / "out", tmp_path / "logs"
    results = gpu_check.main(
        ["--target", str(tiny_pair.target), "--draft", str(shapes_only), "--out", str(out), "--logs", str(logs), *QUICK]
    )
    assert (logs / "coordinator-pipelined.log").exists() and not (out / "logs").exists()  # a lease's 8 files
    for role in ("target", "draft"):
        profile = load_profile(str(out / f"profile-{role}.json"))
        assert [n for n, _ in profile.pass_ms] == [1, 4, 16] and "MEASURED" in profile.source
        assert all(a <= b for (_, a), (_, b) in zip(profile.pass_ms, profile.pass_ms[1:]))
    assert (
        results["random_weights"] and "random weights" in json.loads((out / "profile-draft.json").read_text())["source"]
    )
    modes = results["services"]["modes"]
    assert all(figures["identical"] == 2 for figures in modes.values()), modes
    assert all(figures["tok_s"] > 0 for figures in modes.values())
    # Where each mode's time went, per token: K = 4 drafts and its target passes take time.
    assert modes["K=4"]["per_token"]["proposed_tokens"] > 0 and modes["K=4"]["per_token"]["target_compute_ms"] > 0
    assert modes["target-only (K=0)"]["per_token"]["draft_ms"] == 0
    assert results["transformers_generate"]["identical"] == 2
    assert results["transformers_generate_static"]["identical"] == 2, results["transformers_generate_static"]
    assert "identical to target-only" in (out / "report.md").read_text()
    graphs = results["captured_against_eager"]  # on CPU: the static passes uncaptured
    batched = {"4 x 5 tokens", "4 x 5 verify, greedy", "4 x 5 verify, T=1"}
    assert set(graphs["target"]["on"]) == {"1 token", "8 tokens", *batched, "buckets", "load s"}
    assert all(graphs["target"][setting][figure] > 0 for setting in ("off", "on") for figure in batched)
    assert graphs["target"]["off"]["buckets"] == "eager"
    assert "static, uncaptured" in graphs["target"]["on"]["buckets"] and "4x5x256" in graphs["target"]["on"]["buckets"]
    assert "static, uncaptured" in graphs["draft"]["on"]["buckets"]
    parts = graphs["target"]["anatomy on"]  # on CPU: the ops alone (kernels are a device's)
    assert "error" not in parts and parts["aten_ops"] > 0 and parts["kernels"] == 0, parts
    for role in ("target", "draft"):  # float32 on CPU: static and eager passes to rounding
        close = graphs[role]["logits on"]
        assert close["max_abs_diff"] < 1e-4 and close["same_argmax"] == close["positions"] == 8, (role, close)


def test_profiles_only_measures_the_passes_and_starts_no_service(tiny_pair, tmp_path, monkeypatch):
    """With a step that fails (here the first), the report says why and the next steps run."""

    def broken(*_):
        raise RuntimeError("no graph today")

    monkeypatch.setattr(gpu_check, "captured_against_eager", broken)
    out = tmp_path / "out"
    pair = ["--target", str(tiny_pair.target), "--draft", str(tiny_pair.draft)]
    results = gpu_check.main([*pair, "--out", str(out), "--profiles-only", *QUICK])
    assert results["services"] is None and results["transformers_generate"] is None
    assert results["transformers_generate_static"] is None
    assert not (out / "logs").exists()
    for role in ("target", "draft"):
        assert "lower quartile of 3 passes" in load_profile(str(out / f"profile-{role}.json")).source
    report = (out / "report.md").read_text()
    assert "## Failed: captured_against_eager" in report and "RuntimeError: no graph today" in report
    assert "not measured: --profiles-only" in report


def test_random_weights_made_into_work_are_found_by_the_next_run(tiny_pair, tmp_path):
    """A lease runs gpu_check three times (bench/gpu_carry.sh): the 1.5B's random weights,
    gigabytes to make and write, are made once."""
    shapes_only = tmp_path / "draft-shape"
    shutil.copytree(tiny_pair.draft, shapes_only)
    for weights in shapes_only.glob("model*.safetensors"):
        weights.unlink()
    work = tmp_path / "work"
    first = gpu_check.with_weights("draft", shapes_only, "float32", work, seed=1)
    made = {path: path.stat().st_mtime_ns for path in first.folder.glob("model*.safetensors")}
    again = gpu_check.with_weights("draft", shapes_only, "float32", work, seed=1)
    assert made and again == first and first.random_weights
    assert {path: path.stat().st_mtime_ns for path in again.folder.glob("model*.safetensors")} == made
    assert first.folder.name == "draft-shape"  # the model's name, which its profile carries
    # A run killed while saving left a partial folder: the next makes the weights afresh.
    bf16 = gpu_check.with_weights("draft", shapes_only, "bfloat16", work, seed=1)
    assert bf16.folder != first.folder
    (work / "target-float32").mkdir()
    (work / "target-float32" / "draft-shape.partial").mkdir()
    (work / "target-float32" / "draft-shape.partial" / "model.safetensors").write_bytes(b"cut")
    target = gpu_check.with_weights("target", shapes_only, "float32", work, seed=1)
    assert target.folder.name == "draft-shape" and (target.folder / "model.safetensors").stat().st_size > 3
