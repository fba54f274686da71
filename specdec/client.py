"""A small Python client for the coordinator, and a CLI:

    python -m specdec.client --address 127.0.0.1:50051 "def fib(n):" --max-new-tokens 64 --stream
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import grpc

from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc


class CoordinatorClient:
    """Blocking client; `grpc.aio` users can use `coordinator_pb2_grpc.CoordinatorStub` directly."""

    def __init__(self, address: str, timeout_s: float = 600.0) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._timeout_s = timeout_s

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | list[int], **fields) -> coordinator_pb2.GenerateResponse:
        """Whole completion. `fields` are GenerateRequest fields (max_new_tokens, temperature, ...)."""
        return self._stub.Generate(_request(prompt, fields), timeout=self._timeout_s)

    def generate_stream(self, prompt: str | list[int], **fields) -> Iterator[coordinator_pb2.GenerateResponse]:
        """Chunks as rounds complete; the last has finish_reason and stats."""
        yield from self._stub.GenerateStream(_request(prompt, fields), timeout=self._timeout_s)


def _request(prompt: str | list[int], fields: dict) -> coordinator_pb2.GenerateRequest:
    if isinstance(prompt, str):
        return coordinator_pb2.GenerateRequest(prompt=prompt, **fields)
    return coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, **fields)


def format_stats(stats: coordinator_pb2.GenerationStats) -> str:
    return (
        f"{stats.generated_tokens} tokens in {stats.total_ms:.0f} ms ({stats.tokens_per_second:.2f} tok/s), "
        f"{stats.rounds} rounds, acceptance {stats.acceptance_rate:.2f}, "
        f"{stats.mean_accepted_length:.2f} tokens/round, TTFT {stats.time_to_first_token_ms:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.client", description="Generate text through the coordinator")
    parser.add_argument("prompt", help="raw prompt text (no chat template is applied)")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (0 = target only)")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args(argv)
    fields = dict(temperature=args.temperature, top_k=args.top_k, stop=args.stop)
    for name, value in (("max_new_tokens", args.max_new_tokens), ("top_p", args.top_p), ("seed", args.seed), ("num_speculative_tokens", args.k)):
        if value is not None:
            fields[name] = value
    try:
        with CoordinatorClient(args.address) as client:
            if args.stream:
                for chunk in client.generate_stream(args.prompt, **fields):
                    print(chunk.text, end="", flush=True)
                    final = chunk
                print()
            else:
                final = client.generate(args.prompt, **fields)
                print(final.text)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"[finish: {final.finish_reason}; {format_stats(final.stats)}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
