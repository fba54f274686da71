"""`python -m bench.emulated --service draft|target --pass-cost-profile FILE SERVICE ARGS`: a
model service held to an emulated accelerator's timing (specdec.engine.pace): every forward
pass of the real model (tiny in tests) is held until the profile's time for it has passed,
sleeping as a host does beside a GPU, so calibration, `Info` and the K chooser see the
emulated costs, and a pass whose real compute overruns the profile is counted
(`Info.emulation_overruns`). The profile gives ms by new tokens and per 1k cached tokens;
bench/profiles/ holds published ones and the format is in specdec/engine/pace.py.

It is the benchmarks' and the tests' machinery, not a service flag: a deployment runs at its
hardware's own speed. A caller that builds its arguments with `--pass-cost-profile` among
them starts `service_command`'s module, as `bench.rules_coordinator` is for round rules."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from specdec.engine.pace import load_profile

PROFILE_FLAG = "--pass-cost-profile"
SERVICES = {"draft": "draft_service", "target": "target_service"}


def service_command(role: str, args: Sequence[str]) -> tuple[str, list[str]]:
    """The module to run a draft or target with `args` (`python -m MODULE ARGS`): this one
    where `args` name a profile, the service's own otherwise."""
    if PROFILE_FLAG in args:
        return __name__, ["--service", role, *args]
    return SERVICES[role], list(args)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.emulated",
        description="A draft or target service held to an emulated accelerator's pass times.",
        allow_abbrev=False,  # the service's own flags pass through untouched
    )
    parser.add_argument("--service", choices=sorted(SERVICES), required=True)
    parser.add_argument(PROFILE_FLAG, dest="profile", required=True, metavar="FILE")
    own, rest = parser.parse_known_args(argv)
    try:  # before the weights load: a malformed profile fails in a second
        load_profile(own.profile)
    except ValueError as exc:
        parser.error(f"{PROFILE_FLAG} {own.profile}: {exc}")
    server = importlib.import_module(f"{SERVICES[own.service]}.server")
    server.main(rest, pass_cost_profile=own.profile)


if __name__ == "__main__":
    main(sys.argv[1:])
