"""Replica pools as processes, for the pool tests: several targets beside one draft, a
coordinator over them, and a DNS server the test controls."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import socket
import struct
import threading
import time
import urllib.request
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import grpc

from bench.emulated import service_command
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
        args = ["--host", host, *(["--model", str(model)] if role != "coordinator" else []), *args]
        module, args = service_command(role, args) if role != "coordinator" else ("coordinator", args)
        process = spawn(
            name,
            module,
            args,
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


def open_sessions(service: ServiceProcess, stub=target_pb2_grpc.TargetStub) -> int:
    with grpc.insecure_channel(service.address) as channel:
        return stub(channel).Info(common_pb2.InfoRequest(), timeout=5).open_sessions


def start_streams(stub, count: int = 4) -> list[tuple]:
    """`count` GenerateStreams of 60 tokens of PROMPT at K = 3, each read past its first chunk,
    so that all of them are running: (stream, its chunks so far) each."""
    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=60, num_speculative_tokens=3)
    streams = [stub.GenerateStream(request, timeout=120) for _ in range(count)]
    return [(stream, [next(stream)]) for stream in streams]


def finish_streams(started: list[tuple]) -> list[list[pb.GenerateResponse]]:
    """Each stream of `start_streams` read to its end: every stream's chunks, in order."""
    return [got + list(stream) for stream, got in started]


def streamed_tokens(chunks: list[pb.GenerateResponse]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


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
    """A DNS server on 127.0.0.1, over UDP and TCP on one port, for names the test sets and
    changes: `records` (A) and `aaaa` of `name`, and `srv` (name -> [(priority, port,
    target)]). A name with no records at all is NXDOMAIN; a UDP answer over 512 bytes is sent
    truncated, so the client asks again over TCP. `queries` counts the questions answered, by
    transport and type."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[str] = []
        self.aaaa: list[str] = []
        self.srv: dict[str, list[tuple[int, int, str]]] = {}
        self.queries: collections.Counter[tuple[str, str]] = collections.Counter()
        self._udp, self._tcp = self._bind_both()
        self.port = self._udp.getsockname()[1]
        for sock in (self._udp, self._tcp):
            sock.settimeout(0.2)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=serve, daemon=True) for serve in (self._serve_udp, self._serve_tcp)]

    @staticmethod
    def _bind_both() -> tuple[socket.socket, socket.socket]:
        """A UDP and a TCP socket on one free port. The port the kernel gives the UDP socket can
        be in use over TCP (another test's service or connection), so another is tried."""
        for _ in range(50):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("127.0.0.1", 0))
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                tcp.bind(("127.0.0.1", udp.getsockname()[1]))
            except OSError:
                udp.close()
                tcp.close()
                continue
            tcp.listen()
            return udp, tcp
        raise RuntimeError("no port free over both UDP and TCP in 50 tries")

    def __enter__(self) -> DnsServer:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._udp.close()
        self._tcp.close()

    def _serve_udp(self) -> None:
        while not self._stop.is_set():
            try:
                query, client = self._udp.recvfrom(512)
            except TimeoutError:
                continue
            self._udp.sendto(self.answer(query, "udp"), client)

    def _serve_tcp(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._tcp.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(2.0)
                (length,) = struct.unpack(">H", connection.recv(2))
                query = b""
                while len(query) < length:
                    query += connection.recv(length - len(query))
                reply = self.answer(query, "tcp")
                connection.sendall(struct.pack(">H", len(reply)) + reply)

    def _rrsets(self, name: str) -> dict[str, list[str]]:
        """The records of `name` by type, as zone-file text."""
        sets = {}
        if name == self.name:
            sets = {"A": list(self.records), "AAAA": list(self.aaaa)}
        if name in self.srv:
            sets["SRV"] = [f"{priority} 1 {port} {target}." for priority, port, target in self.srv[name]]
        return {kind: records for kind, records in sets.items() if records}

    def answer(self, query: bytes, transport: str) -> bytes:
        request = dns.message.from_wire(query)
        question = request.question[0]
        name, kind = question.name.to_text(omit_final_dot=True), dns.rdatatype.to_text(question.rdtype)
        self.queries[(transport, kind)] += 1
        response = dns.message.make_response(request)
        sets = self._rrsets(name)
        if not sets:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif kind in sets:
            response.answer.append(dns.rrset.from_text_list(question.name, 0, "IN", kind, sets[kind]))
        try:
            return response.to_wire(max_size=512 if transport == "udp" else 65535)
        except dns.exception.TooBig:
            truncated = dns.message.make_response(request)
            truncated.flags |= dns.flags.TC
            return truncated.to_wire()
