"""TLS, mutual TLS and bearer tokens for the three services and their clients: the flags, reading
the files (a missing or bad file is a start-up error naming its flag), the server-side token check
and client channels.

Files are read once at start-up; rotating a certificate or a token means restarting the process.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import ssl
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from specdec.config.services import ClientSecurity, ServerSecurity

logger = logging.getLogger(__name__)

# Probes and grpcurl must work without a token: health says nothing but SERVING, reflection
# only describes the public protos.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


# --- reading the files ---------------------------------------------------------------------


def read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None


def check_certificate_and_key(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    """Refuses what TLS would only refuse at the first handshake: not PEM, or a key that is not
    the certificate's."""
    read_file(cert, cert_flag)
    read_file(key, key_flag)
    try:
        # An empty password: an encrypted key (which gRPC cannot use) fails here instead of prompting.
        ssl.create_default_context().load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"{key_flag} {key} is not the private key of {cert_flag} {cert}") from None
        raise ValueError(
            f"{cert_flag} {cert} and {key_flag} {key} are not a PEM certificate chain and its unencrypted private key "
            f"({exc.reason or exc})"
        ) from None


def check_ca(path: str, flag: str) -> None:
    read_file(path, flag)
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:
        raise ValueError(f"{flag} {path} holds no PEM CA certificate ({exc.reason or exc})") from None


def read_tokens(path: str, flag: str) -> list[str]:
    """Non-empty lines, stripped; a token must be printable ASCII without spaces (it travels in
    gRPC metadata)."""
    tokens = [line.strip() for line in read_file(path, flag).decode("utf-8", "replace").splitlines() if line.strip()]
    if not tokens:
        raise ValueError(f"{flag} {path} holds no token (one per line)")
    for number, token in enumerate(tokens, 1):
        if not all(33 <= ord(char) < 127 for char in token):
            raise ValueError(
                f"{flag} {path}: token {number} has a space or a non-ASCII character; use printable ASCII (e.g. hex)"
            )
    return tokens


