"""Separate network hosts on one machine: a network namespace per host, each joined to one
bridge by a veth link, with the link's latency added by a user-space forwarder
(specdec.tools.delay_link; this kernel has no `netem`).

    with Testbed({"client": LinkDelay(0.5), "coordinator": LinkDelay(0.5),
                  "draft": LinkDelay(2.0), "target": LinkDelay(0.05)}) as bed:
        draft = bed.serve("draft", "draft_service", ["--model", ...], logs / "draft.log")
        ...
        bed.run("client", [sys.executable, "-m", "specdec.tools.client", ...])

A host's delay is its link's one-way latency: the forwarder in front of each service holds
every byte for it in both directions, so a call from the coordinator to the draft takes the
draft link's delay each way (the coordinator's own link carries the client's calls). Services
run by their documented commands inside their host's namespace, listening on the namespace's
loopback behind the forwarder; the forwarder listens on the host's address. The machine's own
namespace reaches every host through the bridge's address, as a management network would.

Everything is torn down on exit or error: processes, namespaces (which takes their veth
links), the bridge. A testbed whose process was killed is swept by the next one (names carry
the owner's pid), or by `python -m specdec.tools.testbed --sweep`. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec.rpc.ports import free_port
from specdec.tools.delay_link import LinkDelay
from specdec.tools.launch import ServiceProcess, spawn, stop_all

PREFIX = "sdtb"  # names: sdtb<pid>-<host> (namespaces), sdtb<pid> (bridge), sdtb<pid>h<i> (veths)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip args`; with `check`, a failure raises with what `ip` said."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _ours(name: str, tag: str) -> bool:
    """Whether an interface or namespace name is the testbed `tag`'s (pid 12's, not pid 123's)."""
    return name == tag or name.startswith((f"{tag}-", f"{tag}h"))


def _free_subnet(preferred: int) -> int:
    """The third octet of a 10.251.x.0/24 no interface here uses, starting at `preferred`."""
    used = ip("-4", "-o", "addr", "show", check=False).stdout
    for offset in range(240):
        candidate = 10 + (preferred - 10 + offset) % 240
        if f" 10.251.{candidate}." not in used:
            return candidate
    raise RuntimeError("no free 10.251.x.0/24 subnet for a testbed")


def available() -> str | None:
    """None when a testbed can be built here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "delete", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    digits = name[len(PREFIX) :].split("-")[0].split("h")[0]
    return int(digits) if digits.isdigit() else None


def _namespaces() -> list[str]:
    return ip("netns", "list", check=False).stdout.split()


def _links() -> list[str]:
    """Every interface's name here (a veth's without its peer's `@…`)."""
    lines = ip("-o", "link", "show", check=False).stdout.splitlines()
    return [line.split(":")[1].strip().split("@")[0] for line in lines if ":" in line]


def _kill_inside(namespace: str) -> None:
    """Kills whatever still runs in `namespace`, so that deleting it frees it."""
    for pid in ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def leftovers(tag: str | None = None) -> list[str]:
    """The namespaces and links of the testbed `tag` (this process's by default) that exist."""
    tag = tag or f"{PREFIX}{os.getpid()}"
    return [name for name in (*_namespaces(), *_links()) if _ours(name, tag)]


def sweep(everything: bool = False) -> list[str]:
    """Removes testbeds whose owning process is gone (all of them with `everything`): their
    namespaces' processes, the namespaces and the bridges. Returns what it removed."""
    removed = []
    for name in (n for n in _namespaces() if n.startswith(PREFIX)):
        owner = _owner(name)
        if everything or owner is None or not _alive(owner):
            _kill_inside(name)
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for link in (n for n in _links() if n.startswith(PREFIX)):
        owner = _owner(link)
        if everything or owner is None or not _alive(owner):
            ip("link", "delete", link, check=False)
            removed.append(link)
    return removed


