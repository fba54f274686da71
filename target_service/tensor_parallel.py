"""Tensor parallelism for the target (`--tensor-parallel N`): N processes each hold 1/N of
every layer's weights and of the KV cache (transformers' tensor-parallel plan over
torch.distributed: NCCL on GPUs, gloo on CPU), and every forward pass is a collective all N
must enter with the same inputs.

Rank 0 is the service: it serves gRPC and owns the only session clock. Before any runner call
that runs the model or changes the sessions it broadcasts that call over a gloo control group,
and ranks 1..N-1 replay it on their shard. Sessions then evolve identically everywhere: the
calls are the same and come in the same order (the model thread serialises them), admission
and eviction are pure functions of that order, and idle-TTL expiry, the one decision that
depends on a clock, is made by rank 0 and sent as the list of ids to drop. The other ranks'
results are thrown away; an error they hit is the same error rank 0 answered its caller with.

A rank that dies leaves the others unable to run a pass, so rank 0 exits as soon as a worker
it started is gone (the coordinator retries and re-prefills once the service is back), and a
worker exits as soon as rank 0 is gone.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from target_service.runner import TargetRunner, VerifyCall
from target_service.verification import never

logger = logging.getLogger(__name__)

# The control group waits for the next call for as long as the service sits idle.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)
_STOP = "stop"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """Each rank gets its own GPU; on CPU all ranks share the host."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"


def init_rank(rank: int, world_size: int, local_rank: int, device: str, init_method: str) -> dist.ProcessGroup:
    """Joins the process group; returns the gloo group that carries rank 0's calls."""
    os.environ.setdefault("LOCAL_RANK", str(local_rank))  # transformers binds each rank's device from it
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size)
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


# TargetRunner's methods that only read (checks, Info): run on rank 0 alone. Every method that
# runs the model or changes sessions is one of TensorParallelRunner's own, sent to every rank.
RANK_ZERO_ONLY = frozenset(
    {"check_length", "check_logits", "check_tokens", "describe", "needs_draft_probs", "new_cache"}
)


def in_step(call: VerifyCall) -> VerifyCall:
    """`call` as every rank runs it: without its caller's stop (VerifyCall.should_stop), which
    rank 0 alone could read, cutting a prefill's passes short where the other ranks would run
    them and wait in their all-reduces (as ModelThread.between_passes never reaches the ranks:
    specdec.rpc.serving.build_model_servicer); and so that it pickles."""
    return call if call.should_stop is never else dataclasses.replace(call, should_stop=never)


class TensorParallelRunner:
    """Rank 0's runner: the calls that run the model or change sessions are sent to the other
    ranks first, then run here; everything else (Info, metrics gauges) reads rank 0's copy."""

    def __init__(self, runner: TargetRunner, control: dist.ProcessGroup, world_size: int) -> None:
        self._runner = runner
        self._control = control
        self.tensor_parallel_size = world_size
        # Rank 0's clock alone decides which idle sessions expire, before each call is sent
        # (`expire_sessions`): no rank's store expires any as a call opens a session, where a
        # rank replaying the call later than rank 0 ran it would drop one that rank 0 kept.
        self._ttl_s, runner.sessions.ttl_s = runner.sessions.ttl_s, math.inf

    def __getattr__(self, name: str) -> Any:
        """Rank 0's attributes, and of its methods those that only read (RANK_ZERO_ONLY); any
        other method would run passes on rank 0 alone, which then wait in an all-reduce for
        ranks never told (as the K = 0 steps once did): refused, naming it."""
        value = getattr(self._runner, name)
        if inspect.ismethod(value) and not name.startswith("_") and name not in RANK_ZERO_ONLY:
            raise AttributeError(
                f"TensorParallelRunner does not send {name} to the other ranks; it would run on rank 0 alone"
            )
        return value

    def _send(self, method: str, *args: Any) -> None:
        dist.broadcast_object_list([(method, args)], src=0, group=self._control)

    def verify_one(self, call: VerifyCall):
        self.expire_sessions()
        call = in_step(call)
        self._send("verify_one", call)
        return self._runner.verify_one(call)

    def verify_batch(self, calls: list[VerifyCall]):
        self.expire_sessions()
        calls = [in_step(call) for call in calls]
        self._send("verify_batch", calls)
        return self._runner.verify_batch(calls)

    # A target-only call's steps: TargetRunner's loops over this runner's verify_one, so each
    # step reaches every rank. (Reached through __getattr__, they ran on rank 0 alone, which
    # then waited in its first all-reduce for ranks never told: every K = 0 round hung.)
    verify_then_steps = TargetRunner.verify_then_steps
    verify_steps = TargetRunner.verify_steps

    def end_session(self, session_id: str, keep: bool = True) -> bool:
        self._send("end_session", session_id, keep)
        return self._runner.end_session(session_id, keep)

    def expire_sessions(self) -> int:
        """Rank 0's clock decides; the other ranks drop the same sessions."""
        before = set(self._runner.sessions.ids())
        expired = self._runner.sessions.expire(ttl_s=self._ttl_s)
        dropped = sorted(before - set(self._runner.sessions.ids()))
        if dropped:
            self._send("end_sessions", dropped)
        return expired

    def stop_workers(self) -> None:
        self._send(_STOP)


