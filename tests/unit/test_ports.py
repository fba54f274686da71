import random
import socket

from specdec.rpc import ports
from specdec.rpc.ports import free_port


def test_free_port_is_below_the_kernels_ephemeral_range_and_bindable():
    floor = ports._ephemeral_floor()
    picked = [free_port() for _ in range(20)]
    assert all(ports._LOWEST <= port < floor for port in picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[0]))


def test_free_port_ignores_the_seeded_global_random():
    random.seed(0)
    first = [free_port() for _ in range(3)]
    random.seed(0)
    assert [free_port() for _ in range(3)] != first


def test_free_port_skips_a_port_in_use(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        busy = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_floor", lambda: busy + 1_000)
        draws = iter([busy])  # the first draw is the held port; later ones are random again
        randrange = ports._rng.randrange
        monkeypatch.setattr(ports._rng, "randrange", lambda low, high: next(draws, None) or randrange(low, high))
        port = free_port()
    assert port != busy and ports._LOWEST <= port < busy + 1_000


def test_free_port_never_hands_out_a_port_twice_in_one_process():
    """Ports picked for processes that bind them later are all free at once: 2,000 picks from
    ~22,000 would repeat one almost surely if each pick forgot the last (a benchmark starting
    a dozen coordinators together drew one port twice)."""
    picked = [free_port() for _ in range(2_000)]
    assert len(set(picked)) == len(picked)