def load_server_security(
    settings: ServerSecurity,
) -> tuple[grpc.ServerCredentials | None, list[grpc.aio.ServerInterceptor]]:
    """Server credentials (None = plaintext) and interceptors (the token check) for
    `specdec.rpc.serving.start_server`. Raises ValueError naming the flag of a bad file."""
    credentials = None
    if settings.tls_cert:
        cert_flag, key_flag, ca_flag = "--tls-cert", "--tls-key", "--tls-client-ca"
        if not settings.tls_key:
            raise ValueError(f"{cert_flag} needs {key_flag}")
        check_certificate_and_key(settings.tls_cert, settings.tls_key, cert_flag, key_flag)
        client_ca = None
        if settings.tls_client_ca:
            check_ca(settings.tls_client_ca, ca_flag)
            client_ca = read_file(settings.tls_client_ca, ca_flag)
        credentials = grpc.ssl_server_credentials(
            [(read_file(settings.tls_key, key_flag), read_file(settings.tls_cert, cert_flag))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if settings.auth_token_file:
        interceptors.append(BearerTokenAuth(read_tokens(settings.auth_token_file, "--auth-token-file")))
        if credentials is None:
            logger.warning("bearer tokens are checked but TLS is off: tokens cross the network in plaintext")
    return credentials, interceptors


# --- the server-side token check -------------------------------------------------------------


class RefusalLog:
    """Logs refused calls at a bounded rate: the first at once, then at most one line per
    `interval_s` counting the calls refused since (a flood of bad tokens writes a line every
    few seconds, not one per call)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self._interval_s = interval_s
        self._unlogged = 0
        self._logged_at = float("-inf")

    def refused(self, what: str, problem: str) -> None:
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < self._interval_s:
            return
        logger.info(
            "refused %d call%s for their credentials in the last %.0f s; the latest: %r: %s",  # %r: no forged lines
            self._unlogged,
            "" if self._unlogged == 1 else "s",
            min(now - self._logged_at, self._interval_s),
            what,
            problem,
        )
        self._unlogged, self._logged_at = 0, now


def bearer_token(authorization: str | bytes | None) -> str:
    """The token of `authorization: Bearer <token>` metadata or header; "" if there is none."""
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class BearerTokenAuth(grpc.aio.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` metadata for one of `tokens`
    (UNAUTHENTICATED), except the health and reflection services. A refused call is answered
    from its metadata alone: its message is never read or decoded."""

    def __init__(self, tokens: Iterable[str], open_services: Sequence[str] = OPEN_SERVICES) -> None:
        self._tokens = [token.encode() for token in tokens]
        self._longest = max(len(token) for token in self._tokens)
        self._open_services = tuple(open_services)
        self.log = RefusalLog()

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        if handler_call_details.method.startswith(self._open_services):
            return await continuation(handler_call_details)
        problem = self.problem(dict(handler_call_details.invocation_metadata or ()).get("authorization"))
        if problem is None:
            return await continuation(handler_call_details)
        self.log.refused(handler_call_details.method, problem)
        return _refusal(problem)

    def problem(self, authorization: str | bytes | None) -> str | None:
        """Why the call is refused, in words; None if its token is accepted."""
        if authorization is None:
            return "missing credentials: this server requires `authorization: Bearer <token>` metadata"
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "malformed `authorization` metadata: expected `Bearer <token>`"
        given = token.strip().encode("utf-8", "replace")
        if len(given) > self._longest:
            return "invalid bearer token: it is longer than any of this server's --auth-token-file tokens"
        # Compare with every token, so the time taken says nothing about which one was close.
        if not any([hmac.compare_digest(given, accepted) for accepted in self._tokens]):
            return "invalid bearer token: it is not one of this server's --auth-token-file tokens"
        return None


def _refusal(problem: str) -> grpc.RpcMethodHandler:
    """A handler that aborts with UNAUTHENTICATED without reading the request. It takes the
    request as a stream whatever the method's shape (on the wire every call is one), so gRPC
    hands it over before the message arrives and it is never read, decoded or kept: a refused
    40 MB call costs what a refused empty one does. It answers with no message, which a unary
    caller accepts with the status as well as a streaming one."""

    async def refuse(request_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    return grpc.stream_unary_rpc_method_handler(refuse)


# --- clients -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelSecurity:
    """`ClientSecurity` with its files read: what opening a channel needs."""

    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    options: tuple[tuple[str, str], ...] = ()
    token: str | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def for_name(self, name: str) -> ChannelSecurity:
        """For a replica found by DNS (reached at its IP address): TLS checks the certificate
        for the name that was resolved, unless a server name was set."""
        if self.credentials is None or any(key == "grpc.ssl_target_name_override" for key, _ in self.options):
            return self
        return dataclasses.replace(self, options=(*self.options, ("grpc.ssl_target_name_override", name)))


def load_client_security(settings: ClientSecurity, flag_prefix: str = "--") -> ChannelSecurity:
    """Reads the files of `settings`; raises ValueError naming the flag of a bad one."""
    ca_flag, cert_flag, key_flag = (f"{flag_prefix}tls-{name}" for name in ("ca", "cert", "key"))
    credentials = None
    options: tuple[tuple[str, str], ...] = ()
    if settings.tls_ca:
        check_ca(settings.tls_ca, ca_flag)
        client_key = client_cert = None
        if settings.tls_cert:
            if not settings.tls_key:
                raise ValueError(f"{cert_flag} needs {key_flag}")
            check_certificate_and_key(settings.tls_cert, settings.tls_key, cert_flag, key_flag)
            client_key, client_cert = read_file(settings.tls_key, key_flag), read_file(settings.tls_cert, cert_flag)
        credentials = grpc.ssl_channel_credentials(read_file(settings.tls_ca, ca_flag), client_key, client_cert)
        if settings.tls_server_name:
            options = (("grpc.ssl_target_name_override", settings.tls_server_name),)
    token = None
    if settings.auth_token_file:
        token = read_tokens(settings.auth_token_file, f"{flag_prefix}auth-token-file")[0]
        if credentials is None:
            logger.warning("sending a bearer token without TLS: it crosses the network in plaintext")
    return ChannelSecurity(credentials, options, token)


class _AddMetadata:
    """Adds fixed metadata (the bearer token) to every call on a channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    async def _add(self, continuation, details: grpc.aio.ClientCallDetails, request):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return await continuation(details._replace(metadata=metadata), request)


# grpc.aio files an interceptor under its first matching kind only: one class per kind.
class _AddMetadataUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AddMetadata._add


class _AddMetadataStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AddMetadata._add


class _AddMetadataBidi(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AddMetadata._add  # the coordinator's call streams


def aio_channel(
    address: str,
    options: Sequence[tuple[str, Any]],
    security: ChannelSecurity | None = None,
    interceptors: Sequence[Any] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel with TLS and the bearer token of `security` (plaintext without);
    `interceptors` (tracing) run before the token is added."""
    security = security or ChannelSecurity()
    options = [*options, *security.options]
    token = (
        [kind(security.metadata) for kind in (_AddMetadataUnary, _AddMetadataStream, _AddMetadataBidi)]
        if security.token
        else []
    )
    chain = [*interceptors, *token] or None
    if security.credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=chain)
    return grpc.aio.secure_channel(address, security.credentials, options=options, interceptors=chain)


def channel(address: str, options: Sequence[tuple[str, Any]], security: ChannelSecurity | None = None) -> grpc.Channel:
    """The blocking counterpart of `aio_channel`; the token goes on each call (`security.metadata`)."""
    security = security or ChannelSecurity()
    options = [*options, *security.options]
    if security.credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, security.credentials, options=options)
