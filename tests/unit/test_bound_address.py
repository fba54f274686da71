"""The start-up log names the address a service bound and who can reach it (a loopback
default answers no other machine: issue 69's "connection refused" across machines)."""

from __future__ import annotations

import pytest

from specdec.rpc.serving import bound_address


@pytest.mark.parametrize(
    "host, port, expected",
    [
        ("127.0.0.1", 50062, "127.0.0.1:50062 (this machine only; --host 0.0.0.0 to serve other machines)"),
        ("::1", 50061, "[::1]:50061 (this machine only; --host 0.0.0.0 to serve other machines)"),
        ("0.0.0.0", 50051, "0.0.0.0:50051 (every interface)"),
        ("::", 50051, "[::]:50051 (every interface)"),
        ("10.0.0.7", 50062, "10.0.0.7:50062"),
    ],
)
def test_the_log_names_the_bound_address_and_its_reach(host, port, expected):
    assert bound_address(host, port) == expected
