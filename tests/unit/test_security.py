"""Security settings: contradictions between flags, files that cannot serve, the token check."""

from __future__ import annotations

import logging

import pytest

from coordinator.config import parse_config as coordinator_config
from draft_service.config import parse_config as draft_config
from specdec.config.services import ClientSecurity, ServerSecurity
from specdec.rpc.security import (
    BearerTokenAuth,
    RefusalLog,
    load_client_security,
    load_server_security,
    read_tokens,
)
from target_service.config import parse_config as target_config

COORDINATOR = ["--draft", "a:1", "--target", "b:2", "--tokenizer", "t"]


def test_security_is_off_by_default_and_set_by_flags_or_environment():
    assert draft_config(["--model", "m"], {}).security == ServerSecurity()
    assert not draft_config(["--model", "m"], {}).trust_remote_code
    env = {
        "SPECDEC_TARGET_MODEL": "m",
        "SPECDEC_TARGET_TLS_CERT": "c.pem",
        "SPECDEC_TARGET_TLS_KEY": "k.pem",
        "SPECDEC_TARGET_TLS_CLIENT_CA": "ca.pem",
        "SPECDEC_TARGET_AUTH_TOKEN_FILE": "tokens",
        "SPECDEC_TARGET_TRUST_REMOTE_CODE": "on",
    }
    config = target_config([], env)
    assert config.security == ServerSecurity("c.pem", "k.pem", "ca.pem", "tokens")
    assert config.trust_remote_code
    config = coordinator_config(
        [
            *COORDINATOR,
            "--upstream-tls-ca",
            "ca.pem",
            "--upstream-tls-cert",
            "c.pem",
            "--upstream-tls-key",
            "k.pem",
            "--upstream-tls-server-name",
            "draft",
            "--upstream-auth-token-file",
            "token",
        ],
        {},
    )
    assert config.upstream == ClientSecurity("ca.pem", "c.pem", "k.pem", "draft", "token")
    assert config.security == ServerSecurity()


def test_an_empty_variable_means_unset():
    """Compose and ConfigMaps often carry a variable with an empty value to switch it off."""
    env = {"SPECDEC_DRAFT_TLS_CERT": "", "SPECDEC_DRAFT_TLS_KEY": "", "SPECDEC_DRAFT_AUTH_TOKEN_FILE": ""}
    assert draft_config(["--model", "m"], env).security == ServerSecurity()


@pytest.mark.parametrize(
    "parse, argv, message",
    [
        (draft_config, ["--model", "m", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (target_config, ["--model", "m", "--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
        (
            draft_config,
            ["--model", "m", "--tls-client-ca", "ca.pem"],
            "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key",
        ),
        (coordinator_config, [*COORDINATOR, "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (
            coordinator_config,
            [*COORDINATOR, "--upstream-tls-cert", "c.pem", "--upstream-tls-ca", "ca.pem"],
            "--upstream-tls-cert and --upstream-tls-key go together",
        ),
        (
            coordinator_config,
            [*COORDINATOR, "--upstream-tls-cert", "c.pem", "--upstream-tls-key", "k.pem"],
            "--upstream-tls-cert needs --upstream-tls-ca",
        ),
        (
            coordinator_config,
            [*COORDINATOR, "--upstream-tls-server-name", "draft"],
            "--upstream-tls-server-name needs --upstream-tls-ca",
        ),
    ],
)
def test_contradicting_flags_are_refused_naming_them(parse, argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv, {})
    assert message in capsys.readouterr().err


def test_files_that_cannot_serve_are_refused_naming_the_flag(tls_files):
    folder = tls_files.folder
    (folder / "garbage").write_text("not a certificate\n")
    (folder / "empty").write_text("\n\n")
    (folder / "spaced").write_text("two words\n")
    cases = [
        (
            ServerSecurity(str(folder / "nope.crt"), tls_files.server_key),
            "--tls-cert " + str(folder / "nope.crt") + ": cannot read it",
        ),
        (
            ServerSecurity(tls_files.server_cert, tls_files.client_key),
            "--tls-key " + tls_files.client_key + " is not the private key of --tls-cert",
        ),
        (
            ServerSecurity(str(folder / "garbage"), tls_files.server_key),
            "are not a PEM certificate chain and its unencrypted private key",
        ),
        (
            ServerSecurity(tls_files.server_cert, tls_files.server_key, str(folder / "garbage")),
            "--tls-client-ca " + str(folder / "garbage") + " holds no PEM CA",
        ),
        (ServerSecurity(auth_token_file=str(folder / "empty")), "holds no token"),
        (ServerSecurity(auth_token_file=str(folder / "spaced")), "token 1 has a space"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError) as refused:
            load_server_security(settings)
        assert message in str(refused.value)
    with pytest.raises(ValueError, match="--upstream-tls-ca .* holds no PEM CA"):
        load_client_security(ClientSecurity(str(folder / "garbage")), "--upstream-")
    with pytest.raises(ValueError, match="--upstream-auth-token-file .*: cannot read it"):
        load_client_security(ClientSecurity(auth_token_file=str(folder / "nope")), "--upstream-")


def test_good_files_load(tls_files):
    credentials, interceptors = load_server_security(
        ServerSecurity(tls_files.server_cert, tls_files.server_key, tls_files.ca, tls_files.tokens)
    )
    assert credentials is not None and len(interceptors) == 1
    assert load_server_security(ServerSecurity()) == (None, [])
    loaded = load_client_security(
        ClientSecurity(tls_files.ca, tls_files.client_cert, tls_files.client_key, "localhost", tls_files.tokens)
    )
    assert loaded.credentials is not None
    assert loaded.options == (("grpc.ssl_target_name_override", "localhost"),)
    assert loaded.metadata == (("authorization", "Bearer first-token-0123456789"),)
    assert read_tokens(tls_files.tokens, "--auth-token-file") == ["first-token-0123456789", "second-token-abcdef"]


def test_token_check():
    auth = BearerTokenAuth(["alpha-token", "beta-token"])
    assert auth.problem("Bearer alpha-token") is None
    assert auth.problem("bearer beta-token") is None, "the scheme is case-insensitive (RFC 6750)"
    assert "missing credentials" in auth.problem(None)
    assert "expected `Bearer <token>`" in auth.problem("alpha-token")
    assert "expected `Bearer <token>`" in auth.problem("Bearer ")
    assert "invalid bearer token" in auth.problem("Bearer alpha-toke")
    assert "invalid bearer token" in auth.problem("Bearer alpha-token-and-more")


def test_a_refused_calls_path_cannot_forge_a_log_line(caplog):
    """An HTTP path is the caller's, percent-decoded: a %0A in it once started a line of the
    caller's making (a timestamp, a level, a message) in the coordinator's log."""
    forged = "HTTP GET /v1/models\n2026-01-01 00:00:00,000 INFO coordinator: admin token rotated OK"
    with caplog.at_level(logging.INFO, logger="specdec.rpc.security"):
        RefusalLog().refused(forged, "missing credentials")
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and "\\n2026" in record.getMessage()
