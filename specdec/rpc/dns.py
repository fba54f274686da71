"""Pool addresses: a list of HOST:PORT, or a DNS name whose records are the replicas.

The spellings follow gRPC's name syntax, so an address that works in a gRPC client works here:
- `host:port,host:port`: the replicas, as given (a name among them resolves as usual, to one
  replica);
- `dns:///name:port`: every A/AAAA record of `name` (the system resolver), read again each
  time the pool is refreshed: a Kubernetes headless Service lists its ready pods this way;
- `dns://SERVER[:PORT]/name:port`: the same, asking the DNS server at SERVER directly (A
  records over UDP), as gRPC's `dns://authority/` does.

Why not hand a DNS name to one gRPC channel: a channel balances calls, not sessions, so a
session's next call could land on a replica that never saw it. The coordinator resolves the
name itself and keeps one channel per replica.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass

DNS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PoolSpec:
    """What --draft or --target names."""

    text: str  # as given, for messages
    addresses: tuple[str, ...] = ()  # a fixed list
    name: str = ""  # a DNS name to resolve (with `port`)
    port: int = 0
    server: tuple[str, int] | None = None  # dns://SERVER/: ask this DNS server directly

    @property
    def dynamic(self) -> bool:
        return bool(self.name)


def parse_pool(text: str) -> PoolSpec:
    """The spec of a pool; ValueError, in words, for one that cannot be."""
    text = text.strip()
    if text.startswith("dns:"):
        rest = text[len("dns:") :]
        if not rest.startswith("//"):
            raise ValueError(f"{text!r}: write dns:///NAME:PORT or dns://SERVER/NAME:PORT")
        authority, _, target = rest[2:].partition("/")
        name, port = split_host_port(target, text)
        server = None
        if authority:
            host, _, server_port = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "53")
            server = (host, int(server_port or 53))
        return PoolSpec(text, name=name, port=port, server=server)
    # As gRPC takes them (HOST:PORT, unix:PATH, ...): a channel to a bad one fails at its calls.
    addresses = tuple(part.strip() for part in text.split(",") if part.strip())
    if not addresses:
        raise ValueError("no address given")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"{text!r} names a replica twice")
    return PoolSpec(text, addresses=addresses)


def split_host_port(address: str, context: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{context!r}: {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(spec: PoolSpec) -> tuple[str, ...]:
    """The pool's replica addresses now, sorted; OSError when the name does not resolve."""
    if not spec.dynamic:
        return spec.addresses
    if spec.server is not None:
        hosts = await query_a(spec.server, spec.name)
    else:
        infos = await asyncio.get_running_loop().getaddrinfo(spec.name, spec.port, type=socket.SOCK_STREAM)
        hosts = [info[4][0] for info in infos]
    if not hosts:
        raise OSError(f"{spec.name} has no address records")
    return tuple(sorted({join_host_port(host, spec.port) for host in hosts}))


async def query_a(server: tuple[str, int], name: str) -> list[str]:
    """The A records of `name` from the DNS server at `server` (RFC 1035, one UDP query)."""
    query_id = secrets.randbits(16)
    question = b"".join(bytes([len(label)]) + label.encode("idna") for label in name.rstrip(".").split("."))
    packet = struct.pack(">HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + question + b"\0" + struct.pack(">HH", 1, 1)
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[bytes] = loop.create_future()

    class Protocol(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr) -> None:
            if len(data) >= 2 and struct.unpack(">H", data[:2])[0] == query_id and not reply.done():
                reply.set_result(data)

        def error_received(self, exc: Exception) -> None:
            if not reply.done():
                reply.set_exception(exc)

    transport, _ = await loop.create_datagram_endpoint(Protocol, remote_addr=server)
    try:
        transport.sendto(packet)
        try:
            data = await asyncio.wait_for(reply, DNS_TIMEOUT_S)
        except TimeoutError:
            raise OSError(f"DNS server {server[0]}:{server[1]} did not answer for {name}") from None
    finally:
        transport.close()
    return parse_a_records(data, name)


def parse_a_records(data: bytes, name: str) -> list[str]:
    flags, questions, answers = struct.unpack(">HHH", data[2:8])
    if flags & 0x000F:
        raise OSError(f"DNS lookup of {name} failed (rcode {flags & 0x000F})")
    offset = 12
    for _ in range(questions):
        offset = _skip_name(data, offset) + 4
    hosts = []
    for _ in range(answers):
        offset = _skip_name(data, offset)
        kind, klass, _ttl, length = struct.unpack(">HHIH", data[offset : offset + 10])
        offset += 10
        if kind == 1 and klass == 1 and length == 4:
            hosts.append(str(ipaddress.IPv4Address(data[offset : offset + 4])))
        offset += length
    return hosts


def _skip_name(data: bytes, offset: int) -> int:
    while True:
        length = data[offset]
        if length == 0:
            return offset + 1
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            return offset + 2
        offset += 1 + length
