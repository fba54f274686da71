"""Pool specs, DNS lookups over UDP, and placement: least load, ties in turn, a replica that
fails or serves another model gets no session."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from coordinator import pools as pools_module
from coordinator.placement import PREFIX_AFFINITY_SLACK, prefix_keys
from coordinator.pools import Pool
from coordinator.replica import HUNG_AFTER_PROBES, Replica
from specdec.engine.modeling import load_causal_lm
from specdec.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from specdec.rpc import wire
from specdec.rpc.dns import parse_pool, resolve
from specdec.rpc.security import ChannelSecurity
from specdec.tools.testing import build_model, word_tokenizer
from specdec.v1 import common_pb2
from target_service.runner import TargetRunner
from tests.pool_helpers import DnsServer


def test_pool_specs():
    assert parse_pool("a:1, b:2").addresses == ("a:1", "b:2")
    spec = parse_pool("dns:///target.svc:50062")
    assert spec.dynamic and (spec.name, spec.port, spec.server) == ("target.svc", 50062, None) and not spec.srv
    assert parse_pool("dns://10.0.0.2:5353/t.svc:1").server == ("10.0.0.2", 5353)
    assert parse_pool("dns://10.0.0.2/t.svc:1").server == ("10.0.0.2", 53)
    srv = parse_pool("dns:///_grpc._tcp.target.ns.svc.cluster.local")
    assert srv.srv and (srv.name, srv.port) == ("_grpc._tcp.target.ns.svc.cluster.local", 0)
    for bad in ("", "a:1,a:1", "dns:target:1", "dns:///target", "dns:///target:0", "dns:///_grpc._tcp.t:"):
        with pytest.raises(ValueError):
            parse_pool(bad)


def test_a_dns_pool_reads_its_records_from_the_server_named():
    """A and AAAA records, SRV records (each a host and port), an answer too long for UDP read
    again over TCP, and a name the server does not know: an OSError that says so."""

    async def lookups(dns: DnsServer):
        spec = parse_pool(f"dns://127.0.0.1:{dns.port}/targets.pool.test:7")
        with pytest.raises(OSError, match="NXDOMAIN"):
            await resolve(spec)
        dns.records = ["127.0.0.2", "127.0.0.1"]
        assert await resolve(spec) == ("127.0.0.1:7", "127.0.0.2:7")
        dns.aaaa = ["::1"]
        assert await resolve(spec) == ("127.0.0.1:7", "127.0.0.2:7", "[::1]:7")
        assert dns.queries[("tcp", "A")] == 0
        dns.records = [f"10.0.{i // 250}.{i % 250}" for i in range(60)]  # 60 answers: over 512 bytes
        assert len(await resolve(spec)) == 61 and dns.queries[("tcp", "A")] == 1
        # SRV: the lowest priority's targets, each at its own port; the backup is left out.
        dns.records = ["127.0.0.3"]
        dns.aaaa = []
        dns.srv["_grpc._tcp.pool.test"] = [(0, 50062, "targets.pool.test"), (0, 50063, "targets.pool.test")]
        dns.srv["_grpc._tcp.pool.test"].append((10, 9, "backup.pool.test"))
        srv = parse_pool(f"dns://127.0.0.1:{dns.port}/_grpc._tcp.pool.test")
        assert await resolve(srv) == ("127.0.0.3:50062", "127.0.0.3:50063")
        with pytest.raises(OSError, match="NXDOMAIN"):
            await resolve(parse_pool(f"dns://127.0.0.1:{dns.port}/_grpc._tcp.other.test"))

    with DnsServer("targets.pool.test") as dns:
        asyncio.run(lookups(dns))


def test_a_dns_server_that_does_not_answer_is_an_oserror_naming_it():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        spec = parse_pool(f"dns://127.0.0.1:{silent.getsockname()[1]}/t.test:1")
        with pytest.raises(OSError, match="did not answer"):
            asyncio.run(resolve(spec))


class FakeClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    async def info(self, timeout_s=None):
        return common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8)

    async def serving(self, timeout_s=None):
        return True

    async def close(self):
        self.closed = True

    unended = 0

    def forget_unended(self, session_id: str) -> None:
        pass


def pool_of(*addresses: str) -> Pool:
    pool = Pool("target", parse_pool(",".join(addresses)), FakeClient)  # type: ignore[arg-type]
    info = common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8)
    pool.reference = info
    for address in addresses:
        replica = pool.add(address)
        replica.serving, replica.info = True, common_pb2.ModelInfo()
        replica.info.CopyFrom(info)
    return pool


def test_placement_takes_the_least_loaded_replica_and_spreads_ties():
    pool = pool_of("a:1", "b:1", "c:1")
    a, b, c = pool.replicas.values()
    placed = [pool.place() for _ in range(6)]
    assert [r.sessions for r in (a, b, c)] == [2, 2, 2] and len(set(map(id, placed))) == 3
    for _ in range(2):  # another coordinator's sessions count too, once two Infos have seen them
        a.seen(common_pb2.ModelInfo(model_id="m", open_sessions=a.sessions + 3))
    assert pool.place() in (b, c)
    assert pool.place(avoid=b) is c
    b.serving = False
    c.breaker.record_failure(), c.breaker.record_failure(), c.breaker.record_failure()
    assert pool.place(avoid=a) is None and pool.place() is a
    pool.release(a)
    assert a.sessions == 2


def test_other_coordinators_sessions_count_where_two_infos_in_a_row_saw_them():
    """A neighbour's request that ended after one Info must not load this coordinator's
    requests for another refresh (on a shared host that would stop them drafting)."""
    (replica,) = pool_of("a:1").replicas.values()
    replica.sessions = 1
    loads = []
    for open_sessions in (1, 4, 4, 2, 1):  # a neighbour's 3 sessions, seen twice, then ending
        replica.seen(common_pb2.ModelInfo(model_id="m", open_sessions=open_sessions))
        loads.append(replica.load[0])
    assert loads == [1, 1, 4, 2, 1]


def test_a_verify_reply_says_the_load_between_infos():
    """Each reply's held_sessions updates the count Infos make: a neighbour's request that
    ended no longer loads this coordinator's rounds two replies later, where the Infos alone
    (every 2 s) had its requests costed as loaded for up to 4 s, pipelining off."""
    (replica,) = pool_of("a:1").replicas.values()
    replica.sessions = 1
    for _ in range(2):  # a neighbour's request, seen by two Infos
        replica.seen(common_pb2.ModelInfo(model_id="m", open_sessions=2))
    loads = [replica.load[0]]
    for held in (1, 0, 1, 2, 2):  # this request's verifies: the neighbour gone, then a new one
        replica.answered("s", held)  # 0: a service that does not say
        loads.append(replica.load[0])
    assert loads == [2, 1, 1, 1, 1, 2]


def test_a_session_being_ended_keeps_its_place_but_is_no_load():
    """Between a request's end and its EndSession's answer the replica still holds the session:
    it fills one of --max-sessions (a new one placed in it would be refused), and an Info taken
    meanwhile counts it as this coordinator's, not another's; it no longer loads the replica's
    rounds (`load`)."""
    pool = pool_of("a:1")
    (replica,) = pool.replicas.values()
    replica.info.max_sessions = 2
    first, second = pool.place(reserve=10), pool.place(reserve=10)
    assert first is second is replica and not replica.room(0)
    pool.release(replica, 10, ending=True)
    assert replica.load[0] == 1 and not replica.room(0) and replica.reserved_bytes == 20
    for _ in range(2):
        replica.seen(common_pb2.ModelInfo(model_id="m", open_sessions=2, max_sessions=2))
    assert replica.others == 0
    pool.ended(replica, 10)
    assert replica.room(0) and replica.reserved_bytes == 10 and replica.ending == 0


def test_forks_on_a_draft_are_no_other_coordinators_load():
    """A draft's Info counts a request's hedges (forks) among its sessions; they are stepped in
    their request's passes, so load counts the sessions beside them. Counting this coordinator's
    own forks as others' had a hedged request cost its draft steps at a batch of 14 and settle at
    K = 3-4 for the rest of the request, against 6-8 (docs/benchmarks.md, emulated accelerators)."""
    (replica,) = pool_of("a:1").replicas.values()
    replica.sessions = 1
    for _ in range(2):  # its own session and 13 of its forks, then a neighbour's request too
        replica.seen(common_pb2.ModelInfo(model_id="m", open_sessions=14, fork_sessions=13))
    assert replica.load[0] == 1
    for _ in range(2):
        replica.seen(common_pb2.ModelInfo(model_id="m", open_sessions=16, fork_sessions=14))
    assert replica.load[0] == 2


def test_a_replica_that_took_a_prompt_prefix_takes_the_next_session_that_starts_with_it():
    pool = pool_of("a:1", "b:1", "c:1")
    a, b, c = pool.replicas.values()
    for info in [pool.reference, *(replica.info for replica in (a, b, c))]:
        info.prefix_cache.block_tokens, info.prefix_cache.max_bytes = 4, 1 << 20
    conversation = list(range(1, 14))  # 3 whole blocks, then a token
    first = pool.place(prompt=("", conversation))
    # The next turn starts with the first: its replica takes it, though others are as loaded.
    assert pool.place(prompt=("", conversation + [20, 21, 22, 23])) is first
    # Another namespace's prompt has no holder, however alike its tokens.
    assert pool.placement.holder(prefix_keys(("other tenant", conversation), 4), [a, b, c]) is None
    others = [replica for replica in (a, b, c) if replica is not first]
    # Affinity yields to load: PREFIX_AFFINITY_SLACK sessions beyond the least loaded, no more.
    first.sessions = min(r.sessions for r in others) + PREFIX_AFFINITY_SLACK + 1
    assert pool.place(prompt=("", conversation)) is not first
    # Without a prefix cache on the replicas, placement is by load alone.
    plain = pool_of("a:1", "b:1")
    placed = {id(plain.place(prompt=("", conversation))) for _ in range(2)}
    assert len(placed) == 2


def test_coordinators_that_share_nothing_place_a_prompts_next_turn_where_its_prefix_is():
    """Two coordinators behind a load balancer: a chat's first turn goes through one, its next
    through the other, which never saw it; both name the same replica (rendezvous hashing on
    the prompt's first block, coordinator.placement), and prompts that differ spread out."""

    def coordinator() -> Pool:
        pool = pool_of("a:1", "b:1", "c:1")
        for info in [pool.reference, *(replica.info for replica in pool.replicas.values())]:
            info.prefix_cache.block_tokens, info.prefix_cache.max_bytes = 4, 1 << 20
        return pool

    one, other = coordinator(), coordinator()
    placed = {}
    for chat in range(12):
        conversation = [100 + chat, *range(1, 13)]
        first = one.place(prompt=("", conversation))
        assert first is not None
        first.sessions -= 1  # the turn ended
        later = other.place(prompt=("", conversation + [20, 21, 22, 23]))
        assert later is not None and later.address == first.address, chat
        later.sessions -= 1
        placed[chat] = first.address
    assert len(set(placed.values())) == 3, f"12 different prompts all went to {set(placed.values())}"
    # Load still bounds affinity.
    target = other.replicas[placed[0]]
    target.sessions = PREFIX_AFFINITY_SLACK + 1
    assert other.place(prompt=("", [100, *range(1, 13)])) is not target


def test_a_pool_places_sessions_as_the_placement_it_is_given_chooses():
    """Placement is a policy passed to the pool (coordinator.placement): the pool offers the
    replicas serving with room, takes one of those the policy names, in turn, and tells it."""

    class Last:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def choose(self, candidates, keys):
            return candidates[-1:]

        def placed(self, keys, replica):
            self.calls.append((keys, replica.address))

    pool = pool_of("a:1", "b:1", "c:1")
    pool.placement = Last()
    c = pool.replicas["c:1"]
    assert [pool.place(prompt=("", [1, 2])) for _ in range(3)] == [c, c, c]
    assert pool.placement.calls == [([], "c:1")] * 3  # no prefix cache on these replicas: no keys
    assert pool.place(avoid=c) is pool.replicas["b:1"], "the replica a session leaves is never offered"


def test_a_replica_serving_another_model_is_refused():
    pool = pool_of("a:1")
    other = common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8, quantization="int8")
    assert "quantization" in pool.mismatch(other)
    replica = pool.add("b:1")
    pool._apply(replica, other)
    assert replica.refused and not replica.serving
    same = common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8)
    pool._apply(replica, same)
    assert not replica.refused and replica.serving
    # A lower --max-speculative-tokens would refuse the pool's longest copies.
    assert "max_speculative_tokens" in pool.mismatch(
        common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8, max_speculative_tokens=16)
    )