def serve_worker(runner: TargetRunner, control: dist.ProcessGroup, rank: int) -> None:
    """Ranks 1..N-1: replay rank 0's calls until it says stop or is gone. Their sessions
    expire only as rank 0 says (`TensorParallelRunner.expire_sessions`)."""
    runner.sessions.ttl_s = math.inf
    handlers: dict[str, Callable[..., Any]] = {
        "verify_one": runner.verify_one,
        "verify_batch": runner.verify_batch,
        "end_session": runner.end_session,
        "end_sessions": lambda ids: [runner.end_session(session_id) for session_id in ids],
    }
    logger.info("tensor-parallel rank %d ready", rank)
    while True:
        message: list[Any] = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=control)
        except Exception as exc:  # noqa: BLE001 - rank 0 closed the group: nothing left to serve
            logger.warning("tensor-parallel rank %d: rank 0 is gone (%s); exiting", rank, exc)
            return
        method, args = message[0]
        if method == _STOP:
            return
        try:
            handlers[method](*args)
        except Exception as exc:  # noqa: BLE001 - rank 0 raised the same and answered its caller
            logger.debug("tensor-parallel rank %d: %s failed as on rank 0: %s", rank, method, exc)


def spawn_workers(
    config, init_method: str, load_runner: Callable[[Any], TargetRunner]
) -> list[multiprocessing.process.BaseProcess]:
    """Starts ranks 1..N-1 as children of this process (rank 0). `load_runner(config)` loads a
    rank's shard: a module-level function, so the spawned ranks can import it by name."""
    context = multiprocessing.get_context("spawn")
    workers: list[multiprocessing.process.BaseProcess] = []
    for rank in range(1, config.tensor_parallel):
        process = context.Process(
            target=worker_main,
            args=(config, rank, init_method, os.getpid(), load_runner),
            name=f"target-tp-rank{rank}",
            daemon=True,
        )
        process.start()
        workers.append(process)
    return workers


def worker_main(
    config, rank: int, init_method: str, parent_pid: int, load_runner: Callable[[Any], TargetRunner]
) -> None:
    """Entry point of a spawned rank: load the shard, replay rank 0's calls."""
    from specdec.rpc.serving import configure_logging

    configure_logging(config.log_level)
    _exit_when_parent_dies(parent_pid)
    control = init_rank(rank, config.tensor_parallel, rank, config.device, init_method)
    runner = load_runner(config)
    serve_worker(runner, control, rank)
    os._exit(0)  # skip interpreter teardown of a live process group


def _exit_when_parent_dies(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def exit_when_a_worker_dies(workers: list[multiprocessing.process.BaseProcess]) -> threading.Event:
    """Rank 0 cannot run a pass without every rank: a dead worker ends the service (exit 3)
    so that the orchestrator restarts it whole, instead of hanging every call. Set the returned
    event before stopping the workers on purpose."""
    stopping = threading.Event()

    def watch() -> None:
        while not stopping.is_set():
            for process in workers:
                if stopping.is_set():
                    return
                if not process.is_alive():
                    logger.error(
                        "tensor-parallel worker %s exited (code %s); the target cannot run without it, exiting",
                        process.name,
                        process.exitcode,
                    )
                    os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tp-worker-watch", daemon=True).start()
    return stopping


def rank_from_environment() -> RankInfo | None:
    """Under torchrun (or any launcher that sets RANK/WORLD_SIZE), the ranks already exist."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    return None
