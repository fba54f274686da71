"""Stubs for the draft and target services, with per-call deadlines and status translation.

Errors from the model services become domain errors here, so the pipeline reasons about
"session lost" or "node unavailable" and never about gRPC codes.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServiceRefused,
    SessionNotFound,
    SpecDecError,
    Unavailable,
)
from specdec.rpc import keepalive, telemetry
from specdec.rpc.security import ChannelSecurity, aio_channel
from specdec.rpc.serving import GRPC_MAX_MESSAGE_BYTES, message_size_options
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")
# gRPC's default reconnect backoff grows to 120 s, so a service that restarts after a long
# outage would stay unused for minutes; retry the connection at least every 2 s instead.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


async def retry_unavailable(
    call: Callable[[], Awaitable[T]],
    give_up: Callable[[int], bool],
    backoff_s: float,
    on_failure: Callable[[], bool] | None = None,
) -> T:
    """Awaits `call()`, again after backoff_s · 2^(n−1) seconds (at most 1 s; a random half
    to all of it, so coordinators that lost a target together do not retry it in step) each
    time it raises Unavailable, until `give_up(attempts so far)`; a missed deadline is never
    retried.
    `on_failure()` runs after each failure that is retried, and after the first whatever
    `give_up` says; True: the next try goes elsewhere (another replica), at once. So a window
    of 0 still fails over once, and replicas that keep failing are not moved between past the
    window. A plain loop: it runs on every round, where a retry library's per-call set-up cost
    a tenth of the coordinator's own time per round."""
    attempts = 0
    while True:
        attempts += 1
        try:
            return await call()
        except Unavailable as exc:
            if isinstance(exc, DeadlineExceeded):
                raise
            last = give_up(attempts)
            if on_failure is not None and (attempts == 1 or not last) and on_failure():
                continue
            if last:
                raise
        await asyncio.sleep(min(backoff_s * 2 ** (attempts - 1), 1.0) * (0.5 + 0.5 * random.random()))


class CallRejected(SpecDecError):
    """A service answered INVALID_ARGUMENT to a call the coordinator built: a protocol bug, or a
    service restarted with other capabilities than the coordinator read at start-up. INTERNAL
    to a public client (never the client's fault); a draft's is a fallback round instead."""


# EndSession's deadline. Nothing waits on it but the session's place on the replica, and a
# service whose event loop stalls a few seconds (a loaded host) answers a burst of them late:
# each one given up on holds its session, and one of its --max-sessions, until its TTL.
END_SESSION_TIMEOUT_S = 15.0
UNENDED_KEPT = 4096  # EndSessions kept to send again once a replica answers (ServiceClient.end_unended)


