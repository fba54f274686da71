"""Rank 0's TensorParallelRunner hands the servicer only what is safe on rank 0 alone: every
TargetRunner method that runs the model or changes sessions is its own (sent to every rank
first) or refused, so a method added later cannot silently run on one rank (the K = 0 steps
once did, and hung the service: tests/heavy/test_tensor_parallel_ranks.py)."""

from __future__ import annotations

import inspect
import pickle
import threading

import pytest
import torch

from specdec.sampling.probs import SamplingParams
from target_service.config import TargetConfig
from target_service.runner import TargetRunner, VerifyCall
from target_service.server import load_runner
from target_service.tensor_parallel import RANK_ZERO_ONLY, TensorParallelRunner
from tests.stack import model_service_config


def test_every_runner_method_is_sent_to_every_rank_read_on_rank_zero_or_refused(tiny_pair):
    runner = load_runner(model_service_config(TargetConfig, tiny_pair.target))
    wrapped = TensorParallelRunner(runner, None, 2)  # type: ignore[arg-type]  # no call is sent here
    own = {name for name, _ in inspect.getmembers(TensorParallelRunner, callable)}
    public = {name for name, _ in inspect.getmembers(TargetRunner, inspect.isfunction) if not name.startswith("_")}
    assert {"verify_one", "verify_batch", "verify_then_steps", "verify_steps", "end_session"} <= own
    for name in sorted(public - own):
        if name in RANK_ZERO_ONLY:
            assert callable(getattr(wrapped, name))
        else:
            with pytest.raises(AttributeError, match=f"does not send {name} to the other ranks"):
                getattr(wrapped, name)
    assert "forward" in public - own - RANK_ZERO_ONLY  # the check above refused at least the passes
    assert wrapped.sessions is runner.sessions and wrapped.loaded is runner.loaded  # data: rank 0's


def test_calls_reach_every_rank_pickled_and_without_their_callers_stop(tiny_pair):
    """Rank 0 sends each call to the other ranks pickled; a servicer's call carries its caller's
    stop (VerifyCall.should_stop, a threading.Event's), which no pickle holds and which rank 0
    alone could read, stopping a prefill its ranks would run on: every rank runs it without."""
    runner = load_runner(model_service_config(TargetConfig, tiny_pair.target))
    wrapped = TensorParallelRunner(runner, None, 2)  # type: ignore[arg-type]
    sent: list = []
    wrapped._send = lambda method, *args: sent.append(pickle.loads(pickle.dumps((method, args))))  # type: ignore[method-assign]
    ran: list = []
    runner.verify_one = ran.append  # type: ignore[method-assign]
    runner.verify_batch = ran.append  # type: ignore[method-assign]
    stop = threading.Event()
    stop.set()
    call = VerifyCall("s", 0, [1, 2, 3], [], torch.zeros(0), SamplingParams(), 0, should_stop=stop.is_set)
    wrapped.verify_one(call)
    wrapped.verify_batch([call, VerifyCall("t", 0, [4], [], torch.zeros(0), SamplingParams(), 0)])
    assert [method for method, _ in sent] == ["verify_one", "verify_batch"]
    on_ranks = [sent[0][1][0], *sent[1][1][0]]
    on_rank_zero = [ran[0], *ran[1]]
    for calls in (on_ranks, on_rank_zero):
        assert [c.session_id for c in calls] == ["s", "s", "t"]
        assert not any(c.should_stop() for c in calls), "a rank would stop where the others run on"
