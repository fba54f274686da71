"""A network link's latency, in user space: a TCP forwarder that holds every byte for the
link's one-way delay in each direction, for hosts on one machine (specdec.tools.testbed).

This kernel has no `netem` qdisc, so the delay cannot come from `tc`. The forwarder accepts
on the link's address, connects to the service behind it, and runs one thread per direction
that reads, and one that writes each chunk once `delay + jitter` has passed since it was read.
Chunks leave in the order they came (a chunk never overtakes the one before it, as on one TCP
stream); jitter adds |N(0, σ)| per chunk (a half-normal: mean 0.8σ), never less than none. Threads and
`time.sleep` rather than an event loop: epoll's timeout has millisecond resolution, which
would turn a 0.05 ms link into a 1 ms one.

`python -m specdec.tools.delay_link --measure` times round trips through a forwarder against a
direct connection, to show what the forwarder itself costs.
"""

from __future__ import annotations

import argparse
import collections
import random
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

from specdec.engine.pace import sleep_precisely

CHUNK = 1 << 16


@dataclass(frozen=True)
class LinkDelay:
    """A link's one-way delay and jitter (σ: each chunk waits |N(0, σ)| more, in order)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"a link's delay and jitter are at least 0 ms, not {self.delay_ms} and {self.jitter_ms}")


class _Direction:
    """One direction of one connection: a reader thread stamps chunks, a writer thread sends
    each at its stamp. The end of the stream is passed on as it came: a half-close as a
    half-close, a reset as a reset. A writer whose far side has gone stops its reader, so
    nothing queues up that could no longer be delivered."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay: LinkDelay, rng: random.Random, done):
        self.source, self.sink, self.delay, self.rng, self.done = source, sink, delay, rng, done
        self.queue: collections.deque[tuple[float, bytes, bool]] = collections.deque()  # (release, data, reset)
        self.ready = threading.Condition()
        self.last_release = 0.0
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True).start()

    def _release_time(self) -> float:
        extra = abs(self.rng.gauss(0.0, self.delay.jitter_ms)) if self.delay.jitter_ms else 0.0
        release = time.monotonic() + (self.delay.delay_ms + extra) / 1e3
        self.last_release = max(release, self.last_release)  # in order, as on one stream
        return self.last_release

    def _read(self) -> None:
        while True:
            reset = False
            try:
                data = self.source.recv(CHUNK)
            except OSError:
                data, reset = b"", True  # the source reset the connection
            with self.ready:
                self.queue.append((self._release_time(), data, reset))
                self.ready.notify()
            if not data:
                return

    def _write(self) -> None:
        try:
            while True:
                with self.ready:
                    while not self.queue:
                        self.ready.wait()
                    release, data, reset = self.queue.popleft()
                wait = release - time.monotonic()
                if wait > 0:
                    sleep_precisely(wait)  # at its stamp, not up to the default 50 µs of timer slack later
                if not data:
                    if reset:
                        # Closed without lingering, the sink sends a reset, not a FIN; shutting
                        # its reading side wakes the other direction's reader to end it.
                        self.sink.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.sink.shutdown(socket.SHUT_RD)
                    else:
                        self.sink.shutdown(socket.SHUT_WR)
                    return
                self.sink.sendall(data)
        except OSError:
            try:  # the far side is gone: stop reading what could no longer be delivered
                self.source.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        finally:
            self.done()


class _Connection:
    """Both directions of one forwarded connection; its sockets close once both have ended."""

    def __init__(self, client: socket.socket, server: socket.socket, delay: LinkDelay, rng: random.Random):
        self.sockets = (client, server)
        self.ended = 0
        self.lock = threading.Lock()
        _Direction(client, server, delay, random.Random(rng.random()), self.done)
        _Direction(server, client, delay, random.Random(rng.random()), self.done)

    def done(self) -> None:
        with self.lock:
            self.ended += 1
            if self.ended == 2:
                for sock in self.sockets:
                    sock.close()


class DelayLink:
    """Forwards connections from `listen` to `upstream`, delaying both directions by `delay`."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], delay: LinkDelay, seed: int = 0):
        self.upstream, self.delay = upstream, delay
        self.rng = random.Random(seed)
        self.server = socket.create_server(listen, reuse_port=False)
        self.address = self.server.getsockname()[:2]

    def serve_forever(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _Connection(client, server, self.delay, self.rng)

    def start(self) -> DelayLink:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; close alone does not
        except OSError:
            pass
        self.server.close()


def _echo_server() -> tuple[socket.socket, tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def echo(conn=conn) -> None:
                with conn:
                    while data := conn.recv(CHUNK):
                        conn.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[:2]


def round_trip_ms(address: tuple[str, int], payload: int, trips: int) -> float:
    """The median round trip of `payload` bytes, echoed, over one connection."""
    message = b"x" * payload
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(trips):
            started = time.perf_counter()
            sock.sendall(message)
            received = 0
            while received < payload:
                received += len(sock.recv(CHUNK))
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(delays_ms: list[float], payloads: list[int], trips: int) -> list[dict]:
    """Round trips direct and through a forwarder of each delay: a forwarder's own cost is its
    round trip less the direct one less twice its delay."""
    server, echo = _echo_server()
    rows = []
    try:
        for payload in payloads:
            direct = round_trip_ms(echo, payload, trips)
            rows.append({"payload": payload, "delay_ms": None, "round_trip_ms": direct, "added_ms": 0.0})
            for delay_ms in delays_ms:
                link = DelayLink(("127.0.0.1", 0), echo, LinkDelay(delay_ms)).start()
                try:
                    through = round_trip_ms(link.address, payload, trips)
                finally:
                    link.close()
                rows.append(
                    {
                        "payload": payload,
                        "delay_ms": delay_ms,
                        "round_trip_ms": through,
                        "added_ms": through - direct - 2 * delay_ms,
                    }
                )
    finally:
        server.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.delay_link", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", help="HOST:PORT to accept on")
    parser.add_argument("--to", help="HOST:PORT of the service behind the link")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="σ: each chunk waits |N(0, σ)| ms more, in order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", action="store_true", help="time round trips through forwarders against direct")
    args = parser.parse_args(argv)
    if args.measure:
        print("payload  delay   round trip  forwarder's own cost")
        for row in measure([0.0, 0.05, 0.5, 2.0], [64, 16384, 262144], trips=200):
            delay = "direct" if row["delay_ms"] is None else f"{row['delay_ms']:g} ms"
            print(f"{row['payload']:7d}  {delay:6s} {row['round_trip_ms']:8.3f} ms  {row['added_ms']:+.3f} ms")
        return 0
    if not args.listen or not args.to:
        parser.error("--listen and --to are needed (or --measure)")
    host, port = args.listen.rsplit(":", 1)
    to_host, to_port = args.to.rsplit(":", 1)
    link = DelayLink((host, int(port)), (to_host, int(to_port)), LinkDelay(args.delay_ms, args.jitter_ms), args.seed)
    print(f"link {host}:{link.address[1]} -> {args.to}, {args.delay_ms} ms ± {args.jitter_ms} ms", flush=True)
    try:
        link.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
