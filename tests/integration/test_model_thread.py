"""A model service loads, calibrates and serves its model on one thread: with torch's CPU
kernels on OpenMP, a second thread running parallel work starts a second thread team, the
process then runs more OpenMP threads than cores and every pass slows down (measured ~1.35×
on a 0.5B int8 draft; specdec.rpc.serving.start_model_server)."""

from __future__ import annotations

import threading

import grpc
import torch

from draft_service import server as draft_server
from draft_service.config import DraftConfig
from specdec.rpc.serving import leave_torch_to_the_model_thread
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from target_service import server as target_server
from target_service.config import TargetConfig
from tests.stack import model_service_config


async def test_loading_calibration_and_passes_all_run_on_the_model_thread(tiny_pair, monkeypatch):
    threads: dict[str, set[str]] = {"load": set(), "forward": set()}
    for module in (draft_server, target_server):
        plain_load = module.load_runner

        def load(config, plain_load=plain_load):
            threads["load"].add(threading.current_thread().name)
            runner = plain_load(config)
            plain_forward = runner.model.forward  # every path's passes (a decode batch's too)

            def forward(*args, **kwargs):
                threads["forward"].add(threading.current_thread().name)
                return plain_forward(*args, **kwargs)

            runner.model.forward = forward
            return runner

        monkeypatch.setattr(module, "load_runner", load)
    draft = await draft_server.build_server(model_service_config(DraftConfig, tiny_pair.draft, calibrate=True))
    target = await target_server.build_server(model_service_config(TargetConfig, tiny_pair.target))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
            reply = await draft_pb2_grpc.DraftStub(channel).Propose(
                draft_pb2.ProposeRequest(
                    session_id="s",
                    new_tokens=[5, 6, 7],
                    num_tokens=2,
                    sampling=common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0),
                )
            )
        assert len(reply.token_ids) == 2
    finally:
        await draft.stop(0)
        await target.stop(0)
    main = threading.main_thread().name
    # One thread per service, never the event loop's (loading includes the draft's calibration).
    assert threads["load"] == {"draft-model_0", "target-model_0"}
    assert threads["forward"] == {"draft-model_0"} and main not in threads["load"] | threads["forward"]


def test_the_event_loop_thread_keeps_one_torch_thread_and_the_model_thread_the_configured_count():
    before = torch.get_num_threads()
    try:
        config = leave_torch_to_the_model_thread(model_service_config(DraftConfig, "unused", threads=0))
        assert torch.get_num_threads() == 1 and config.threads == before  # torch's default, made explicit
        config = leave_torch_to_the_model_thread(model_service_config(DraftConfig, "unused", threads=3))
        assert config.threads == 3
    finally:
        torch.set_num_threads(before)