# What the target replicas in the tests below share beside their weights.
SERVED = dict(tokenizer_fingerprint="f", vocab_size=8, dtype="float32", device_kind="cpu", tensor_parallel_size=1)


def test_target_replicas_are_one_pool_by_their_weights_not_their_path():
    """Two replicas with one --model path and other weights (a checkpoint replaced on one
    machine) would mix two models' outputs in a request that fails over: refused, naming each
    field that differs with both values. The same weights from another path are the same model."""
    pool = Pool("target", parse_pool("a:1"), FakeClient)  # type: ignore[arg-type]
    pool.reference = common_pb2.ModelInfo(model_id="/models/qwen", weights_fingerprint="aaaa", **SERVED)
    replica = pool.add("b:1")
    pool._apply(replica, common_pb2.ModelInfo(model_id="/models/qwen", weights_fingerprint="bbbb", **SERVED))
    assert not replica.serving and replica.refused == (
        "it serves model_id '/models/qwen' where the pool serves '/models/qwen', "
        "and they differ in weights_fingerprint 'bbbb' (the pool's 'aaaa')"
    )
    elsewhere = common_pb2.ModelInfo(model_id="/mnt/b/qwen", weights_fingerprint="aaaa", **SERVED)
    pool._apply(replica, elsewhere)
    assert replica.serving and not replica.refused
    numerics = common_pb2.ModelInfo()
    numerics.CopyFrom(elsewhere)
    numerics.dtype, numerics.device_kind, numerics.tensor_parallel_size = "bfloat16", "cuda", 2
    differ = pool.mismatch(numerics).split(", and they differ in ")[1].split("; ")
    assert differ == [
        "dtype 'bfloat16' (the pool's 'float32')",
        "device_kind 'cuda' (the pool's 'cpu')",
        "tensor_parallel_size '2' (the pool's '1')",
    ]
    # A build from before the fingerprint reports none: its path is compared instead.
    older = common_pb2.ModelInfo(model_id="/mnt/b/qwen", **SERVED)
    assert "model_id '/mnt/b/qwen' (the pool's '/models/qwen')" in pool.mismatch(older)


