"""Local service processes forked from one that imported torch and transformers once.

A model service spends nearly all of its start-up importing torch and transformers (7.5 of
7.7 s of CPU on a slow 2-core machine, 2026-12-06); a test run or a benchmark starts dozens.
`ForkServer` starts one process that imports them, then forks each service from it: the
child runs `python -m module args` as a fresh interpreter would (its own environment, working
folder, log, `sys.argv`), from the imports already done. Nothing in the fork server runs a
torch op, starts a thread or opens a gRPC channel, so the fork copies no thread pool or
connection; the `random` and numpy generators are seeded again in each child (what a fork
does not renew is Python's string hash seed, shared by the children). The handle
(`ForkedProcess`) answers as `subprocess.Popen` does for what the launchers use: pid, poll,
wait, send_signal, kill, returncode.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.qwen2.modeling_qwen2")


def _child(request: dict) -> None:
    """In the forked child: becomes `python -m module args`, then exits with its code."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if request["cwd"]:
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        # Generators seeded when the fork server imported them would be every child's alike.
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, int | None):
                print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's own failure, to its log
        traceback.print_exc()
    finally:
        # As an interpreter's exit: wait for non-daemon threads, then the atexit handlers.
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110
                pass
        os._exit(code)


def serve() -> None:
    """The fork server: reads one JSON request a line on stdin, forks it, writes `pid N` (or
    `failed ERRNO`), and `exit N CODE` (Popen's returncode: -signal for a signal) as each
    child ends. It ends at the end of its input; children still running go on, as Popen's
    children do when their parent exits."""
    from specdec.engine.openmp import limit_spinning

    limit_spinning()  # as each service's __main__ does: libgomp reads it once, when torch loads
    for module in PRELOAD:
        __import__(module)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()
        if stdin in ready:
            line = stdin.readline()
            if not line:
                return
            out.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                out.write(f"failed {exc.errno}\n")
                out.flush()
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                os.close(wake_read)
                os.close(wake_write)
                _child(json.loads(line))
            out.write(f"pid {pid}\n")
            out.flush()


class ForkServer:
    """One fork server process for this process's services (`spawn`)."""

    _shared: ForkServer | None = None
    _shared_lock = threading.Lock()
    owner = 0  # the pid of the process it answers: a forked copy of that process needs its own

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[2]
        self._process = subprocess.Popen(
            [sys.executable, "-u", "-c", "from specdec.tools.forkserver import serve; serve()"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._lock = threading.Lock()  # one request at a time: its `pid` line answers it
        self._changed = threading.Condition()
        self._pids: list[int] = []
        self.exits: dict[int, int] = {}
        self.gone = False
        self.owner = os.getpid()
        threading.Thread(target=self._read, daemon=True, name="forkserver").start()

    @classmethod
    def shared(cls) -> ForkServer:
        with cls._shared_lock:
            shared = cls._shared
            if shared is None or shared.gone or shared.owner != os.getpid():
                cls._shared = shared = ForkServer()
            return shared

    def _read(self) -> None:
        assert self._process.stdout is not None
        try:
            for line in self._process.stdout:
                kind, *numbers = line.decode(errors="replace").split()
                with self._changed:
                    if kind in ("pid", "failed") and len(numbers) == 1:
                        self._pids.append(int(numbers[0]) if kind == "pid" else -1)
                    elif kind == "exit" and len(numbers) == 2:
                        self.exits[int(numbers[0])] = int(numbers[1])
                    self._changed.notify_all()
        finally:
            with self._changed:  # it exited (or this thread failed): no more answers will come
                self.gone = True
                self._changed.notify_all()

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: Path | None, log: Path) -> ForkedProcess:
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd or Path.cwd()), "log": str(log)}
        with self._lock:
            assert self._process.stdin is not None
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._pids or self.gone, timeout=120):
                    raise RuntimeError("the fork server did not answer")
                if not self._pids:
                    raise RuntimeError(f"the fork server exited with {self._process.poll()}")
                pid = self._pids.pop(0)
                if pid < 0:
                    raise RuntimeError(f"the fork server could not fork {module}")
                return ForkedProcess(pid, self)


class ForkedProcess:
    """A service forked by a ForkServer, with the part of subprocess.Popen's interface the
    launchers and tests use."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self._server._changed:
            self.returncode = self._server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server._changed:
            ended = self._server._changed.wait_for(
                lambda: self.pid in self._server.exits or self._server.gone, timeout=timeout
            )
            if not ended:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            if self.pid not in self._server.exits:
                raise RuntimeError(f"the fork server that started pid {self.pid} exited: its end is not known")
            self.returncode = self._server.exits[self.pid]
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
