"""gRPC keepalive, the same on every channel and server of the three services: gRPC's own
pings on every connection, so that a peer lost across machines (a node
gone, a partition: no reset ever arrives) fails the calls on that connection, and the channel
reconnects, within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS rather than at each call's deadline
(a verify's is 60 s). Servers accept a client's pings that often, calls in flight or not, and
ping their own clients alike (a coordinator gone leaves sessions only to their TTL).
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
# The coordinator's public server, whose clients are users, not our own channels: a connection
# idle this long is closed (a client reconnects on its next call), and one this old is asked to
# go (GOAWAY; its calls get MAX_CONNECTION_GRACE_MS to finish), so clients behind a layer-4
# balancer (a Kubernetes Service) spread over coordinator replicas added since they connected.
MAX_CONNECTION_IDLE_MS = 300_000
MAX_CONNECTION_AGE_MS = 1_800_000
MAX_CONNECTION_GRACE_MS = 300_000


def options() -> list[tuple[str, int]]:
    """A channel's keepalive (both ends send pings)."""
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]


def server_options() -> list[tuple[str, int]]:
    """A server's: its own pings, and clients' pings accepted at KEEPALIVE_TIME_MS or slower
    (gRPC's default allows one in 5 minutes and closes a connection that pings more)."""
    return [
        *options(),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ]


def public_server_options() -> list[tuple[str, int]]:
    """The coordinator's public server: `server_options`, and idle and old connections closed."""
    return [
        *server_options(),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_GRACE_MS),
    ]