def test_a_target_loading_another_checkpoint_from_the_same_path_is_refused(tmp_path):
    """Through real runners: the folder's checkpoint replaced between two replicas' loads."""
    folder = tmp_path / "model"
    infos = []
    for seed in (0, 1):
        build_model(folder, word_tokenizer(12), seed=seed, logit_scale=1.0, eos_token_id=None)
        runner = TargetRunner(load_causal_lm(str(folder), "float32", "cpu"), 1, 60, 4)
        infos.append(wire.description_to_pb(runner.describe()))
    pool = Pool("target", parse_pool("a:1"), FakeClient)  # type: ignore[arg-type]
    pool.reference = infos[0]
    assert infos[1].model_id == infos[0].model_id
    assert pool.mismatch(infos[1]).endswith(
        f"weights_fingerprint {infos[1].weights_fingerprint!r} (the pool's {infos[0].weights_fingerprint!r})"
    )


def test_a_dns_pool_checks_tls_certificates_for_its_name():
    """A replica found by DNS is reached at its IP address; its certificate names the Service."""
    plain = ChannelSecurity()
    assert plain.for_name("target.svc") is plain
    tls = ChannelSecurity(credentials=grpc.ssl_channel_credentials())
    assert ("grpc.ssl_target_name_override", "target.svc") in tls.for_name("target.svc").options
    named = ChannelSecurity(tls.credentials, (("grpc.ssl_target_name_override", "set"),))
    assert named.for_name("target.svc") is named
    # An SRV pool's certificates name the Service, not the SRV record (before: "_grpc._tcp.target.svc").
    assert parse_pool("dns:///_grpc._tcp.target.svc").host_name == "target.svc"
    assert parse_pool("dns:///target.svc:50062").host_name == "target.svc"


