"""How long torch's OpenMP workers spin once a parallel region ends; set before torch loads.

libgomp (torch's CPU thread pool) keeps a worker spinning after each parallel region so the
next region starts without a wake-up. Its default when OMP_WAIT_POLICY is unset is 300,000
spins, milliseconds with a slow `pause` instruction (AMD). Within one forward pass that is
what we want: the regions follow each other tens of microseconds apart. Between passes it is
not. Speculation alternates two processes on the same cores (draft pass, target pass, draft
pass...), and a pass that starts while the other process's worker still spins waits for the
scheduler to hand it the core, so the first pass after the other model's loses milliseconds
in a stalled GEMM or two. 10,000 spins are enough to keep one pass's regions back to back (a
steady pass costs the same) and end the spinning within a fraction of a millisecond; far
fewer spins, or OMP_WAIT_POLICY=PASSIVE, slow every pass instead. The measurements:
docs/design.md, "Services sharing cores".
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "10000"


def limit_spinning(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets GOMP_SPINCOUNT unless the operator chose a spin count or a wait policy. Takes
    effect only before torch is imported (libgomp reads it once, when it loads); the process
    managers' children (tensor-parallel ranks, the target pick) inherit it."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT
