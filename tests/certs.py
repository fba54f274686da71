"""Certificates and token files for the TLS and token tests, issued at test time with
deploy/make_certs.py (the script deploy/README.md tells users to run)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

MAKE_CERTS = Path(__file__).resolve().parents[1] / "deploy" / "make_certs.py"


def load_make_certs():
    spec = importlib.util.spec_from_file_location("deploy_make_certs", MAKE_CERTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class TLSFiles:
    folder: Path
    ca: str  # the CA that signed everything below but the rogue files
    server_cert: str  # for 127.0.0.1 and localhost, usable as a client certificate too
    server_key: str
    client_cert: str  # client-only
    client_key: str
    rogue_ca: str  # another CA, and a client certificate it signed
    rogue_client_cert: str
    rogue_client_key: str
    tokens: str  # two accepted tokens, a blank line between them
    other_token: str  # a token in no server's list

    def path(self, name: str) -> str:
        return str(self.folder / name)


def issue(folder: Path) -> TLSFiles:
    make_certs = load_make_certs()
    ca, rogue_ca = make_certs.make_ca("test CA"), make_certs.make_ca("rogue CA")
    make_certs.write(ca, folder, "ca")
    make_certs.write(rogue_ca, folder, "rogue-ca")
    make_certs.write(make_certs.make_leaf(ca, "server", ["localhost", "127.0.0.1"]), folder, "server")
    make_certs.write(make_certs.make_leaf(ca, "client", [], server=False), folder, "client")
    make_certs.write(make_certs.make_leaf(rogue_ca, "rogue client", [], server=False), folder, "rogue-client")
    (folder / "tokens").write_text("first-token-0123456789\n\nsecond-token-abcdef\n")
    (folder / "other-token").write_text("not-a-token-anyone-accepts\n")
    return TLSFiles(
        folder,
        str(folder / "ca.crt"),
        str(folder / "server.crt"),
        str(folder / "server.key"),
        str(folder / "client.crt"),
        str(folder / "client.key"),
        str(folder / "rogue-ca.crt"),
        str(folder / "rogue-client.crt"),
        str(folder / "rogue-client.key"),
        str(folder / "tokens"),
        str(folder / "other-token"),
    )