def test_draft_replicas_must_share_the_same_tokens_with_the_target():
    """Drafts of another family (ModelInfo.vocab_bridge): a replica that may propose other
    target ids than the pool's reference is refused; one of the same draft is not."""
    bridge = common_pb2.VocabBridgeInfo(draft_tokenizer_fingerprint="d", shared_tokens=3, proposable=b"\x07")
    reference = common_pb2.ModelInfo(model_id="small", tokenizer_fingerprint="f", vocab_size=8, vocab_bridge=bridge)
    pool = Pool("draft", parse_pool("a:1"), FakeClient)  # type: ignore[arg-type]
    pool.reference = reference
    same = common_pb2.ModelInfo()
    same.CopyFrom(reference)
    same.model_id = "small+lookup[2..4]"  # another drafter of the same draft: logged, not refused
    same.weights_fingerprint = "other"  # or other weights: a draft changes the speed, not the output
    assert pool.mismatch(same) == ""
    replica = pool.add("b:1")
    pool._apply(replica, same)
    assert replica.serving
    other = common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8)  # the target's own family
    assert "vocab_bridge.draft_tokenizer_fingerprint" in pool.mismatch(other)
    fewer = common_pb2.ModelInfo()
    fewer.CopyFrom(reference)
    fewer.vocab_bridge.proposable = b"\x03"
    assert "vocab_bridge.proposable" in pool.mismatch(fewer)
    shorter = common_pb2.ModelInfo()
    shorter.CopyFrom(reference)
    shorter.max_speculative_tokens = 2  # a request's K is checked against the first replica's
    assert "max_speculative_tokens" in pool.mismatch(shorter)


