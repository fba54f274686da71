"""The K chooser in simulation: `python -m bench.chooser_sim`.

Not a measurement of the system: the coordinator's own chooser (coordinator.adaptive.AdaptiveK)
picks K round by round for requests whose drafts are accepted position by position with a
fixed probability α (Bernoulli, Leviathan's model), and each round is charged what its
cost model (coordinator.round_costs.RoundCosts) says it costs on a pair of pass-cost profiles
(bench/profiles/). What it shows is how much the choosing itself loses (the rounds spent
learning α: hunches, probes) against the best K fixed in advance on the same profile and α,
which the chooser cannot know. Sequential rounds, a request alone on its target; a target-only
call runs the steps `coordinator.rounds.steps_per_call` gives the coordinator's default (the
first round one step), and a round drafts at most the tokens left but one, as the coordinator's.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from bench.accelerator import profile
from coordinator.adaptive import AdaptiveK
from coordinator.config import CoordinatorConfig
from coordinator.round_costs import RoundCosts
from coordinator.rounds import steps_per_call

K_MAX = 8
PAIRS = {  # name: (target profile, draft profile)
    "h200-captured 1.5B/0.5B": ("h200-captured-1.5b", "h200-captured-0.5b"),
    "h100 70B-TP4/1B": ("h100-70b-tp4", "h100-1b"),
    "h100 8B/0.5B": ("h100-8b", "h100-0.5b"),
    "h100 8B/3B": ("h100-8b", "h100-3b"),
}
ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def pair_costs(target: str, draft: str, rpc_ms: float, context: int = 128) -> RoundCosts:
    """A round's costs on two profiles: passes over 1..K_MAX + 1 new tokens after `context`."""

    def passes(name: str) -> tuple[float, ...]:
        return tuple(profile(name).ms(n, context) for n in range(1, K_MAX + 2))

    costs = RoundCosts(passes(draft), passes(target), rpc_ms, rpc_ms)
    steps = steps_per_call(CoordinatorConfig.target_only_steps, costs)  # as Choosers.k_chooser costs them
    return dataclasses.replace(costs, target_only_steps=steps)


def run(costs: RoundCosts, alpha: float, tokens: int, rng: random.Random, k: int | None = None) -> float:
    """Milliseconds one request of `tokens` tokens takes, K chosen (None) or fixed."""
    chooser = AdaptiveK(k_max=K_MAX, pipelined=False, costs=costs)
    done, ms = 0, 0.0
    while done < tokens:
        limit = tokens - done - 1  # rounds.k_limit
        if k is None:  # as the coordinator: picked within the tokens left, counted on the request's own chooser
            picked = chooser.within(limit).pick()
            chooser.observe_choice(picked)
        chosen = min(picked if k is None else k, limit)
        if chosen == 0:
            steps = min(costs.target_only_steps if done else 1, tokens - done)
            ms, done = ms + steps * costs.verify_ms(0), done + steps
            continue
        accepted = 0
        while accepted < chosen and rng.random() < alpha:
            accepted += 1
        chooser.observe_round(chosen, accepted)
        ms, done = ms + costs.draft_ms(chosen) + costs.verify_ms(chosen), done + accepted + 1
    return ms


def ratio(costs: RoundCosts, alpha: float, tokens: int, requests: int, seed: int) -> tuple[float, int]:
    """(the chooser's rate over the best fixed K's, that K), each from the same seed (the
    draws fall on different positions as the Ks differ: a shared seed, not matched draws)."""

    def rate(k: int | None) -> float:
        rng = random.Random(seed)
        return requests * tokens / sum(run(costs, alpha, tokens, rng, k) for _ in range(requests))

    fixed = {k: rate(k) for k in range(K_MAX + 1)}
    best = max(fixed, key=fixed.__getitem__)
    return rate(None) / fixed[best], best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens a request generates")
    parser.add_argument("--requests", type=int, default=100, help="requests per cell")
    parser.add_argument("--rpc-ms", type=float, default=0.8, help="a call's cost outside the passes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("Simulated (Bernoulli acceptance, the chooser's cost model): the chooser's tokens per ms")
    print("over the best fixed K's (that K in brackets), sequential rounds, a request alone.\n")
    print("| pair | " + " | ".join(f"α {alpha}" for alpha in ALPHAS) + " |")
    print("|---|" + "---|" * len(ALPHAS))
    for name, (target, draft) in PAIRS.items():
        costs = pair_costs(target, draft, args.rpc_ms)
        cells = [ratio(costs, alpha, args.tokens, args.requests, args.seed) for alpha in ALPHAS]
        print(f"| {name} | " + " | ".join(f"{r:.3f} (K {k})" for r, k in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