class ServiceClient:
    """One channel to a model service; the subclass's `role` ("draft"/"target") names it in
    errors and its `stub_class` is the service's generated stub."""

    role: str
    stub_class: Any
    _stream_pools: tuple[CallStreams, ...] = ()  # the hot-path method's pooled streams

    def __init__(
        self,
        address: str,
        timeout_s: float,
        security: ChannelSecurity | None = None,
        channel=None,
    ):
        """`channel`: an already open channel to use instead (a specdec.rpc.local.LocalChannel)."""
        self.address = address
        self.timeout_s = timeout_s
        self._unended: dict[str, common_pb2.EndSessionRequest] = {}  # `end_unended`, oldest first
        self.channel = channel or aio_channel(
            address,
            # No limit of the coordinator's own: each service's (serving.model_message_bytes,
            # from its model's shape) bounds what it accepts and sends.
            [*message_size_options(GRPC_MAX_MESSAGE_BYTES), *RECONNECT_OPTIONS, *keepalive.options()],
            security,
            telemetry.client_interceptors(),
        )
        self._stub = self.stub_class(self.channel)

    async def close(self) -> None:
        for pool in self._stream_pools:
            pool.discard()
        await self.channel.close()

    def abandon_calls(self, why: str) -> int:
        """CallStreams.abandon for every pooled method: the number of calls given up on."""
        return sum(pool.abandon(why) for pool in self._stream_pools)

    def calls_due(self, sent_by: float) -> float | None:
        """The latest deadline (event-loop time) of the pooled calls in flight that were sent
        by `sent_by` (event-loop time); None for none."""
        dues = (pool.due(sent_by) for pool in self._stream_pools)
        return max((due for due in dues if due is not None), default=None)

    async def call(self, method: Callable[..., Awaitable[T]], request, timeout_s: float | None = None) -> T:
        try:
            return await method(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self.translate(exc) from exc

    def translate(self, exc: grpc.aio.AioRpcError) -> SpecDecError:
        return self.translate_status(exc.code(), exc.details() or "")

    def translate_status(self, code: grpc.StatusCode, details: str) -> SpecDecError:
        where = f"{self.role} service at {self.address}"
        if code == grpc.StatusCode.NOT_FOUND:
            return SessionNotFound(f"{where}: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded(f"{where} did not answer within its deadline: {details}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return Unavailable(f"{where} is unavailable ({code.name}): {details}")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return ServiceRefused(
                f"{where} refused the coordinator ({code.name}): {details}; its --auth-token-file must hold the token "
                f"in the coordinator's --upstream-auth-token-file"
            )
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(f"{where} is out of capacity: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            # The coordinator validated the request, so this is a protocol bug, not the client's fault.
            return CallRejected(f"{where} rejected an internal call: {details}")
        return SpecDecError(f"{where} failed ({code.name}): {details}")

    async def info(self, timeout_s: float | None = None) -> common_pb2.ModelInfo:
        return await self.call(self._stub.Info, common_pb2.InfoRequest(), timeout_s)

    async def end_session(
        self, session_id: str, discard: bool = False, epoch: int = 0, committed: int | None = None
    ) -> None:
        """Best effort: a session that cannot be ended expires by TTL on the service, holding
        one of its --max-sessions till then. `discard`: its sequence is no request's output;
        `epoch`: the newest call number sent for it; `committed`: the leading tokens of it that
        are the request's output (EndSessionRequest)."""
        request = common_pb2.EndSessionRequest(
            session_id=session_id, discard=discard, epoch=epoch, committed_tokens=committed
        )
        try:
            await self.call(self._stub.EndSession, request, END_SESSION_TIMEOUT_S)
        except SpecDecError as exc:
            again = isinstance(exc, (Unavailable, DeadlineExceeded))  # not answering: sent again once it does
            if again:
                self._unended[session_id] = request
                while len(self._unended) > UNENDED_KEPT:
                    del self._unended[next(iter(self._unended))]
            logger.warning(
                "could not end %s session %s (%sit expires once idle past the service's session TTL): %s",
                *(self.role, session_id, "sent again once the service answers; else " if again else "", exc),
            )

    @property
    def unended(self) -> int:
        """Sessions whose EndSession found the service not answering, not ended since."""
        return len(self._unended)

    async def end_unended(self) -> None:
        """Sends those again once the service answers (coordinator.pools), until one finds it
        silent again: a replica frozen for a while held their KV and places, counted as other
        coordinators' load, until its session TTL ran out after it resumed."""
        for session_id, request in list(self._unended.items()):
            if self._unended.get(session_id) is not request:
                continue  # placed there again meanwhile (`forget_unended`)
            try:
                await self.call(self._stub.EndSession, request, END_SESSION_TIMEOUT_S)
            except (Unavailable, DeadlineExceeded):
                return
            except SpecDecError:
                pass  # ended another way (a restart, the TTL): nothing left to end
            if self._unended.get(session_id) is request:
                del self._unended[session_id]

    def forget_unended(self, session_id: str) -> None:
        """A session placed on this service again: its earlier end must not end it now."""
        self._unended.pop(session_id, None)

    async def serving(self, timeout_s: float = 1.0) -> bool | None:
        """The standard health check: is the service up and SERVING (a draining one, after
        SIGTERM, answers NOT_SERVING)? None: no answer within `timeout_s` (a frozen process, a
        machine or network gone without closing the connection); False also where it refuses
        or is gone."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return None if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_info(self, total_timeout_s: float) -> common_pb2.ModelInfo:
        """Info, retried until the service answers or `total_timeout_s` passes (start-up)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_timeout_s
        while True:
            try:
                return await self.info(timeout_s=max(0.1, min(5.0, deadline - loop.time())))
            except Unavailable:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.5)


class CallStreams:
    """One method's calls sent as messages on long-lived bidirectional streams, each stream
    carrying one call at a time and going back to a pool when its reply is read.

    Why: on loopback a unary call costs about twice a message on an open stream, and more
    after the service has been idle (a round's draft call waits through the verify and the
    other way round); the round makes one call to each service. A call that fails on the
    service comes back as a reply with its status code, so the stream stays usable; a call the
    caller gives up on (cancelled, past its deadline) cancels its stream, which cancels the work
    on the service as cancelling a unary call does. A stream that breaks (the service went away)
    discards the whole pool: the next call opens a fresh stream, so a retry after UNAVAILABLE
    never lands on another dead one. `reply_field` names the reply's payload field."""

    MAX_IDLE = 64  # more concurrent generations than this open streams of their own

    def __init__(self, client: ServiceClient, open_stream: Callable[[], Any], reply_field: str) -> None:
        self._client = client
        self._open = open_stream
        self._field = reply_field
        self._idle: list[Any] = []
        self._busy: dict[Any, tuple[float, float]] = {}  # streams carrying a call now: (sent, deadline), loop time
        self._abandoned: dict[Any, str] = {}  # busy streams given up on (`abandon`), and why

    async def call(self, request, span_name: str, timeout_s: float):
        stream = None
        due = asyncio.get_running_loop().time() + timeout_s
        try:
            span = telemetry.client_span(span_name, request.trace_context) if telemetry.tracing_on() else nullcontext()
            async with asyncio.timeout(timeout_s):
                with span as current:
                    stream = await self._send(request, due)
                    reply = await stream.read()
                    if current is not None and reply is not grpc.aio.EOF:  # its status, as a unary call's
                        telemetry.record_status(current, reply.error_code, reply.error_message)
        except TimeoutError:
            if stream is not None:
                stream.cancel()
            raise DeadlineExceeded(
                f"{self._client.role} service at {self._client.address} did not answer within {timeout_s} s"
            ) from None
        except grpc.aio.AioRpcError as exc:
            if stream is not None:
                stream.cancel()
            self.discard()
            raise self._client.translate(exc) from exc
        except BaseException:
            if stream is not None:
                stream.cancel()  # the caller gave up: the service stops the call's work
                self._raise_if_abandoned(stream)  # or `abandon` did: the service stopped answering
            raise
        finally:
            if stream is not None:
                self._busy.pop(stream, None)
                self._abandoned.pop(stream, None)
        assert stream is not None
        if reply is grpc.aio.EOF:  # the service ended the stream (shutting down)
            self.discard()
            code = await stream.code()
            if code == grpc.StatusCode.OK:
                code = grpc.StatusCode.UNAVAILABLE
            raise self._client.translate_status(code, await stream.details() or "the service closed the stream")
        if len(self._idle) < self.MAX_IDLE:
            self._idle.append(stream)
        else:
            stream.cancel()
        if reply.error_code:
            raise self._client.translate_status(STATUS_BY_VALUE[reply.error_code], reply.error_message)
        return getattr(reply, self._field)

    async def _send(self, request, due: float):
        """Writes the call on an idle stream, or a new one. A pooled stream that broke while
        idle (the service restarted) fails at the write, before the call reached anyone: the
        pool is emptied and the call goes out on a fresh stream."""
        while self._idle:
            stream = self._idle.pop()
            if stream.done():
                continue
            try:
                await self._write(stream, request, due)
                return stream
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                self.discard()
        stream = self._open()
        await self._write(stream, request, due)
        return stream

    async def _write(self, stream, request, due: float) -> None:
        """Writes the call on `stream`, busy until `due` at the latest; a write that fails (or
        that `abandon` gave up on, which a peer that stopped reading can leave waiting) cancels
        the stream."""
        self._busy[stream] = (asyncio.get_running_loop().time(), due)
        try:
            await stream.write(request)
        except BaseException:
            self._busy.pop(stream, None)
            stream.cancel()
            self._raise_if_abandoned(stream)
            raise

    def _raise_if_abandoned(self, stream) -> None:
        """Unavailable where `abandon` cancelled this stream and the caller is not cancelled itself."""
        why = self._abandoned.pop(stream, None)
        task = asyncio.current_task()
        if why is not None and task is not None and not task.cancelling():
            raise Unavailable(f"{self._client.role} service at {self._client.address} {why}") from None

    def due(self, sent_by: float) -> float | None:
        """The latest deadline of the calls in flight sent by `sent_by` (event-loop time); None for none."""
        return max((due for sent, due in self._busy.values() if sent <= sent_by), default=None)

    def discard(self) -> None:
        """Cancels every idle stream (the service went away, or the client closes)."""
        for stream in self._idle:
            stream.cancel()
        self._idle.clear()

    def abandon(self, why: str) -> int:
        """Gives up on every call in flight, which raises Unavailable ("<role> service at
        <address> <why>") to its caller: the service stopped answering without closing the
        connection (a frozen process, a dead machine, a dropped network), which no reply or
        error would ever end before the call's deadline. Returns how many calls there were."""
        busy = list(self._busy)
        for stream in busy:
            self._abandoned[stream] = why
            stream.cancel()
        self.discard()
        return len(busy)


STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class DraftClient(ServiceClient):
    role = "draft"
    stub_class = draft_pb2_grpc.DraftStub

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._proposals = CallStreams(self, lambda: self._stub.ProposeStream(), "proposal")
        self._branches = CallStreams(self, lambda: self._stub.ProposeBranchesStream(), "response")
        self._stream_pools = (self._proposals, self._branches)

    async def propose(self, request: draft_pb2.ProposeRequest, allowance_s: float = 0.0) -> draft_pb2.ProposeResponse:
        """A round's draft call, as a message on a pooled ProposeStream, within --draft-timeout
        and `allowance_s` more (its prefill's: coordinator.upstream.prefill_allowance_s)."""
        return await self._proposals.call(request, "/specdec.v1.Draft/Propose", self.timeout_s + allowance_s)

    async def propose_branches(self, request: draft_pb2.ProposeBranchesRequest) -> draft_pb2.ProposeBranchesResponse:
        """A verify's branches, as a message on a pooled ProposeBranchesStream."""
        return await self._branches.call(request, "/specdec.v1.Draft/ProposeBranches", self.timeout_s)


class TargetClient(ServiceClient):
    role = "target"
    stub_class = target_pb2_grpc.TargetStub

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._verifies = CallStreams(self, lambda: self._stub.VerifyStream(), "response")
        self._stream_pools = (self._verifies,)

    async def verify(self, request: target_pb2.VerifyRequest, allowance_s: float = 0.0) -> target_pb2.VerifyResponse:
        """A round's verify, as a message on a pooled VerifyStream, within --target-timeout and
        `allowance_s` more (its prefill's: coordinator.upstream.prefill_allowance_s)."""
        return await self._verifies.call(request, "/specdec.v1.Target/Verify", self.timeout_s + allowance_s)


def shared_share(bridge: common_pb2.VocabBridgeInfo) -> float:
    """The share of the target tokenizer's tokens a draft of another family shares with it."""
    return bridge.shared_tokens / max(1, bridge.target_vocab_tokens)


def check_pair(
    draft: common_pb2.ModelInfo,
    target: common_pb2.ModelInfo,
    tokenizer_fingerprint: str,
    draft_address: str,
    target_address: str,
    min_vocab_overlap: float = 0.0,
) -> None:
    """Refuses a pair that would not speak the same token ids, or whose draft, drafting for
    another tokenizer (ModelInfo.vocab_bridge), shares less than `min_vocab_overlap` of it."""
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise InvalidArgument(
            f"draft and target tokenizers differ: draft {draft.model_id!r} at {draft_address} has tokenizer "
            f"{draft.tokenizer_fingerprint[:16]}, target {target.model_id!r} at {target_address} has "
            f"{target.tokenizer_fingerprint[:16]}; start the draft with --target-tokenizer set to the target's "
            "model folder to draft within the tokens both share"
        )
    if draft.HasField("vocab_bridge"):
        bridge = draft.vocab_bridge
        share = shared_share(bridge)
        if share < min_vocab_overlap:
            raise InvalidArgument(
                f"draft {bridge.draft_model_id!r} at {draft_address} shares {bridge.shared_tokens} tokens with "
                f"target {target.model_id!r}'s tokenizer, {share:.1%} of its {bridge.target_vocab_tokens}; "
                f"the coordinator asks for at least {min_vocab_overlap:.1%} (a pair this far apart drafts little)"
            )
    made_for = draft.feature_target_fingerprint
    if made_for and made_for != target.weights_fingerprint:
        raise InvalidArgument(
            f"draft {draft.model_id!r} at {draft_address} is a head made for the target whose weights fingerprint is "
            f"{made_for[:16]}; target {target.model_id!r} at {target_address} serves {target.weights_fingerprint[:16]} "
            "(other weights, dtype or quantisation): its features would not be the ones the head learned"
        )
    trained_on = draft.feature_target_checkpoint
    if trained_on and target.checkpoint_fingerprint and trained_on != target.checkpoint_fingerprint:
        raise InvalidArgument(
            f"draft {draft.model_id!r} at {draft_address} is a head that reads the features of checkpoint "
            f"{trained_on[:16]} (trained on, or its --model folder's); target {target.model_id!r} at {target_address} "
            f"serves {target.checkpoint_fingerprint[:16]}: start the draft with --model set to the target's folder"
        )
    if tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise InvalidArgument(
            f"the coordinator's --tokenizer (fingerprint {tokenizer_fingerprint[:16]}) differs from target "
            f"{target.model_id!r} at {target_address} ({target.tokenizer_fingerprint[:16]})"
        )