def test_eagle_head_replicas_must_read_one_targets_features():
    """A head (--drafter eagle) made for another target, or reading other layers, is refused as
    a later replica as check_pair refuses it as the first; a head restarted as another drafter,
    which says none of it, still serves."""
    head = common_pb2.ModelInfo(
        model_id="head",
        tokenizer_fingerprint="f",
        vocab_size=8,
        feature_layers=[2, 14, 25],
        feature_target_fingerprint="w" * 64,
        feature_target_checkpoint="c" * 64,
    )
    pool = Pool("draft", parse_pool("a:1"), FakeClient)  # type: ignore[arg-type]
    pool.reference = head
    for name, value in (("feature_target_checkpoint", "x" * 64), ("feature_target_fingerprint", "y" * 64)):
        other = common_pb2.ModelInfo()
        other.CopyFrom(head)
        setattr(other, name, value)
        assert name in pool.mismatch(other)
    layers = common_pb2.ModelInfo()
    layers.CopyFrom(head)
    layers.feature_layers[:] = [28]
    assert "feature_layers" in pool.mismatch(layers)
    same = common_pb2.ModelInfo()
    same.CopyFrom(head)
    assert pool.mismatch(same) == ""
    assert pool.mismatch(common_pb2.ModelInfo(model_id="lookup", tokenizer_fingerprint="f", vocab_size=8)) == ""


