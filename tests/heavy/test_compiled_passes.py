"""`--cuda-graphs compiled` on CPU: the static pass compiled by torch.compile (Inductor; on a
GPU then captured) gives an eager pass's logits over the same pool, and one compilation serves
every bucket of one variant (its sizes symbolic), so a service compiles at most four passes
(one session or more, one token or more), not one a bucket. Heavy: a compilation takes 10-20 s
of a core here."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from specdec.engine.static_pass import Row, StaticPasses
from tests.unit import test_kv_pool
from tests.unit.test_static_pass import eager, poisoned_pool, tokens

models = test_kv_pool.models  # the fixture


def test_one_compiled_pass_serves_every_bucket_with_an_eager_passes_logits(models):
    model = models["sdpa"]
    pool = poisoned_pool()
    passes = StaticPasses(model, pool, max_sessions=4, max_length=1024, capture=False, compile=True)
    mine = [pool.open(4) for _ in range(3)]
    theirs = [pool.open(4) for _ in range(3)]
    graphs = counters["stats"]["unique_graphs"]
    # Sessions and tokens both more than one (one of Dynamo's four variants): prompts of 40 and
    # 60 tokens, verifies of 2 to 9 (buckets of 2-8 and 16 rows), batches of 3 and 2 sessions
    # (buckets of 4 and 2), and sessions crossing from the 256-key bucket to the 512 one.
    steps = [(40, 40, 40), (3, 5, 2), (9, 2, 7), (60, 60, 60), (64, 64, 64), (64, 64, 64), (64, 64, 64), (4, 6, 8)]
    seed = 0
    for index, counts in enumerate(steps):
        members = 3 if index % 2 == 0 else 2
        rows, wanted = [], []
        for cache, reference, count in list(zip(mine, theirs, counts))[:members]:
            seed += 1
            run = tokens(count, seed)
            keep = min(count, 1 + seed % 4)
            rows.append(Row(cache, run, keep=keep))
            wanted.append(eager(model, reference, run, keep))
        for got, want in zip(passes.run(rows), wanted, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert [c.lengths for c in mine] == [r.lengths for r in theirs]
    buckets = {(b.sessions, b.tokens, b.length) for b in passes._passes}
    assert {(4, 16, 256), (2, 5, 256), (4, 64, 512), (2, 6, 512)} <= buckets, buckets
    assert counters["stats"]["unique_graphs"] - graphs == 1, f"{len(buckets)} buckets compiled more than once"
    assert passes.compile and passes.describe().startswith("compiled, static, uncaptured")
