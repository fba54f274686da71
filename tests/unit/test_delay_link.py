"""The user-space link delay: bytes arrive after the link's delay each way, in the order they
were sent even with jitter, and the end of a stream is passed on."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from specdec.tools.delay_link import DelayLink, LinkDelay, _echo_server, round_trip_ms


def test_a_round_trip_takes_at_least_twice_the_delay_and_jitter_adds_to_it():
    server, echo = _echo_server()
    link = DelayLink(("127.0.0.1", 0), echo, LinkDelay(3.0)).start()
    # Jitter alone: |N(0, 2 ms)| each way, 1.6 ms on average, so a round trip's median is
    # near 3 ms and far above the fraction of a millisecond a link without jitter takes.
    jittery = DelayLink(("127.0.0.1", 0), echo, LinkDelay(0.0, jitter_ms=2.0), seed=1).start()
    try:
        assert 6.0 <= round_trip_ms(link.address, 64, 5) < 60.0
        assert round_trip_ms(jittery.address, 64, 30) > 1.5
    finally:
        link.close()
        jittery.close()
        server.close()


def test_a_stream_keeps_its_order_under_jitter_and_its_end_is_passed_on():
    server, echo = _echo_server()
    link = DelayLink(("127.0.0.1", 0), echo, LinkDelay(0.2, jitter_ms=1.0), seed=3).start()
    sent = b"".join(i.to_bytes(4, "big") for i in range(5000))
    try:
        with socket.create_connection(link.address) as sock:
            received = bytearray()

            def receive() -> None:
                while data := sock.recv(1 << 16):
                    received.extend(data)

            reader = threading.Thread(target=receive)
            reader.start()
            for start in range(0, len(sent), 97):  # many small chunks, each with its own jitter
                sock.sendall(sent[start : start + 97])
                time.sleep(0.0002)
            sock.shutdown(socket.SHUT_WR)  # the echo ends its side when ours ends: the link passes both on
            reader.join(timeout=30)
            assert not reader.is_alive()
        assert bytes(received) == sent
    finally:
        link.close()
        server.close()


def test_a_reset_is_passed_on_as_a_reset():
    server = socket.create_server(("127.0.0.1", 0))

    def accept_and_reset() -> None:
        conn, _ = server.accept()
        conn.recv(16)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # no lingering: a reset

    threading.Thread(target=accept_and_reset, daemon=True).start()
    link = DelayLink(("127.0.0.1", 0), server.getsockname()[:2], LinkDelay(0.5)).start()
    try:
        with socket.create_connection(link.address) as sock:
            sock.settimeout(10)
            sock.sendall(b"hello")
            with pytest.raises(ConnectionResetError):
                while sock.recv(16):
                    pass
    finally:
        link.close()
        server.close()


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match="at least 0 ms"):
        LinkDelay(-1.0)