class SilentClient(FakeClient):
    """A replica whose Info never answers in time (a frozen process), counting the calls
    given up on there; `answers` makes it answer again."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.in_flight, self.abandoned, self.answers = 1, 0, False
        self.calls: list[tuple[float, float]] = []  # its calls in flight: (sent, deadline), loop time

    async def info(self, timeout_s: float) -> common_pb2.ModelInfo:
        if not self.answers:
            raise DeadlineExceeded(f"{self.address} did not answer")
        return common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8)

    async def serving(self, timeout_s: float) -> bool | None:
        return True if self.answers else None

    def abandon_calls(self, why: str) -> int:
        self.abandoned += self.in_flight
        return self.in_flight

    def calls_due(self, sent_by: float) -> float | None:
        return max((due for sent, due in self.calls if sent <= sent_by), default=None)


class BusyClient(SilentClient):
    """A replica busy with a long pass, or stuck in one: its Info is late, its health (its
    event loop's) answers."""

    async def serving(self, timeout_s: float) -> bool | None:
        return True


def busy_pool() -> tuple[Pool, Replica, Replica]:
    """Two replicas, the first's Info late (BusyClient)."""
    pool = pool_of("a:1", "b:1")
    a, b = pool.replicas.values()
    a.client = BusyClient("a:1")
    return pool, a, b


async def refreshes(pool: Pool, times: int) -> None:
    for _ in range(times):
        await pool.refresh()


def test_a_replica_that_stops_answering_has_its_calls_given_up_on_where_they_can_go_elsewhere():
    pool = pool_of("a:1", "b:1")
    a, b = pool.replicas.values()
    a.client = SilentClient("a:1")
    b.client = SilentClient("b:1")
    b.client.answers = True
    asyncio.run(refreshes(pool, HUNG_AFTER_PROBES - 1))
    assert not a.serving and not a.hung and a.client.abandoned == 0  # one missed probe: a pause, perhaps
    asyncio.run(refreshes(pool, 1))
    assert a.hung and a.client.abandoned == 1 and a.abandoned == 1 and not a.breaker.allow()
    assert pool.place() is b
    a.client.answers = True  # back: it serves again and its breaker closes
    asyncio.run(refreshes(pool, 1))
    assert a.serving and not a.hung and a.breaker.allow()

    # A lone target replica keeps its calls: there is nowhere else to go, and it may yet answer.
    alone = pool_of("a:1")
    only = alone.replicas["a:1"]
    only.client = SilentClient("a:1")
    asyncio.run(refreshes(alone, HUNG_AFTER_PROBES + 1))
    assert only.hung and only.client.abandoned == 0
    # A lone draft replica's calls are given up on: rounds run target-only meanwhile.
    drafts = Pool("draft", parse_pool("d:1"), SilentClient)  # type: ignore[arg-type]
    asyncio.run(refreshes(drafts, HUNG_AFTER_PROBES))
    (draft,) = drafts.replicas.values()
    assert draft.client.abandoned == 1 and not draft.breaker.allow()


def test_a_replica_whose_info_is_late_but_health_answers_is_busy_not_hung():
    """Info waits behind the replica's running pass (a long prompt's prefill takes seconds on a
    CPU); its health, answered on its event loop, does not. A replica that answers its health
    but not Info in time keeps serving with its last Info, and its calls are not given up on:
    before, a prefill longer than two probes sent its session to another replica, whose own
    prefill of it was then taken for a hang in turn, and a long prompt never finished."""

    pool, a, b = busy_pool()
    last = a.info
    asyncio.run(refreshes(pool, HUNG_AFTER_PROBES + 2))
    assert a.serving and not a.hung and a.unanswered == 0 and a.info is last
    assert a.client.abandoned == 0 and a.breaker.allow()
    a.breaker.trip()  # a failed call: only an Info heard afresh closes it again
    asyncio.run(refreshes(pool, 1))
    assert not a.breaker.allow()

    # Late for longer than a call's deadline, its model thread is stuck in a pass: hung.
    pool.stuck_after_s = 0.0
    asyncio.run(refreshes(pool, 1))
    assert a.hung and not a.serving and a.client.abandoned == 1 and pool.place() is b
    a.client.answers = True  # its Info comes again: busy no more
    asyncio.run(refreshes(pool, 1))
    assert a.serving and not a.hung and not a.stuck


def test_a_replica_prefilling_a_long_prompt_is_busy_for_as_long_as_the_call_may_take():
    """A call that sends a long prompt is given its prefill's time past the flat deadline
    (coordinator.upstream.prefill_allowance_s), and a prefill run as one pass (a float target
    without a prefix cache) keeps Info waiting all that time: the replica is not hung while a
    call of this coordinator's may still be answered there. Before, it was hung once Info had
    been late for the flat deadline, its calls given up on and moved, and the next replica's
    prefill of the same prompt went the same way: the prompt never finished."""
    pool, a, b = busy_pool()
    pool.stuck_after_s = 0.0  # Info late past the flat deadline ...

    async def late_with_a_call_due(due_in: float, sent_ago: float = 10.0) -> None:
        now = asyncio.get_running_loop().time()
        a.client.calls = [(now - sent_ago, now + due_in)]
        a.late_since = None
        await refreshes(pool, 2)

    asyncio.run(late_with_a_call_due(3600.0))  # ... while a call there may take an hour more
    assert a.serving and not a.hung and not a.stuck and a.client.abandoned == 0
    asyncio.run(late_with_a_call_due(-1.0))  # past every call's deadline: stuck in a pass
    assert a.hung and a.client.abandoned > 0 and pool.place() is b


def test_calls_sent_to_a_late_replica_do_not_keep_it_from_being_found_hung():
    """Only a call sent before a replica's Info went late can be what it is busy with; those
    sent since wait behind. A hung replica that kept its last Info (busy, as far as anyone
    knew) still took new sessions, and each new call's deadline would have put off finding
    it hung for good, its requests failing DEADLINE_EXCEEDED one after the other."""
    pool, a, b = busy_pool()
    pool.stuck_after_s = 0.0

    async def late_then_new_calls() -> None:
        await pool.refresh()  # its Info is late from here
        now = asyncio.get_running_loop().time()
        a.client.calls = [(now + 0.01, now + 3600.0)]  # a call sent since, with an hour to run
        await asyncio.sleep(0.02)
        await pool.refresh()

    asyncio.run(late_then_new_calls())
    assert a.hung and a.client.abandoned > 0 and pool.place() is b


class RestartedClient(BusyClient):
    """A replica restarted serving another model: its Info answers once (the lost session's
    check), then is late (busy re-prefilling), so a refresh keeps its last Info."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.answers = True

    async def info(self, timeout_s: float) -> common_pb2.ModelInfo:
        if not self.answers:
            raise DeadlineExceeded(f"{self.address} did not answer")
        self.answers = False
        return common_pb2.ModelInfo(model_id="m", tokenizer_fingerprint="f", vocab_size=8, quantization="int8")


def test_a_replica_refused_for_another_model_stays_refused_while_its_info_is_late():
    """check_same_model refused it; a refresh that then found its Info late (busy) used to
    keep its Info from before the restart, the old model's, which matched: the refusal was
    cleared and the replica took new sessions, and failovers, for another model's tokens."""
    pool, a, b = busy_pool()
    a.client = RestartedClient("a:1")
    with pytest.raises(Unavailable, match="refused now: .*quantization"):
        asyncio.run(pool.check_same_model(a))
    asyncio.run(refreshes(pool, 2))
    assert a.refused and not a.serving and not a.usable and pool.place() is b


class FlakyHealthClient(BusyClient):
    """A busy replica (Info late) whose health stops answering while `down`."""

    down = False

    async def serving(self, timeout_s: float) -> bool | None:
        return None if self.down else True


def test_a_replica_late_before_it_went_down_is_late_from_scratch_when_back():
    """Its Info was late, then its health stopped answering (a crash, a drain); back later and
    busy again (re-prefills), it used to count as late since before it went down: hung at
    once, its calls given up on, the very re-prefills that kept it busy."""
    pool, a, b = busy_pool()
    a.client = FlakyHealthClient("a:1")
    pool.stuck_after_s = 0.2

    async def late_down_then_back() -> None:
        await pool.refresh()  # Info late from here
        a.client.down = True
        await pool.refresh()
        await asyncio.sleep(0.3)  # down for longer than a call's deadline
        a.client.down = False
        await pool.refresh()  # back, and busy

    asyncio.run(late_down_then_back())
    assert not a.stuck and not a.hung and a.client.abandoned == 0


def budgeted_pool(*addresses: str, budget: int, max_sessions: int = 0) -> Pool:
    """A pool whose replicas hold `budget` bytes of KV at 1 byte a token (K up to 3: a
    session of n tokens reserves n + 4 bytes)."""
    pool = pool_of(*addresses)
    for info in (pool.reference, *(replica.info for replica in pool.replicas.values())):
        assert info is not None
        info.max_kv_cache_bytes, info.kv_bytes_per_token, info.max_speculative_tokens = budget, 1, 3
        info.max_context, info.max_sessions = 1000, max_sessions
    return pool


def test_a_replica_takes_sessions_while_what_they_may_grow_to_fits_its_budget():
    pool = budgeted_pool("a:1", "b:1", budget=100)
    a, b = pool.replicas.values()
    reserve = pool.reservation(36)
    assert reserve == 40
    placed = [pool.place(reserve=reserve, fit=True) for _ in range(4)]
    assert [r.sessions for r in (a, b)] == [2, 2] and a.reserved_bytes == 80
    assert pool.place(reserve=reserve, fit=True) is None  # a third of 40 bytes would pass 100
    moved = pool.place(reserve=reserve)
    assert moved in (a, b)  # a moved session goes somewhere all the same
    pool.release(moved, reserve), pool.release(placed[0], reserve)
    assert placed[0].reserved_bytes == 40 and placed[0].room(reserve)
    # Others' sessions take their share of the bytes the Info saw held.
    lone = budgeted_pool("c:1", budget=100)
    (c,) = lone.replicas.values()
    assert lone.place(reserve=reserve, fit=True) is c
    for _ in range(2):
        c.seen(common_pb2.ModelInfo(open_sessions=2, kv_cache_bytes=90, max_kv_cache_bytes=100))
    assert c.others == 1 and c.others_bytes == 45 and not c.room(reserve)
    # A replica with none of this coordinator's sessions takes one however large: it runs alone.
    empty = budgeted_pool("d:1", budget=100)
    assert empty.place(reserve=500, fit=True) is not None


def test_max_sessions_counts_every_coordinators_sessions():
    pool = budgeted_pool("a:1", budget=0, max_sessions=2)
    (a,) = pool.replicas.values()
    assert pool.place(fit=True) is a
    for _ in range(2):
        a.seen(common_pb2.ModelInfo(open_sessions=2, max_sessions=2))
    assert a.others == 1 and pool.place(fit=True) is None


def test_requests_wait_in_arrival_order_for_room_and_give_up_in_time():
    async def scenario():
        pool = budgeted_pool("a:1", budget=100)
        (a,) = pool.replicas.values()
        reserve = pool.reservation(46)  # 50 bytes: two fit
        first = [await pool.admit(("", [1]), reserve, 5.0, 8) for _ in range(2)]
        assert [waited for _, waited in first] == [0.0, 0.0]
        order: list[int] = []

        async def waiter(i: int):
            replica, waited = await pool.admit(("", [1]), reserve, 5.0, 8)
            order.append(i)
            return waited

        waiters = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert pool.waiting == 3 and not order
        with pytest.raises(ResourceExhausted, match="3 requests already wait"):
            await pool.admit(("", [1]), reserve, 5.0, 3)
        pool.release(a, reserve)
        await asyncio.sleep(0.05)
        assert order == [0] and pool.waiting == 2
        pool.release(a, reserve), pool.release(a, reserve)
        await asyncio.sleep(0.05)
        assert order == [0, 1, 2] and pool.waiting == 0
        assert all(waited > 0.04 for waited in await asyncio.gather(*waiters))
        assert a.sessions == 2 and a.reserved_bytes == 100
        with pytest.raises(ResourceExhausted, match="waited 0 s .--queue-timeout."):
            await pool.admit(("", [1]), reserve, 0.1, 8)
        assert pool.waiting == 0 and a.sessions == 2  # the one that gave up holds nothing
        # A waiter cancelled (its client went away) leaves the line, and the next moves up.
        late = asyncio.create_task(pool.admit(("", [1]), reserve, 5.0, 8))
        later = asyncio.create_task(pool.admit(("", [1]), reserve, 5.0, 8))
        await asyncio.sleep(0.05)
        late.cancel()
        pool.release(a, reserve)
        replica, _ = await asyncio.wait_for(later, 1.0)
        assert replica is a and pool.waiting == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["a failed call", "a missed probe"])
