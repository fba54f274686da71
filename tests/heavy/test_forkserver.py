"""Services forked from one process that imported torch and transformers once
(specdec.tools.forkserver): each child runs as `python -m module args` would, and its handle
answers as subprocess.Popen's does."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from specdec.tools import launch
from specdec.tools.forkserver import ForkServer

PROBE = """\
import os, random, sys, time
print("argv", sys.argv[1:], "name", __name__)
print("cwd", os.getcwd(), "env", os.environ.get("PROBE"), "home", os.environ.get("HOME"))
print("random", random.random(), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def test_a_forked_child_runs_as_python_m_would_with_its_own_exit_code_log_and_draws(probe):
    server = ForkServer.shared()
    logs = [probe / f"child{i}.log" for i in range(2)]
    children = [
        server.spawn("probe", ["run", str(3 + i)], {"PROBE": f"p{i}"}, probe, log) for i, log in enumerate(logs)
    ]
    assert [child.wait(timeout=60) for child in children] == [3, 4]
    assert [child.returncode for child in children] == [3, 4] and children[0].poll() == 3
    texts = [log.read_text() for log in logs]
    assert "argv ['run', '3'] name __main__" in texts[0] and "argv ['run', '4']" in texts[1]
    assert f"cwd {probe} env p0 home None" in texts[0]  # exactly the environment given
    draws = [text.split("random ")[1].split()[0] for text in texts]
    assert draws[0] != draws[1]  # generators seeded again in each child


def test_a_signalled_child_reports_it_as_popen_does_and_waiting_can_time_out(probe):
    server = ForkServer.shared()
    child = server.spawn("probe", ["sleep", "0"], {}, probe, probe / "sleep.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.5)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    child.kill()  # gone already: nothing happens


def test_a_child_ends_as_an_interpreter_does_waiting_for_threads_then_atexit(probe):
    """Its non-daemon threads are joined and its atexit handlers run, after an exception too."""
    (probe / "ending.py").write_text(
        "import atexit, sys, threading, time\n"
        "atexit.register(print, 'atexit ran', flush=True)\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise RuntimeError('boom')\n"
    )
    server = ForkServer.shared()
    for how, code in (("return", 0), ("raise", 1)):
        log = probe / f"{how}.log"
        assert server.spawn("ending", [how], {}, probe, log).wait(timeout=60) == code
        text = log.read_text()
        assert text.index("thread done") < text.index("atexit ran"), text
        assert ("RuntimeError: boom" in text) == (how == "raise")


def test_a_local_stack_stops_its_services_on_sigterm_as_on_ctrl_c():
    """`make` passes SIGTERM to `make run`'s demo, whose default end left the three services
    running (about 10 GB with the real pair): while a local stack runs, SIGTERM raises
    SystemExit, so its `finally` stops them; the handler before it comes back after."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended, launch.stopped_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode; never reached
    assert ended.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
