"""Coordinator configuration: flags over SPECDEC_COORDINATOR_* environment variables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specdec.config.services import (
    ClientSecurity,
    ServerSecurity,
    host_setting,
    log_level_setting,
    metrics_port_setting,
    port_setting,
    shutdown_grace_setting,
)
from specdec.config.settings import fixed, group, number, parse_settings, setting
from specdec.engine.rows import MAX_ROWS
from specdec.rpc import wire
from specdec.rpc.dns import parse_pool
from specdec.sampling.relaxed import (
    DEFAULT_DELTA,
    DEFAULT_TOP_N,
    AcceptanceMode,
)

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9151
MAX_HEDGES = 24  # each position of K <= 8 with 3 recovered tokens
MAX_BONUS_GUESSES = wire.MAX_RUNNER_UPS + 1  # the argmax and each runner-up (ProposeRequest.guess_rank)
# Hedges, the pre-draft and its forks for other bonus guesses fit in one ProposeBranches call.
assert MAX_HEDGES + MAX_BONUS_GUESSES <= wire.MAX_BRANCHES
MAX_TARGET_ONLY_STEPS = wire.MAX_STEP_SEEDS + 1  # one Verify call's steps: its own and its step_seeds
CHOOSER_MAX_K = 8  # the largest K the K chooser picks (CoordinatorConfig.chooser_max_k)
FALLBACK_K = 4  # K for a request that leaves it unset where the chooser has no measured costs


def parse_auto_count(text: str) -> int | None:
    """--num-speculative-tokens, --hedges, --bonus-guesses: "auto" (None: chosen per request,
    by the K chooser or coordinator.overlap) or a count."""
    if text == "auto":
        return None
    if not text.strip().lstrip("-").isdigit():
        raise ValueError(f"{text!r} is neither auto nor a whole number")
    return int(text)


def parse_auto_switch(text: str) -> bool | None:
    """--pipeline: "auto" (None: chosen per request, coordinator.overlap), "on" or "off"."""
    if text == "auto":
        return None
    if text not in ("on", "off"):
        raise ValueError(f"{text!r}: choose from auto, on, off")
    return text == "on"


@dataclass(frozen=True)
class CoordinatorConfig:
    draft_address: str = setting(
        "",
        "--draft",
        "the draft pool: HOST:PORT, several (comma-separated, or the flag repeated), or dns:///NAME:PORT "
        "(every address record, re-read each --pool-refresh; dns://SERVER/NAME:PORT asks that DNS server; "
        "dns:///_SERVICE._PROTO.NAME reads SRV records)",
        required=True,
        repeated=True,
        more="See [Replica pools](operations.md#replica-pools).",
    )
    target_address: str = setting(
        "",
        "--target",
        "the target pool, spelled as --draft's; a session stays on the replica it was placed on",
        required=True,
        repeated=True,
    )
    tokenizer: str = setting(
        "",
        "--tokenizer",
        "tokenizer folder or id (the pair's), for text in and out; checked against the target's fingerprint",
        required=True,
    )
    host: str = host_setting()
    port: int = port_setting(DEFAULT_PORT)
    default_num_speculative_tokens: int | None = setting(
        None,
        "--num-speculative-tokens",
        "K per round for requests that leave it unset: auto (the K chooser picks it each round, K = 0 "
        f"included, from the services' calibrated pass costs and the request's acceptance; K = {FALLBACK_K} "
        "where the services measured no costs) or a fixed K for every such request",
        parse=parse_auto_count,
        shown="auto",
        more="See [The K chooser](design.md#the-k-chooser).",
    )
    max_new_tokens_limit: int = setting(
        2048, "--max-new-tokens-limit", "largest max_new_tokens a request may ask for", parse=number(int, 1)
    )
    draft_timeout_s: float = setting(
        30.0,
        "--draft-timeout",
        "deadline of one draft call, seconds; a call also gets the draft's calibrated one-token step for each "
        "token it sends, so a long prompt's prefill is not taken for a hang",
        parse=number(float, 0.001),
    )
    target_timeout_s: float = setting(
        60.0,
        "--target-timeout",
        "deadline of one target call, seconds; a call also gets the target's calibrated one-token pass for each "
        "token it sends, so a long prompt's prefill is not taken for a hang",
        parse=number(float, 0.001),
    )
    connect_timeout_s: float = setting(
        120.0,
        "--connect-timeout",
        "seconds a service that does not answer is waited for, as long as one takes to start: at start-up, for "
        "draft and target to answer Info; mid-request, for a target call failing UNAVAILABLE (a restarting "
        "target), never past the client's deadline",
        parse=number(float, 0),
    )
    log_level: str = log_level_setting()
    pipeline: bool | None = setting(
        None,
        "--pipeline",
        "on: the draft pre-drafts the next round while the target verifies; auto: where the cost "
        "model says it pays, per request (never where draft and target share a host's cores)",
        parse=parse_auto_switch,
        shown="auto",
        more="See [Pipelining](design.md#pipelining).",
    )
    tree_chooser: bool = setting(
        False,
        "--tree-chooser",
        "on: the K chooser also weighs token trees (w, 1, …, 1) with w in 2..3 against chains, from "
        "the calibrated pass costs and the request's acceptance of first and runner-up candidates, "
        "and uses a tree where it pays; needs both services to serve trees; sequential rounds only "
        "(ignored with --pipeline or --hedges)",
    )
    hedges: int | None = setting(
        None,
        "--hedges",
        "pre-draft this many likely rejection outcomes (a draft rejected and the token recovered in its "
        "place: the draft's likeliest other tokens, up to 4 per position) on forks of the draft session "
        f"during each verify (0 = off; at most {MAX_HEDGES}; auto: chosen with the pipelining)",
        parse=parse_auto_count,
        shown="auto",
    )
    bonus_guesses: int | None = setting(
        None,
        "--bonus-guesses",
        "with --pipeline: pre-draft for this many guesses of a fully accepted round's bonus token "
        "during each verify, the draft's likeliest tokens after the round's last draft, each past the "
        "first on a fork of the draft session, stepped in the same passes; the round after keeps the "
        f"branch whose guess was right (1 = the argmax alone; at most {MAX_BONUS_GUESSES}; auto: chosen "
        "with the pipelining)",
        parse=parse_auto_count,
        shown="auto",
        more="See [Hedges](design.md#hedges).",
    )
    target_only_steps: int = fixed(
        4,
        "a request with K = 0 samples up to this many tokens per Verify call (more where the target's pass "
        "is short: coordinator.rounds.steps_per_call), each with its own seed, so a seed gives the same output "
        "whatever this is; fewer calls cost less, and the tokens stream in groups this long (at most "
        f"{MAX_TARGET_ONLY_STEPS}). Fixed: it changes only how a K = 0 request's tokens are grouped on the "
        "stream and how many calls they take, never the output",
    )
    metrics_port: int = metrics_port_setting(DEFAULT_METRICS_PORT)
    http_port: int = setting(
        -1,
        "--http-port",
        "serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) on this port of "
        "--host, with the same TLS and tokens as gRPC (-1 = off, 0 picks a free one; 8000 is the usual choice)",
        parse=number(int, -1, 65535),
        more="See [The OpenAI-compatible HTTP API](api.md#the-openai-compatible-http-api).",
    )
    served_model_name: str = setting(
        "",
        "--served-model-name",
        "the model name the HTTP API reports and accepts in `model` (empty = the target's model folder's name)",
    )
    pool_refresh_s: float = setting(
        2.0,
        "--pool-refresh",
        "seconds between refreshes of both pools: DNS names resolved again, and every replica asked its "
        "health and Info (a replica joins, leaves, or closes its breaker at a refresh)",
        parse=number(float, 0.01),
    )
    queue_timeout_s: float = setting(
        120.0,
        "--queue-timeout",
        "seconds a request waits for room on a target replica (every one full: its --max-kv-bytes or "
        "--max-sessions) before RESOURCE_EXHAUSTED, never past the client's deadline",
        parse=number(float, 0),
    )
    shutdown_grace_s: float = shutdown_grace_setting()
    trust_remote_code: bool = setting(
        False, "--trust-remote-code", "on: run Python code that comes with the tokenizer (only for ones you trust)"
    )
    security: ServerSecurity = group(ServerSecurity())  # the public API: TLS, client certificates, tokens
    # No flags (issue 66: a surface a user can hold): one value for every deployment.
    default_max_new_tokens: int = fixed(
        64,
        "max_new_tokens when a gRPC request leaves it unset, or --max-new-tokens-limit where that is lower (an "
        "HTTP request without max_tokens gets the rest of the context, up to the limit, as vLLM's): the API's "
        "documented default, which a client overrides per request",
    )
    min_vocab_overlap: float = fixed(
        0.1,
        "a draft with its own tokenizer (draft --target-tokenizer) must share at least this share of the "
        "target tokenizer's tokens, or the pair is refused at start-up: a sanity bar, not a tuning knob "
        "(Qwen2.5 and SmolLM2 share 25.8% of Qwen's 151,936)",
    )
    breaker_failures: int = fixed(
        3,
        "consecutive failed draft calls after which rounds skip the draft until a pool refresh finds it "
        "serving; a refresh every --pool-refresh seconds bounds what a wrong guess costs either way",
    )
    chooser_max_k: int = fixed(
        CHOOSER_MAX_K,
        "the largest K the K chooser picks (and the overlap chooser prices), within what both services accept; a "
        "request may fix a larger K, up to the services' --max-speculative-tokens, the one bound on a request's K",
    )
    max_copied_tokens: int = fixed(
        32,
        "most tokens a copy (prompt lookup, suffix drafter) may carry in a round whose K the chooser picks; a "
        "copy runs no draft pass, so it may be longer than K; the services' --max-speculative-tokens caps it too",
    )
    max_waiting_requests: int = fixed(
        1024,
        "requests that may wait for room on a target replica at once; one more gets RESOURCE_EXHAUSTED. A bound "
        "on the coordinator's memory, not a tuning knob: --queue-timeout (and the client's deadline) says how "
        "long a request may wait, 0 refusing at once",
    )
    http_max_body_bytes: int = fixed(
        1 << 20,
        "largest HTTP request body read (larger ones get 413 unread; never more than the largest request the "
        "model can take, which bounds gRPC requests). Parsing JSON holds the interpreter: at worst about 60 ms "
        "a MiB of tiny arrays, a stall of every stream in flight; 1 MiB holds a text prompt of 250k tokens",
    )
    acceptance: str = fixed(
        AcceptanceMode.EXACT.value,
        "acceptance rule for requests that leave acceptance_mode unset: exact. Relaxed acceptance (lossy: the "
        "output is not the target's) is the request's own opt-in (acceptance_mode), labelled in its stats, never "
        "a server-wide default that clients who did not ask for it would get",
    )
    relaxed_top_n: int = fixed(DEFAULT_TOP_N, "a relaxed request's top-N where it leaves relaxed_top_n unset")
    relaxed_delta: float = fixed(DEFAULT_DELTA, "a relaxed request's gap where it leaves relaxed_delta unset")
    upstream: ClientSecurity = group(ClientSecurity(), "upstream-")  # calls to draft and target

    def problem(self) -> str | None:
        """A contradiction between flags, said in words; None if the config is consistent."""
        k = self.default_num_speculative_tokens
        if k is not None and not 0 <= k < MAX_ROWS:
            return f"--num-speculative-tokens must be auto or in [0, {MAX_ROWS - 1}] (the services' bound applies too)"
        if self.hedges is not None and not 0 <= self.hedges <= MAX_HEDGES:
            return f"--hedges must be auto or in [0, {MAX_HEDGES}]"
        if self.bonus_guesses is not None and not 1 <= self.bonus_guesses <= MAX_BONUS_GUESSES:
            return f"--bonus-guesses must be auto or in [1, {MAX_BONUS_GUESSES}]"
        for flag, spec in (("--draft", self.draft_address), ("--target", self.target_address)):
            try:
                parse_pool(spec)
            except ValueError as exc:
                return f"{flag}: {exc}"
        return self.security.problem() or self.upstream.problem("--upstream-")


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> CoordinatorConfig:
    return parse_settings(
        CoordinatorConfig,
        "SPECDEC_COORDINATOR",
        argv,
        env,
        "python -m coordinator",
        "Coordinator: the public Generate API",
    )
