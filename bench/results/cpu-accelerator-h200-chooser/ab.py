"""A/B: the coordinator of a git worktree at /tmp/base (the commit compared against) beside this
tree's, over the same emulated services, modes interleaved (bench.accelerator.run_modes rotates
them per repeat). Run from the tree: python ab.py OUT_DIR "h200-1.5b+0.5b:0.8,70b+1b:0.8"."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, "/work/main")
import bench.accelerator as acc
from bench.accelerator import Mode, overlap_flags
from specdec.tools.launch import spawn_coordinator

OLD = Path("/tmp/base")
acc.COORDINATORS.update({"default-old": [], "sequential-old": overlap_flags(), "pipelined-old": overlap_flags("on")})
original = acc.start_coordinator


def start(draft, target, pair, variant, logs, bed, host="coordinator"):
    if variant.endswith("-old"):
        log = logs / f"coordinator-{variant}.log"
        return spawn_coordinator(draft, target, pair.target, log, acc.COORDINATORS[variant], OLD)
    return original(draft, target, pair, variant, logs, bed, host)


acc.start_coordinator = start
M = {m.name: m for m in acc.MODES}
acc.MODES = [
    M["target-only (K=0)"],
    M["pipelined, all hedged K=6"],
    M["sequential, K chooser"],
    Mode("OLD sequential, K chooser", "sequential-old", None, sampled=True),
    M["pipelined, K chooser"],
    Mode("OLD pipelined, K chooser", "pipelined-old", None, sampled=True),
    M["no flags (overlap and K chosen)"],
    Mode("OLD no flags", "default-old", None, sampled=True),
]
out = Path(sys.argv[1])
pairs = tuple(sys.argv[2].split(","))
acc.CELLS = [(name, float(alpha)) for name, alpha in (pair.split(":") for pair in pairs)]
config = SimpleNamespace(out_dir=out, repeats=2, max_new_tokens=128, seed=0, pairs=tuple(c[0] for c in acc.CELLS))
out.mkdir(parents=True, exist_ok=True)
results = acc.run_accelerator(config, {"note": "A/B"})
(out / "results.json").write_text(json.dumps(results, indent=1))
