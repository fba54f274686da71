"""Static passes over the KV pool (specdec.engine.static_pass), run uncaptured on CPU: the
logits an eager pass over the same pool gives (to float32 rounding; bit for bit with the
row-wise attention one session at a time), every bucket edge crossed, pads never read or
written where a session is, trees laid out as tree_forward lays them, and a watched model
left to eager passes."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draft_service.runner import DraftRunner
from specdec.engine import attention
from specdec.engine.attention import GROUPED, grouped_sdpa_forward
from specdec.engine.features import FeatureTap
from specdec.engine.kv_pool import KVPool, PoolCache
from specdec.engine.modeling import with_cache
from specdec.engine.quantize import int8_supported, quantize_int8
from specdec.engine.static_pass import (
    MAX_TOKENS,
    Bucket,
    Row,
    StaticPasses,
    batch_bucket,
    length_bucket,
    static_passes_for,
    token_bucket,
    tree_row,
)
from specdec.engine.tree_pass import tree_forward
from tests.unit import test_batched_propose, test_kv_pool
from tests.unit.test_kv_pool import CONFIG
from tests.unit.test_kv_pool import poisoned_pool as kv_pool_poisoned

models = test_kv_pool.models  # the fixture: the same four models, one per attention

loaded = test_batched_propose.loaded  # the fixture: the tiny draft, float32 on CPU


IMPLEMENTATIONS = ["sdpa", "eager", attention.NAME, attention.EVERY_ROW]


def poisoned_pool(pages: int = 1000) -> KVPool:
    """4-token pages, every entry NaN: a pass that reads an entry no pass wrote gives NaN."""
    return kv_pool_poisoned(pages)


def eager(model, cache: PoolCache, tokens: list[int], keep: int) -> torch.Tensor:
    """The eager pass the runners run: [keep, V] float32."""
    start, device = cache.lengths[0], model.device
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([tokens], device=device),
            **with_cache(model, cache),
            position_ids=torch.arange(start, start + len(tokens), device=device)[None],
            use_cache=True,
            logits_to_keep=keep,
        )
    return out.logits[0].float()


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG["vocab_size"], (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("heads, kv_heads", [(12, 2), (4, 4)])
def test_grouped_sdpa_reads_grouped_heads_in_place_with_sdpas_result(heads, kv_heads):
    generator = torch.Generator().manual_seed(0)
    batch, rows, length, dim = 3, 5, 256, 16
    query = torch.randn(batch, heads, rows, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
    allowed = torch.rand(batch, 1, rows, length, generator=generator) > 0.3
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    module.eval()
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    got, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=dim**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_buckets():
    assert [token_bucket(n) for n in (1, 5, 8, 9, 16, 17, 33, MAX_TOKENS)] == [1, 5, 8, 16, 16, 32, 64, 64]
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [length_bucket(t) for t in (1, 256, 257, 1000)] == [256, 256, 512, 1024]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_static_passes_give_an_eager_passes_logits_over_the_same_pool(models, implementation):
    model = models[implementation]
    pool = poisoned_pool()
    passes = StaticPasses(model, pool, max_sessions=4, max_length=1024, capture=False)
    mine = [pool.open(4) for _ in range(3)]
    theirs = [pool.open(4) for _ in range(3)]
    # Prompts, then decode and verify passes: 1..8 tokens as they are, 9..33 padded to 16/32/64
    # rows, a session crossing the 256-key bucket, batches of 1 to 3 padded to 1, 2, 4.
    steps = [(40, 3, 290), (1, 5, 9), (8, 1, 2), (17, 33, 1), (1, 1, 1), (5, 2, 12)]
    seed = 0
    for counts in steps:
        rows, wanted = [], []
        for cache, reference, count in zip(mine, theirs, counts):
            seed += 1
            run = tokens(count, seed)
            keep = min(count, 1 + seed % 4)
            rows.append(Row(cache, run, keep=keep))
            wanted.append(eager(model, reference, run, keep))
        for width in (1, len(rows)):  # one session alone, then all in one pass
            got = passes.run(rows[:width]) if width == 1 else passes.run(rows[1:])
            want = wanted[:1] if width == 1 else wanted[1:]
            for g, w in zip(got, want):
                assert torch.isfinite(g).all()
                torch.testing.assert_close(g, w, rtol=0, atol=2e-6)
    assert [c.lengths for c in mine] == [r.lengths for r in theirs]
    assert Bucket(2, 64, 512) in passes._passes and Bucket(1, 1, 256) in passes._passes
    assert max(b.length for b in passes._passes) == 512  # the 290-token prompt and its tail


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_one_session_row_wise_is_bit_for_bit_the_eager_pass(models, weights):
    """The row-wise attention's promise (a token's logits are the same in every pass) holds in
    a static pass: its rows attend to gathered copies of the same entries, one row at a time.
    The Linear layers must keep it too. int8 ones (what the target serves on CPU with this
    attention) do at any thread count; float32 ones only on one thread: split over two, a
    9-row product's sums are blocked otherwise than a 16-row one's (3e-8 apart here)."""
    model = models[attention.EVERY_ROW]
    threads = torch.get_num_threads()
    if weights == "int8":
        if not int8_supported():
            pytest.skip("this torch build has no fbgemm int8 kernels")
        model = quantize_int8(copy.deepcopy(model))
    else:
        torch.set_num_threads(1)
    try:
        pool = poisoned_pool()
        passes = StaticPasses(model, pool, max_sessions=1, max_length=1024, capture=False)
        cache, reference = pool.open(4), pool.open(4)
        for count in (30, 1, 5, 4, 1, 9, 17, 33):
            run = tokens(count, count)
            got = passes.run([Row(cache, run, keep=count)])[0]
            assert torch.equal(got, eager(model, reference, run, count)), count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("implementation", ["sdpa", attention.EVERY_ROW])
def test_a_tree_row_gives_tree_forwards_logits_and_leaves_its_entries(models, implementation):
    model = models[implementation]
    pool = poisoned_pool()
    passes = StaticPasses(model, pool, max_sessions=2, max_length=1024, capture=False)
    mine, theirs = pool.open(4), pool.open(4)
    prompt = tokens(20, 3)
    passes.run([Row(mine, prompt[:-2])])
    eager(model, theirs, prompt[:-2], 1)
    nodes, parents = [5, 9, 11, 7, 2, 40], [0, 0, 1, 1, 3, 2]
    got = passes.run([tree_row(mine, prompt[-2:], nodes, parents)])[0]
    with torch.inference_mode():
        want = tree_forward(model, theirs, prompt[-2:], nodes, parents).float()
    assert got.shape == want.shape == (1 + len(nodes), CONFIG["vocab_size"])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    for layer in range(2):  # the same entries, every node's included
        length = theirs.lengths[layer]
        assert mine.lengths[layer] == length
        for arenas in (pool.keys, pool.values):
            a, b = (arenas[layer][:, pool.columns(c.extent)][:, :length] for c in (mine, theirs))
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_pads_write_only_the_scratch_page(models):
    model = models["sdpa"]
    pool = poisoned_pool()
    passes = StaticPasses(model, pool, max_sessions=4, max_length=1024, capture=False)
    cache = pool.open(8)
    neighbour = pool.open(4)  # right after it: a pad row written past its session's end would land here
    passes.run([Row(cache, tokens(3, 1))])
    passes.run([Row(cache, tokens(2, 2)), Row(neighbour, tokens(9, 3))])  # 16 rows each, 4 sessions
    first = cache.extent.start * pool.page_tokens
    for arena in (*pool.keys, *pool.values):
        held = arena[:, first : first + 5]
        assert torch.isfinite(held).all()
        assert torch.isnan(arena[:, first + 5 : first + 8]).all()  # past its entries: untouched


def test_a_watched_model_or_an_outside_session_runs_eagerly(models):
    model = models["sdpa"]
    pool = poisoned_pool()
    passes = StaticPasses(model, pool, max_sessions=2, max_length=100, capture=False)
    cache = pool.open(4)
    assert passes.fits([(cache, 5)])
    assert not passes.fits([(cache, MAX_TOKENS + 1)])  # a long prefill
    assert not passes.fits([(cache, 5)] * 3)  # more sessions than a batch
    assert not passes.fits([(pool.open(4), 1), (KVPool(2, 2, 8, 4, page_tokens=4).open(4), 1)])
    passes.run([Row(cache, tokens(60, 1))])
    assert passes.fits([(cache, 40)]) and not passes.fits([(cache, 41)])  # past max_length
    for layers in ([0], [1], [2]):  # the embeddings, a decoder layer, the final norm
        tap = FeatureTap(model, layers)
        with tap.recording():  # hooks see nothing of a replayed graph: the target's feature taps
            assert not passes.fits([(cache, 1)]), layers
    assert passes.fits([(cache, 1)])
    assert StaticPasses.supported(model) is None
    assert model.config._attn_implementation == GROUPED  # an SDPA model's grouped heads, read in place


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_passes_give_an_eager_passes_logits_on_cuda(models, dtype):
    """On a GPU: each bucket captured at its first pass and replayed after, the logits of eager
    passes over the same pool to rounding (float32: 1e-4, TF32 aside; bfloat16: 5e-2 of
    logits of about 1), and in float32 the same argmax."""
    model = copy.deepcopy(models["sdpa"]).to("cuda", dtype)
    pool = KVPool(layers=2, kv_heads=2, head_dim=8, pages=1000, dtype=dtype, device="cuda", page_tokens=4)
    passes = StaticPasses(model, pool, max_sessions=4, max_length=1024, capture=True)
    mine, theirs = [pool.open(4) for _ in range(2)], [pool.open(4) for _ in range(2)]
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for step, counts in enumerate([(30, 3), (1, 5), (1, 5), (9, 1), (1, 1), (1, 1)]):
        rows, wanted = [], []
        for index, (cache, reference, count) in enumerate(zip(mine, theirs, counts)):
            run = tokens(count, 10 * step + index)
            rows.append(Row(cache, run, keep=count))
            wanted.append(eager(model, reference, run, count))
        for got, want in zip(passes.run(rows), wanted):
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
            if dtype == torch.float32:
                assert torch.equal(got.argmax(-1), want.argmax(-1))
    replayed = [bucket for bucket, entry in passes._passes.items() if entry.graph is not None and entry.runs > 1]
    assert replayed, passes.describe()


def test_a_pass_that_fails_to_compile_runs_uncompiled_from_then_on(models, caplog):
    """--cuda-graphs compiled: a compiler failure (Dynamo's recompile limit, a backend error)
    costs the compilation, not the request: the same pass runs eagerly, with a warning."""
    model = models["sdpa"]
    pool = poisoned_pool()
    passes = StaticPasses(model, pool, max_sessions=2, max_length=1024, capture=False, compile=True)
    assert passes.describe().startswith("compiled, ")

    def broken(*_):
        raise RuntimeError("recompile limit")

    passes._compiled = broken
    cache, reference = pool.open(4), pool.open(4)
    for count in (7, 1):
        run = tokens(count, count)
        got = passes.run([Row(cache, run, keep=1)])[0]
        torch.testing.assert_close(got, eager(model, reference, run, 1), rtol=0, atol=2e-6)
    assert not passes.compile and not passes.describe().startswith("compiled")
    assert "runs uncompiled" in caplog.text and "recompile limit" in caplog.text


def test_the_compiled_setting_reaches_the_runners_passes(loaded):
    runner = DraftRunner(loaded, max_sessions=4, session_ttl_s=60, max_speculative_tokens=4)
    runner.max_batch_size = 4
    runner.use_static_passes("compiled")
    assert runner.static is not None and runner.static.compile and not runner.static.capture
    runner.use_static_passes("on")
    assert runner.static is not None and not runner.static.compile


@pytest.mark.parametrize(
    ("implementation", "quantization", "why"),
    [(attention.NAME, "", "row-wise attention"), ("sdpa", "int8 (per-channel weights)", "int8")],
)
def test_compiled_is_refused_at_start_up_where_torch_compile_cannot_trace_the_pass(
    models, implementation, quantization, why
):
    """A CPU target's row-wise attention and int8 Linear layers cannot be traced: `compiled`
    says so when the service starts, as `on` does for a model without static passes."""
    model = models[implementation]
    runner = SimpleNamespace(
        loaded=SimpleNamespace(
            device="cpu", tensor_parallel_size=1, quantization=quantization, model_id="tiny", max_context=256
        ),
        model=model,
        pool=poisoned_pool(),
        takes_static_passes=True,
        max_batch_size=2,
        max_speculative_tokens=4,
    )
    with pytest.raises(ValueError, match=f"--cuda-graphs compiled: tiny cannot run static passes: .*{why}"):
        static_passes_for(runner, "compiled")
    assert static_passes_for(runner, "on") is not None