def test_a_full_lone_target_that_stops_counting_as_serving_gets_no_more_than_its_room(how):
    """A lone target holds what its budget allows and three requests wait. One failed call
    (Upstream.verify marks it not serving till the next refresh) or one missed Info probe
    woke the queue onto it through the fallback for a pool with none serving, past its
    --max-kv-bytes and --max-sessions. Now a session that ends makes room for one."""

    async def scenario():
        pool = budgeted_pool("a:1", budget=100, max_sessions=3)
        (a,) = pool.replicas.values()
        reserve = pool.reservation(46)  # 50 bytes: two fit
        for _ in range(2):
            await pool.admit(("", [1]), reserve, 5.0, 8)
        waiters = [asyncio.create_task(pool.admit(("", [1]), reserve, 5.0, 8)) for _ in range(3)]
        await asyncio.sleep(0.05)
        if how == "a failed call":
            a.serving = False
        else:

            async def unanswered(timeout_s=None):
                raise DeadlineExceeded("a:1 did not answer within 2 s")

            async def silent(timeout_s=None):
                return None

            a.client.info, a.client.serving = unanswered, silent
            await pool.refresh()
        assert not a.serving
        pool.release(a, reserve)  # room for one
        await asyncio.sleep(0.05)
        assert sum(waiter.done() for waiter in waiters) == 1 and (a.sessions, a.reserved_bytes) == (2, 100)
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(scenario())


