"""A local stack's services end with the process that started them, killed outright too: a
`make run` or benchmark killed with SIGKILL (the OOM killer, `kill -9`) left its three services
running, two of them holding a model's memory, until someone found them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import sys, time
from pathlib import Path
from specdec.tools.launch import spawn
folder = Path(sys.argv[1])
cpus = (min(__import__("os").sched_getaffinity(0)),) if sys.argv[2] == "pinned" else ()
child = spawn("sleeper", "sleeper", [], 1, folder / "sleeper.log", cwd=folder, cpus=cpus)
print(child.process.pid, flush=True)
time.sleep(600)
"""


def is_the_service(pid: int) -> bool:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[0] == sys.executable.encode() and argv[1:3] == [b"-m", b"sleeper"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie's state is Z: reaped by init soon
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", ["plain", "pinned"])
def test_a_service_ends_when_its_launcher_is_killed(tmp_path, how):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    env = {key: value for key, value in os.environ.items() if key != "SPECDEC_FORK_SERVICES"}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), how], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        # The tie is made by `setpriv` once it runs: a launcher killed before that (within
        # milliseconds of the spawn) leaves its child untied. Wait until the child is the service:
        # Python running the module, past setpriv and taskset (before its exec the child's
        # command line is the launcher's, whose code names the sleeper too).
        deadline = time.monotonic() + 20
        while not is_the_service(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive(child) and is_the_service(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:  # before: it slept on
            time.sleep(0.05)
        assert not alive(child), "the service outlived the process that started it"
    finally:
        parent.kill()
        if "child" in locals() and alive(child):
            os.kill(child, signal.SIGKILL)