@dataclass
class Host:
    name: str
    namespace: str
    address: str  # on the bridge's subnet
    delay: LinkDelay
    veth: str  # the link's end on the bridge

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class Testbed:
    """Hosts by name, each with its link's delay; a context manager that builds and removes them."""

    __test__ = False  # not a pytest class, whatever its name

    links: Mapping[str, LinkDelay]
    subnet: int = 0  # 10.251.<subnet>.0/24, picked free on entry
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[ServiceProcess] = field(default_factory=list)
    bridge_made: bool = False

    @property
    def tag(self) -> str:
        return f"{PREFIX}{os.getpid()}"

    @property
    def gateway(self) -> str:
        return f"10.251.{self.subnet}.1"

    def __enter__(self) -> Testbed:
        sweep()
        if ip("link", "show", self.tag, check=False).returncode == 0:
            raise RuntimeError(f"a testbed of this process ({self.tag}) is already up: one at a time per process")
        self.subnet = _free_subnet(10 + os.getpid() % 240)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        bridge = self.tag
        ip("link", "add", bridge, "type", "bridge")
        self.bridge_made = True
        ip("addr", "add", f"{self.gateway}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for index, (name, delay) in enumerate(self.links.items(), start=2):
            namespace, veth = f"{self.tag}-{name}", f"{self.tag}h{index}"
            ip("netns", "add", namespace)
            self.hosts[name] = Host(name, namespace, "", delay, veth)  # to remove, should the rest fail
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            ip("link", "set", veth, "master", bridge, "up")
            address = f"10.251.{self.subnet}.{index}"
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            ip("-n", namespace, "link", "set", "lo", "up")
            self.hosts[name] = Host(name, namespace, address, delay, veth)

    def serve(
        self,
        host: str,
        module: str,
        args: Sequence[str],
        log: Path,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        cpus: Collection[int] = (),
    ) -> ServiceProcess:
        """`python -m module args` in `host`'s namespace on its loopback, on `cpus` (spawn),
        behind a forwarder on the host's address that adds the link's delay. The returned
        address is the forwarder's, reachable from every host and from this namespace."""
        where = self.hosts[host]
        inner, public = free_port(), free_port()
        link_log = log.with_name(f"{log.stem}-link.log")
        link_log.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "specdec.tools.delay_link", "--listen", f"{where.address}:{public}",
            "--to", f"127.0.0.1:{inner}", "--delay-ms", str(where.delay.delay_ms),
            "--jitter-ms", str(where.delay.jitter_ms),
        ]  # fmt: skip
        process = subprocess.Popen(where.command(command), cwd=cwd, stdout=link_log.open("w"), stderr=subprocess.STDOUT)
        link = ServiceProcess(f"{host}-link", f"{where.address}:{public}", process, link_log)
        self.processes.append(link)
        link.wait_listening(timeout_s=30)
        service = spawn(host, module, list(args), inner, log, env, cwd, prefix=where.command([]), cpus=cpus)
        service.address = f"{where.address}:{public}"
        service.local_address = f"127.0.0.1:{inner}"  # for a service on the same host: no link
        self.processes.append(service)
        return service

    def serve_direct(
        self,
        host: str,
        module: str,
        args: Sequence[str],
        port: int,
        log: Path,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
    ) -> ServiceProcess:
        """`python -m module args --port port` in `host`'s namespace with no forwarder (and no
        delay): it binds what its own flags say, so other hosts reach it only if those bind an
        address they can reach. The returned address is the host's, at `port`."""
        service = spawn(host, module, list(args), port, log, env, cwd, prefix=self.hosts[host].command([]))
        service.address = f"{self.hosts[host].address}:{port}"
        service.local_address = f"127.0.0.1:{port}"
        self.processes.append(service)
        return service

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 120.0, **kwargs) -> subprocess.CompletedProcess:
        """Runs a command on `host` to completion (stdout and stderr captured as text)."""
        return subprocess.run(
            self.hosts[host].command(argv), capture_output=True, text=True, timeout=timeout_s, **kwargs
        )

    def close(self) -> None:
        stop_all(self.processes, timeout_s=10)
        self.processes.clear()
        for host in self.hosts.values():
            _kill_inside(host.namespace)
            # The link first: a namespace's own end goes with it, but only once the kernel
            # frees the namespace, which can be after `ip netns delete` returns.
            ip("link", "delete", host.veth, check=False)
            ip("netns", "delete", host.namespace, check=False)
        self.hosts.clear()
        if self.bridge_made:
            ip("link", "delete", self.tag, check=False)
            self.bridge_made = False

    def leftovers(self) -> list[str]:
        """This testbed's namespaces and links that still exist (none once closed)."""
        return leftovers(self.tag)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.testbed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="remove the testbeds left behind by killed processes")
    parser.add_argument("--check", action="store_true", help="say whether a testbed can be built here")
    args = parser.parse_args(argv)
    if args.check:
        problem = available()
        print(problem or "a testbed can be built here")
        return 1 if problem else 0
    if args.sweep:
        removed = sweep()
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
