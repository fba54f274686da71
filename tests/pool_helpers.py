"""Replica pools as processes, for the pool tests: several targets beside one draft, a
coordinator over them, and a DNS server the test controls."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import struct
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from specdec.tools.launch import ServiceProcess, free_port, spawn
from specdec.v1 import common_pb2, target_pb2_grpc
from specdec.v1 import coordinator_pb2 as pb
from tests.stack import ROOT, START_TIMEOUT_S

PROMPT = "The quick brown fox"


class Processes:
    """Services started by a test, all stopped (SIGKILL where asked) on exit."""

    def __init__(self, pair, logs: Path) -> None:
        self.pair = pair
        self.logs = logs
        self.started: list[ServiceProcess] = []
        # Target passes held to 40 ms (an emulated profile): a request of 60 tokens runs long
        # enough to be caught mid-generation, and four at once leave the CPU mostly idle.
        self.profile = logs / "target-40ms.json"
        self.profile.write_text(
            json.dumps({"name": "40 ms target", "source": "pool tests", "pass_ms": [[1, 40.0]], "context_ms_per_1k": 0})
        )

    def spawn(self, role: str, model: Path, port: int, host: str = "127.0.0.1", args=()) -> ServiceProcess:
        name = f"{role}-{len(self.started)}"
        module = {"draft": "draft_service", "target": "target_service", "coordinator": "coordinator"}[role]
        process = spawn(
            name,
            module,
            ["--host", host, *(["--model", str(model)] if role != "coordinator" else []), *args],
            port,
            self.logs / f"{name}.log",
            env={"OMP_NUM_THREADS": "1"},
            cwd=ROOT,
        )
        process = dataclasses.replace(process, address=f"{host}:{port}")
        self.started.append(process)
        return process

    def draft(self) -> ServiceProcess:
        return self.spawn("draft", self.pair.draft, free_port(), args=["--quantize", "none"])

    def target(self, port: int | None = None, host: str = "127.0.0.1", model: Path | None = None, args=()):
        return self.spawn(
            "target",
            model or self.pair.target,
            port or free_port(),
            host,
            ["--pass-cost-profile", str(self.profile), *args],
        )

    def coordinator(self, draft: str, target: str, *args: str) -> ServiceProcess:
        return self.spawn(
            "coordinator",
            Path(),
            free_port(),
            args=[
                "--draft",
                draft,
                "--target",
                target,
                "--tokenizer",
                str(self.pair.target),
                "--pool-refresh",
                "0.3",
                *args,
            ],
        )

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        for process in reversed(self.started):
            if process.process.poll() is None:
                process.process.kill()
                process.process.wait()


def wait_all(*processes: ServiceProcess) -> None:
    for process in processes:
        process.wait_healthy(START_TIMEOUT_S)


def kill(process: ServiceProcess) -> None:
    process.process.kill()
    process.process.wait()


def open_sessions(target: ServiceProcess) -> int:
    with grpc.insecure_channel(target.address) as channel:
        return target_pb2_grpc.TargetStub(channel).Info(common_pb2.InfoRequest(), timeout=5).open_sessions


def generate(stub, max_new_tokens: int = 24) -> pb.GenerateResponse:
    return stub.Generate(
        pb.GenerateRequest(prompt=PROMPT, max_new_tokens=max_new_tokens, num_speculative_tokens=3), timeout=60
    )


def until_placed_on(stub, address: str, reference, timeout_s: float = 30.0) -> pb.GenerateResponse:
    """Generates until a request lands on `address` (a replica joining), each output checked."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = generate(stub)
        assert list(response.token_ids) == reference(PROMPT, 24)
        if response.stats.target_replica == address:
            return response
        assert time.monotonic() < deadline, f"no request was placed on {address}"
        time.sleep(0.1)


def metric(process: ServiceProcess, name: str, labels: dict[str, str]) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port()}/metrics", timeout=5).read().decode()
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.MULTILINE)
    return None if match is None else float(match.group(1))


class DnsServer:
    """A DNS server on 127.0.0.1 (UDP) answering A queries for one name from `records`, which
    the test changes; NXDOMAIN while `records` is empty. `queries` counts what it answered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[str] = []
        self.queries = 0
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.2)
        self.port = self._socket.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, client = self._socket.recvfrom(512)
            except TimeoutError:
                continue
            self.queries += 1
            self._socket.sendto(self.answer(query), client)

    def answer(self, query: bytes) -> bytes:
        (query_id,) = struct.unpack(">H", query[:2])
        end = query.index(b"\0", 12) + 5  # the question: name, type, class
        question = query[12:end]
        labels, offset = [], 12
        while query[offset]:
            labels.append(query[offset + 1 : offset + 1 + query[offset]].decode())
            offset += 1 + query[offset]
        records = list(self.records) if ".".join(labels) == self.name else []
        flags = 0x8180 if records else 0x8183  # a response; NXDOMAIN when none
        header = struct.pack(">HHHHHH", query_id, flags, 1, len(records), 0, 0)
        answers = b"".join(struct.pack(">HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(address) for address in records)
        return header + question + answers
