"""A small Python client for the coordinator, and a CLI:

python -m specdec.tools.client --address 127.0.0.1:50051 "def fib(n):" --max-new-tokens 64 --stream
python -m specdec.tools.client --chat --system "You are terse." "Write a palindrome check in Python."
python -m specdec.tools.client --address coordinator:50051 --tls-ca ca.crt --auth-token-file token "def fib(n):"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import grpc
from google.protobuf import json_format

from specdec.config.services import ClientSecurity, client_security
from specdec.rpc.security import channel, load_client_security
from specdec.rpc.serving import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorClient:
    """Blocking client; `grpc.aio` users can use `coordinator_pb2_grpc.CoordinatorStub` on
    `specdec.rpc.security.aio_channel` directly. `security`: TLS files and a token file, when the
    coordinator runs with them."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 600.0,
        security: ClientSecurity | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        loaded = load_client_security(security or ClientSecurity())
        self._channel = channel(address, message_size_options(max_message_bytes), loaded)
        self._metadata = loaded.metadata
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._timeout_s = timeout_s

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | list[int] | list[dict[str, str]], **fields) -> coordinator_pb2.GenerateResponse:
        """Whole completion of raw text, token ids or chat messages ({"role", "content"} dicts).
        `fields` are GenerateRequest fields (max_new_tokens, temperature, ...)."""
        return self._stub.Generate(_request(prompt, fields), timeout=self._timeout_s, metadata=self._metadata)

    def generate_stream(
        self, prompt: str | list[int] | list[dict[str, str]], **fields
    ) -> Iterator[coordinator_pb2.GenerateResponse]:
        """Chunks as rounds complete; the last has finish_reason and stats."""
        yield from self._stub.GenerateStream(_request(prompt, fields), timeout=self._timeout_s, metadata=self._metadata)


def _request(prompt: str | list[int] | list[dict[str, str]], fields: dict) -> coordinator_pb2.GenerateRequest:
    if isinstance(prompt, str):
        return coordinator_pb2.GenerateRequest(prompt=prompt, **fields)
    messages = [m for m in prompt if isinstance(m, dict)]
    if messages:
        chat = [coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        return coordinator_pb2.GenerateRequest(messages=chat, **fields)
    return coordinator_pb2.GenerateRequest(prompt_token_ids=[t for t in prompt if isinstance(t, int)], **fields)


def format_stats(stats: coordinator_pb2.GenerationStats) -> str:
    return (
        f"{stats.generated_tokens} tokens in {stats.total_ms:.0f} ms ({stats.tokens_per_second:.2f} tok/s), "
        f"{stats.rounds} rounds, acceptance {stats.acceptance_rate:.2f}, "
        f"{stats.mean_accepted_length:.2f} tokens/round, TTFT {stats.time_to_first_token_ms:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specdec.tools.client", description="Generate text through the coordinator"
    )
    parser.add_argument(
        "prompt", help="raw prompt text (no chat template is applied), or with --chat the user's message"
    )
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message, through the model's chat template"
    )
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (0 = target only)")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--json", action="store_true", help="print the whole response (ids, text, stats) as JSON, not the text"
    )
    parser.add_argument("--tls-ca", help="PEM CA bundle to verify the coordinator's certificate with (turns TLS on)")
    parser.add_argument(
        "--tls-cert", help="PEM client certificate, for a coordinator that requires one (with --tls-key)"
    )
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name", help="name to check the coordinator's certificate for, instead of the address's host"
    )
    parser.add_argument("--auth-token-file", help="file whose first line is the bearer token to send")
    args = parser.parse_args(argv)
    security, problem = client_security(
        args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name, args.auth_token_file
    )
    if problem:
        parser.error(problem)
    fields = dict(temperature=args.temperature, top_k=args.top_k, stop=args.stop)
    for name, value in (
        ("max_new_tokens", args.max_new_tokens),
        ("top_p", args.top_p),
        ("seed", args.seed),
        ("num_speculative_tokens", args.k),
    ):
        if value is not None:
            fields[name] = value
    if args.json and args.stream:
        parser.error("--json prints one response: leave out --stream")
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    prompt: str | list[dict[str, str]] = args.prompt
    if args.chat:
        prompt = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt.append({"role": "user", "content": args.prompt})
    try:
        with CoordinatorClient(args.address, security=security) as client:
            if args.json:
                final = client.generate(prompt, **fields)
                print(json_format.MessageToJson(final, preserving_proto_field_name=True))
            elif args.stream:
                for chunk in client.generate_stream(prompt, **fields):
                    print(chunk.text, end="", flush=True)
                    final = chunk
                print()
            else:
                final = client.generate(prompt, **fields)
                print(final.text)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except ValueError as exc:  # an unreadable or invalid TLS or token file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[finish: {final.finish_reason}; {format_stats(final.stats)}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
