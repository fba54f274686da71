"""Every random stream of one request, derived from its seed.

Exactness needs the draft's draws independent of the target's draws and of the coordinator's
coins, and reproducibility needs a seed to name one output. numpy's SeedSequence uses the
whole seed (torch's CPU generator keeps only its low 32 bits, so s and s + 2**32 would draw
alike), and spawned children have keys of their own: no two streams of a request coincide,
and none equals a stream of another seed (plain `default_rng(x + 2**32)` and
`default_rng((x, 1))` are the same stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEED_BOUND = 2**63  # per-call seeds sent to the services (uint64 on the wire)


@dataclass(frozen=True)
class RequestStreams:
    coins: np.random.Generator  # the rounds' acceptance uniforms
    draft: np.random.Generator  # a seed per Propose call
    target: np.random.Generator  # a seed per Verify call
    predraft: np.random.Generator  # a seed per pre-draft
    hedge: np.random.Generator  # a seed per hedge

    @classmethod
    def of(cls, seed: int) -> RequestStreams:
        children = np.random.SeedSequence(seed).spawn(5)
        return cls(*(np.random.Generator(np.random.PCG64(child)) for child in children))


def next_seed(stream: np.random.Generator) -> int:
    return int(stream.integers(0, SEED_BOUND))