def test_replicas_gone_from_the_dns_records_leave_the_pool_and_close(monkeypatch):
    """A rollout gives pods new addresses: those with none of this coordinator's sessions
    leave at once (they stayed, channels open, one metrics series each, for good); one that
    holds a session leaves when it ends."""
    records = ["10.0.0.1:1", "10.0.0.2:1"]

    async def resolve(spec):
        return tuple(records)

    monkeypatch.setattr(pools_module, "resolve", resolve)
    pool = Pool("target", parse_pool("dns:///svc.example:1"), FakeClient)  # type: ignore[arg-type]

    async def scenario():
        await pool.refresh()
        first = list(pool.replicas.values())
        held = pool.place()
        assert held is not None
        for generation in range(2, 6):
            records[:] = [f"10.0.{generation}.1:1", f"10.0.{generation}.2:1"]
            await pool.refresh()
        await asyncio.sleep(0)
        assert len(pool.replicas) == 3 and held.address in pool.replicas  # the two newest, and the one held
        pool.release(held)
        await asyncio.sleep(0)
        assert len(pool.replicas) == 2 and all(replica.client.closed for replica in first)

    asyncio.run(scenario())


def test_sessions_placed_but_not_yet_opened_there_are_no_other_coordinators():
    """A target opens a session at its first call, so an Info taken between a placement and
    that call's answer does not count it: those sessions are this coordinator's all the same,
    and taking the Info's count beyond the ones it has answered for as others' let two
    coordinators sharing a target place past its --max-sessions (RESOURCE_EXHAUSTED) and its
    KV budget."""
    pool = budgeted_pool("a:1", budget=100, max_sessions=4)
    (a,) = pool.replicas.values()
    assert pool.place(fit=True, session_id="s1") is a and pool.place(fit=True, session_id="s2") is a
    for _ in range(2):  # another coordinator's two sessions; ours not opened yet
        a.seen(common_pb2.ModelInfo(open_sessions=2, kv_cache_bytes=90, max_sessions=4, max_kv_cache_bytes=100))
    assert a.others == 2 and a.others_bytes == 90 and pool.place(fit=True, session_id="s3") is None
    a.answered("s1")  # its first call answered: the target counts it from now on
    for _ in range(2):
        a.seen(common_pb2.ModelInfo(open_sessions=3, max_sessions=4))
    assert a.others == 2
    pool.release(a, session_id="s2")  # released before any call: nothing of it was ever there
    assert a.pending == set()


class UnendedClient(FakeClient):
    """A replica with EndSessions it did not answer (ServiceClient.end_unended)."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.unended, self.resent, self.forgotten = 2, 0, []  # type: ignore[misc]
        self.answers = False

    async def info(self, timeout_s=None):
        if not self.answers:
            raise DeadlineExceeded(f"{self.address} did not answer")
        return await super().info(timeout_s)

    def calls_due(self, sent_by: float) -> float | None:
        return None

    async def end_unended(self) -> None:
        self.resent += 1
        self.unended = 0  # type: ignore[misc]

    def forget_unended(self, session_id: str) -> None:
        self.forgotten.append(session_id)


def test_a_replica_answering_again_is_sent_the_ends_it_missed_and_placing_forgets_them():
    pool = pool_of("a:1", "b:1")
    a = pool.replicas["a:1"]
    a.client = client = UnendedClient("a:1")

    async def refreshed(times: int) -> None:
        for _ in range(times):
            await pool.refresh()
        await asyncio.sleep(0)  # the resend runs in the background
        await asyncio.gather(*pool._ending.values())

    asyncio.run(refreshed(2))  # Info late (busy): its last Info kept, nothing sent yet
    assert client.resent == 0
    client.answers = True
    asyncio.run(refreshed(2))  # heard afresh: sent once
    assert client.resent == 1 and client.unended == 0
    pool._take([a], session_id="back-again")
    assert client.forgotten == ["back-again"]
