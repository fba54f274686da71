"""Per-request speculation figures, and the Prometheus metrics fed from them. Counting lives
in the dataclass; sinks (responses, logs, Prometheus) read it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from coordinator.state import RoundRecord, Source
from specdec.sampling.relaxed import AcceptanceMode


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    rounds: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    generated_tokens: int = 0
    reprefills: int = 0
    draft_ms: float = 0.0  # waiting on Propose calls
    target_ms: float = 0.0  # waiting on Verify calls
    draft_compute_ms: float = 0.0  # model work inside the draft service
    target_compute_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    total_ms: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)  # index i: rounds accepting draft i
    pipelined: bool = False
    predrafts: int = 0  # continuations started during a verify
    predraft_hits: int = 0  # whole round accepted and the bonus equalled the pre-draft's first token (or a fork's)
    bonus_guess_hits: int = 0  # of those, kept from a fork that guessed a runner-up (--bonus-guesses)
    predraft_misses: int = 0  # whole round accepted, but a different bonus token (or no draft past the guess)
    predrafted_tokens: int = 0  # tokens of pre-drafts that completed and were read
    predraft_wasted_tokens: int = 0  # of those, tokens discarded (misses)
    predraft_compute_ms: float = 0.0  # draft model work inside read pre-drafts (overlapped)
    k_per_round: list[int] = field(default_factory=list)  # drafts verified per round
    accepted_per_round: list[int] = field(default_factory=list)  # of them, accepted (those the output took)
    round_ms: list[float] = field(default_factory=list)  # wall time of each round
    round_overhead_ms: list[float] = field(default_factory=list)  # of it, not inside the services' model work
    draft_failures: int = 0  # draft calls that failed after retries
    fallback_rounds: int = 0  # rounds run target-only because the draft failed or was skipped
    target_retries: int = 0  # target calls retried after UNAVAILABLE (a restarting target)
    hedges: int = 0  # branches forked for likely rejection outcomes during verifies
    hedge_hits: int = 0  # rounds that ended as a branch assumed, whose drafts were used
    hedged_tokens: int = 0  # drafts taken from hits
    hedge_wasted_tokens: int = 0  # drafts of hedges that were read but not used
    branch_failures: int = 0  # branches the draft answered with an error (their rounds ran without them)
    branch_wait_ms: float = 0.0  # waiting on pre-draft/hedge replies after verifies returned
    ready_rounds: int = 0  # rounds whose drafts came from a pre-draft or hedge
    catch_up_rounds: int = 0  # pipelined rounds run target-only while the draft drafted the next
    copied_rounds: int = 0  # rounds whose drafts the draft copied by prompt lookup
    tree_rounds: int = 0  # rounds that verified a token tree
    copied_tokens: int = 0  # drafts in them
    copied_accepted: int = 0  # of those, accepted
    target_numerics: str = ""  # what computed the target's logits: the output is that model's distribution
    target_replica: str = ""  # the replica that served the request's last round
    draft_replica: str = ""  # the draft replica its session was on then ("" : none)
    replica_moves: int = 0  # times its sessions moved to another replica after a failed call
    queued_ms: float = 0.0  # waited for room on a target replica before its first round
    sessions_per_round: list[int] = field(default_factory=list)  # load each round's K was costed at
    acceptance_mode: str = "exact"  # the rule that produced the output (AcceptanceMode's value); relaxed is lossy
    relaxed_top_n: int = 0  # the relaxed parameters (0 when exact)
    relaxed_delta: float = 0.0
    relaxed_accepted_tokens: int = 0  # accepted drafts the exact rule rejected (relaxed rounds only)
    foreign_tokens: int = 0  # verified drafts outside the tokens a bridged draft shares with the target
    _start: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def degraded(self) -> bool:
        return self.fallback_rounds > 0

    @property
    def predraft_cancelled(self) -> int:
        """Pre-drafts neither used nor missed: a draft token was rejected (or the generation
        ended, or the call failed), so they were cancelled unread. Every pre-draft is settled
        as exactly one of the three."""
        return self.predrafts - self.predraft_hits - self.predraft_misses

    def record_round(
        self, num_draft: int, num_accepted: int, bonus: bool | None = None, next_token: bool = True
    ) -> None:
        """`bonus`: whether the round ended in a bonus token, where that is not "every draft
        accepted" (a tree: its accepted path reached a leaf); `next_token`: whether the output
        took it (`num_accepted`: the accepted drafts it took)."""
        self.rounds += 1
        self.k_per_round.append(num_draft)
        self.accepted_per_round.append(num_accepted)
        self.proposed_tokens += num_draft
        self.accepted_tokens += num_accepted
        if next_token:
            ended_in_bonus = (num_accepted == num_draft) if bonus is None else bonus
            self.bonus_tokens += ended_in_bonus
            self.recovered_tokens += not ended_in_bonus
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def observe(self, record: RoundRecord) -> None:
        """A committed round's counters, from its record (`coordinator.commit.commit_round`);
        each further step of a target-only call counts as a round of its own."""
        proposed = record.proposed
        # Only what the output took: a generation that ended inside the round counts the tokens
        # it returned (generated = accepted + recovered + bonus + steps).
        taken = min(record.accepted, record.emitted)
        self.record_round(proposed, taken, record.bonus, record.emitted > record.accepted)
        self.ready_rounds += record.source in (Source.PREDRAFT, Source.HEDGE)
        self.catch_up_rounds += record.source is Source.CATCH_UP
        self.fallback_rounds += record.source is Source.FALLBACK
        self.tree_rounds += record.tree
        self.foreign_tokens += record.foreign
        self.relaxed_accepted_tokens += sum(position < taken for position in record.relaxed_positions)
        if record.copied:  # from a draft call, a pre-draft or a hedge alike
            self.copied_rounds += 1
            self.copied_tokens += proposed
            self.copied_accepted += taken
        for _ in range(record.steps):
            self.record_round(0, 0)
        if self.sessions_per_round:  # the call's further steps ran at the load its first was costed at
            self.sessions_per_round += [self.sessions_per_round[-1]] * record.steps

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self._start) * 1e3

    def work_marks(self) -> tuple[float, float, float]:
        """Where the model-work counters stand, for `work_ms_since`."""
        return (self.draft_compute_ms + self.target_compute_ms, self.branch_wait_ms, self.predraft_compute_ms)

    def work_ms_since(self, marks: tuple[float, float, float]) -> float:
        """Model work on the rounds' path since `marks`: their own Propose and Verify calls' compute,
        and of the pre-drafts' the part a round waited for after its verify (the rest ran beside it)."""
        compute, waited, predrafted = marks
        own = self.draft_compute_ms + self.target_compute_ms - compute
        return own + min(self.branch_wait_ms - waited, self.predraft_compute_ms - predrafted)

    def mark_first_token(self) -> None:
        if not self.time_to_first_token_ms:
            self.time_to_first_token_ms = self.elapsed_ms()

    def close(self, generated_tokens: int) -> None:
        self.generated_tokens = generated_tokens
        self.total_ms = self.elapsed_ms()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, the recovered/bonus token included (as vLLM counts it)."""
        committed = self.accepted_tokens + self.recovered_tokens + self.bonus_tokens  # a last round may end early
        return committed / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / (self.total_ms / 1e3) if self.total_ms else 0.0


# Round latency on CPU is ~0.1-1 s; on a GPU a few ms to tens of ms.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class CoordinatorMetrics:
    """Prometheus counters for speculation, in vLLM's spec-decode shape under `specdec_`
    (accepted tokens / draft tokens is the acceptance rate operators watch), plus requests by
    finish reason and status, latency histograms, re-prefills, pre-draft/hedge outcomes, and
    relaxed (lossy) requests, rounds and tokens apart."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        # Registered in this order, which is the order a scrape lists them in.
        self._register_speculation()
        self._register_requests()
        self._register_latencies()
        self._register_faults()
        self._register_relaxed()
        self.draft_breaker_open = Gauge(
            "specdec_draft_breaker_open",
            "1 while rounds skip the draft (every draft replica's circuit breaker open, or none serving)",
            registry=registry,
        )

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self._registry)

    def _register_speculation(self) -> None:
        """vLLM's spec-decode counters: rounds, draft tokens and where they were accepted."""
        counter = self._counter
        self.num_drafts = counter(
            "specdec_spec_decode_num_drafts", "Speculation rounds that verified at least one draft token"
        )
        self.num_draft_tokens = counter("specdec_spec_decode_num_draft_tokens", "Draft tokens verified")
        self.num_accepted_tokens = counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the round",
            ["position"],
        )
        self.recovered_tokens = counter(
            "specdec_spec_decode_num_recovered_tokens", "Rounds ended by a rejection (one recovered token each)"
        )
        self.bonus_tokens = counter(
            "specdec_spec_decode_num_bonus_tokens",
            "Rounds ending in the target's bonus token (every draft accepted, or K=0)",
        )

    def _register_requests(self) -> None:
        """Requests by finish reason, status and path, their tokens, and what became of the
        pre-drafts and hedges started for them."""
        counter = self._counter
        self.requests = counter(
            "specdec_requests",
            "Finished generations, from gRPC (Generate, GenerateStream) and the HTTP API",
            ["finish_reason", "code"],
        )
        self.http_requests = counter(
            "specdec_http_requests", "HTTP API requests answered, by path and HTTP status", ["path", "status"]
        )
        self.prompt_tokens = counter("specdec_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("specdec_generation_tokens", "Tokens generated by finished requests")
        self.reprefills = counter("specdec_reprefills", "Sessions re-sent in full because a service had lost them")
        self.predrafts = counter("specdec_predrafts", "Pre-drafts started during verifies, by outcome", ["outcome"])
        self.hedges = counter("specdec_hedges", "Hedged branches started during verifies, by outcome", ["outcome"])

    def _register_latencies(self) -> None:
        """Latency histograms, and the requests being generated now."""
        registry = self._registry
        self.time_to_first_token = Histogram(
            "specdec_time_to_first_token_seconds",
            "Time from request to first generated token",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.time_per_output_token = Histogram(
            "specdec_time_per_output_token_seconds",
            "Time per generated token after the first",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )
        self.round_latency = Histogram(
            "specdec_round_latency_seconds",
            "Wall time of one speculation round (draft, verify, decision)",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.requests_in_flight = Gauge("specdec_requests_in_flight", "Requests being generated", registry=registry)

    def _register_faults(self) -> None:
        """What went wrong with the draft and target, and the requests that ran degraded for it."""
        counter = self._counter
        self.fallback_rounds = counter(
            "specdec_fallback_rounds", "Rounds run target-only because the draft failed or was skipped"
        )
        self.draft_failures = counter("specdec_draft_failures", "Draft calls that failed after their retries")
        self.branch_failures = counter(
            "specdec_branch_failures", "Pre-draft, hedge and bonus-guess branches the draft answered with an error"
        )
        self.foreign_tokens = counter(
            "specdec_draft_foreign_tokens",
            "Drafts a draft with its own tokenizer proposed outside the tokens it shares with the target "
            "(a buggy or hostile draft); verified like any draft",
        )
        self.malformed_replies = counter(
            "specdec_malformed_replies",
            "Replies of a draft or target that failed their request: a draft outside the target's vocabulary "
            "or without mass under its own distribution, or a reply of the wrong shape",
        )
        self.degraded_requests = counter(
            "specdec_degraded_requests", "Finished requests with at least one fallback round"
        )

    def _register_relaxed(self) -> None:
        """Relaxed (lossy) requests, rounds and tokens, counted apart from exact ones."""
        counter = self._counter
        self.relaxed_requests = counter(
            "specdec_relaxed_requests", "Finished requests in relaxed acceptance mode (lossy: not the target's output)"
        )
        self.relaxed_rounds = counter(
            "specdec_relaxed_rounds", "Rounds of relaxed requests that verified at least one draft token"
        )
        self.relaxed_accepted_tokens = counter(
            "specdec_relaxed_accepted_tokens",
            "Draft tokens only the relaxed rule accepted (the exact rule rejected them); "
            "they are in specdec_spec_decode_num_accepted_tokens too",
        )

    def watch_pools(self, upstream) -> None:
        """The pools' replicas, read at each scrape (coordinator.upstream.Upstream)."""
        self.draft_breaker_open.set_function(lambda: float(upstream.draft_skipped))
        self._registry.register(PoolCollector((upstream.drafts, upstream.targets)))

    def observe_finished(self, stats: GenerationStats, finish_reason: str) -> None:
        self.requests.labels(finish_reason, "OK").inc()
        self.num_drafts.inc(sum(1 for k in stats.k_per_round if k))
        self.num_draft_tokens.inc(stats.proposed_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(str(position)).inc(accepted)
        self.recovered_tokens.inc(stats.recovered_tokens)
        self.bonus_tokens.inc(stats.bonus_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        self.reprefills.inc(stats.reprefills)
        for outcome, count in (
            ("hit", stats.predraft_hits),
            ("miss", stats.predraft_misses),
            ("cancelled", stats.predraft_cancelled),
        ):
            self.predrafts.labels(outcome).inc(count)
        self.fallback_rounds.inc(stats.fallback_rounds)
        self.draft_failures.inc(stats.draft_failures)
        self.branch_failures.inc(stats.branch_failures)
        self.foreign_tokens.inc(stats.foreign_tokens)
        self.degraded_requests.inc(stats.degraded)
        if stats.acceptance_mode == AcceptanceMode.RELAXED.value:
            self.relaxed_requests.inc()
            self.relaxed_rounds.inc(sum(1 for k in stats.k_per_round if k))
            self.relaxed_accepted_tokens.inc(stats.relaxed_accepted_tokens)
        self.hedges.labels("hit").inc(stats.hedge_hits)
        self.hedges.labels("unused").inc(stats.hedges - stats.hedge_hits)
        self.time_to_first_token.observe(stats.time_to_first_token_ms / 1e3)
        if stats.generated_tokens > 1:
            self.time_per_output_token.observe(
                (stats.total_ms - stats.time_to_first_token_ms) / 1e3 / (stats.generated_tokens - 1)
            )
        for ms in stats.round_ms:
            self.round_latency.observe(ms / 1e3)

    def observe_failed(self, code: str, malformed: bool = False) -> None:
        """A failed request: its status `code`; `malformed` when a node's reply failed it."""
        self.requests.labels("", code).inc()
        self.malformed_replies.inc(malformed)


class PoolCollector:
    """Per-replica gauges and counters, labelled by pool and address; replicas come and go with
    DNS, so they are read from the pools at each scrape rather than kept as labelled children."""

    def __init__(self, pools) -> None:
        self._pools = pools

    def collect(self):
        serving = GaugeMetricFamily(
            "specdec_replica_serving", "1 while a replica takes new sessions", labels=["pool", "address"]
        )
        sessions = GaugeMetricFamily(
            "specdec_replica_sessions", "This coordinator's requests placed on a replica", labels=["pool", "address"]
        )
        refused = GaugeMetricFamily(
            "specdec_replica_refused",
            "1 while a replica serves another model than its pool",
            labels=["pool", "address"],
        )
        moves = CounterMetricFamily(
            "specdec_replica_moves", "Sessions moved off a replica after a failed call", labels=["pool", "address"]
        )
        abandoned = CounterMetricFamily(
            "specdec_replica_abandoned_calls",
            "Calls in flight given up on because their replica stopped answering health probes (then moved)",
            labels=["pool", "address"],
        )
        lookups = CounterMetricFamily("specdec_pool_dns_failures", "Failed DNS lookups of a pool", labels=["pool"])
        waiting = GaugeMetricFamily(
            "specdec_pool_waiting_requests",
            "Requests waiting for room on a replica of the pool (every one full: --max-kv-bytes or --max-sessions)",
            labels=["pool"],
        )
        for pool in self._pools:
            lookups.add_metric([pool.role], pool.resolve_failures)
            waiting.add_metric([pool.role], pool.waiting)
            for replica in list(pool.replicas.values()):
                labels = [pool.role, replica.address]
                serving.add_metric(labels, float(replica.usable))
                sessions.add_metric(labels, replica.sessions)
                refused.add_metric(labels, float(bool(replica.refused)))
                moves.add_metric(labels, replica.moves)
                abandoned.add_metric(labels, replica.abandoned)
        yield from (serving, sessions, refused, moves, abandoned, lookups, waiting)
