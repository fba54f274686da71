"""A request's random streams (specdec.sampling.seeds): distinct within a request, distinct across
seeds that differ only above bit 32, and never a plain seed's stream."""

from __future__ import annotations

import itertools

import numpy as np

from specdec.sampling.seeds import SEED_BOUND, STREAMS, RequestStreams, next_seed


def first_draws(streams: RequestStreams) -> dict[str, tuple[float, ...]]:
    return {name: tuple(getattr(streams, name).random(8)) for name in STREAMS}


def test_no_two_streams_of_a_request_are_equal():
    draws = first_draws(RequestStreams.of(12345))
    for (a, x), (b, y) in itertools.combinations(draws.items(), 2):
        assert x != y, f"{a} and {b} draw alike"


def test_seeds_that_differ_above_bit_32_get_different_streams():
    for seed in (0, 7, 2**40 + 3):
        ours, other = first_draws(RequestStreams.of(seed)), first_draws(RequestStreams.of(seed + 2**32))
        assert not set(ours.values()) & set(other.values())


def test_no_stream_equals_a_plain_seed_stream():
    """default_rng(x + 2**32) and default_rng((x, 1)) are one stream; spawned children are not."""
    x = 99
    assert tuple(np.random.default_rng(x + 2**32).random(8)) == tuple(np.random.default_rng((x, 1)).random(8))
    plain = {tuple(np.random.default_rng(s).random(8)) for s in (x, x + 2**32, (x, 1), (x, 0))}
    for seed in (x, x + 2**32):
        assert not set(first_draws(RequestStreams.of(seed)).values()) & plain


def test_the_same_seed_gives_the_same_streams():
    assert first_draws(RequestStreams.of(5)) == first_draws(RequestStreams.of(5))


def test_each_stream_is_the_seeds_spawned_child_whichever_is_used_first():
    """Streams made on first use are spawn()'s children, in any order of use: a seed names the
    same output as when all five were spawned at once."""
    for seed in (0, 12345, 2**63 - 1):
        children = np.random.SeedSequence(seed).spawn(len(STREAMS))
        spawned = {name: tuple(np.random.Generator(np.random.PCG64(c)).random(8)) for name, c in zip(STREAMS, children)}
        streams = RequestStreams.of(seed)
        used = {name: tuple(getattr(streams, name).random(8)) for name in reversed(STREAMS)}
        assert used == spawned


def test_next_seed_is_numpys_integers_over_the_seed_bound():
    """next_seed reads the bit generator directly; it must give what
    `Generator.integers(0, SEED_BOUND)` gives, draw for draw, and leave the stream where that
    leaves it (the seeded outputs of every mode rest on it)."""
    for seed in range(100):
        fast, plain = RequestStreams.of(seed), RequestStreams.of(seed)
        for _ in range(20):
            assert next_seed(fast.target) == int(plain.target.integers(0, SEED_BOUND))
        assert fast.target.random() == plain.target.random()
