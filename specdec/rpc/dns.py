"""Pool addresses: a list of HOST:PORT, or a DNS name whose records are the replicas.

The spellings follow gRPC's name syntax, so an address that works in a gRPC client works here:
- `host:port,host:port`: the replicas, as given (a name among them resolves as usual, to one
  replica);
- `dns:///name:port`: every A/AAAA record of `name` (the system resolver, /etc/hosts and
  search domains included), read again each time the pool is refreshed: a Kubernetes
  headless Service lists its ready pods this way;
- `dns://SERVER[:PORT]/name:port`: the same, asking the DNS server at SERVER directly, as
  gRPC's `dns://authority/` does;
- `dns:///_service._proto.name` (no port; `dns://SERVER/` too): the SRV records of the name,
  each a replica's host and port (those of the lowest priority: the others are backups). A
  Kubernetes headless Service publishes `_grpc._tcp.SERVICE.NAMESPACE.svc.cluster.local` for
  its port named grpc.

Lookups go through dnspython (UDP, then TCP where an answer is truncated). Why not hand a DNS
name to one gRPC channel: a channel balances calls, not sessions, so a session's next call
could land on a replica that never saw it. The coordinator resolves the name itself and keeps
one channel per replica.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver

DNS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PoolSpec:
    """What --draft or --target names."""

    text: str  # as given, for messages
    addresses: tuple[str, ...] = ()  # a fixed list
    name: str = ""  # a DNS name to resolve (with `port`; 0: an SRV name, whose records give the ports)
    port: int = 0
    server: tuple[str, int] | None = None  # dns://SERVER/: ask this DNS server directly

    @property
    def dynamic(self) -> bool:
        return bool(self.name)

    @property
    def srv(self) -> bool:
        return self.dynamic and not self.port

    @property
    def host_name(self) -> str:
        """The name its replicas' TLS certificates carry: an SRV name less its _service._proto
        labels (_grpc._tcp.target.svc: target.svc), any other DNS name as it is."""
        labels = self.name.split(".")
        while self.srv and len(labels) > 1 and labels[0].startswith("_"):
            labels.pop(0)
        return ".".join(labels)


def parse_pool(text: str) -> PoolSpec:
    """The spec of a pool; ValueError, in words, for one that cannot be."""
    text = text.strip()
    if text.startswith("dns:"):
        rest = text[len("dns:") :]
        if not rest.startswith("//"):
            raise ValueError(f"{text!r}: write dns:///NAME:PORT, dns://SERVER/NAME:PORT or dns:///_SERVICE._PROTO.NAME")
        authority, _, target = rest[2:].partition("/")
        if target.startswith("_") and ":" not in target:
            name, port = target.rstrip("."), 0  # an SRV name: its records give the ports
        else:
            name, port = split_host_port(target, text)
        server = None
        if authority:
            host, _, server_port = authority.rpartition(":") if authority.count(":") == 1 else (authority, "", "53")
            server = (host.strip("[]"), int(server_port or 53))
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
    """The pool's replica addresses now, sorted; OSError, saying why, when the name does not
    resolve."""
    if not spec.dynamic:
        return spec.addresses
    if spec.srv:
        targets = await lookup_srv(spec.server, spec.name)
    else:
        targets = [(spec.name, spec.port)]
    addresses: set[str] = set()
    for host, port in targets:
        hosts = await lookup(spec.server, host, port)
        addresses.update(join_host_port(address, port) for address in hosts)
    if not addresses:
        raise OSError(f"{spec.name} has no address records")
    return tuple(sorted(addresses))


async def lookup(server: tuple[str, int] | None, name: str, port: int) -> list[str]:
    """The addresses of `name`: from the system resolver, or the A and AAAA records the DNS
    server at `server` has for it."""
    if server is None:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return [info[4][0] for info in infos]
    hosts: list[str] = []
    for kind in ("A", "AAAA"):
        answer = await _query(server, name, kind)
        hosts.extend(record.address for record in answer or ())
    return hosts


async def lookup_srv(server: tuple[str, int] | None, name: str) -> list[tuple[str, int]]:
    """The (host, port) of each SRV record of `name` with the lowest priority."""
    answer = await _query(server, name, "SRV")
    records = list(answer or ())
    if not records:
        raise OSError(f"{name} has no SRV records")
    first = min(record.priority for record in records)
    return [(record.target.to_text(omit_final_dot=True), record.port) for record in records if record.priority == first]


async def _query(server: tuple[str, int] | None, name: str, kind: str) -> dns.resolver.Answer | None:
    """The `kind` records of `name` (None: the name has none of that kind); OSError where the
    name does not exist or the server does not answer."""
    resolver = dns.asyncresolver.Resolver(configure=server is None)
    if server is not None:
        resolver.nameservers = [server[0]]
        resolver.port = server[1]
    where = "the system's DNS servers" if server is None else f"DNS server {server[0]}:{server[1]}"
    try:
        return await resolver.resolve(name, kind, search=False, lifetime=DNS_TIMEOUT_S)
    except dns.resolver.NoAnswer:
        return None
    except dns.resolver.NXDOMAIN:
        raise OSError(f"{where} knows no name {name} (NXDOMAIN)") from None
    except dns.exception.Timeout:
        raise OSError(f"{where} did not answer for {name} within {DNS_TIMEOUT_S} s") from None
    except dns.exception.DNSException as exc:
        raise OSError(f"DNS lookup of {name} ({kind}) at {where} failed: {exc}") from None
