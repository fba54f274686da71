"""A private CA and certificates for TLS and mutual TLS between specdec's services (needs the
`cryptography` package: `pip install cryptography`).

    python deploy/make_certs.py OUT_DIR [--namespace specdec] [--days 825]

Writes OUT_DIR/ca.crt and ca.key (keep ca.key offline: only the certificates below need it) and,
for draft, target and coordinator, NAME.crt and NAME.key: valid as a server and as a client
(the coordinator presents its certificate to draft and target, and each service's health probe
presents its own), for the hosts NAME, specdec-NAME, specdec-NAME.NAMESPACE[.svc[.cluster.local]],
localhost and 127.0.0.1. client.crt and client.key are a client-only certificate for callers of
the coordinator. The tests issue their certificates with this file too.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICES = ("draft", "target", "coordinator")


@dataclass(frozen=True)
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def make_ca(common_name: str = "specdec CA", days: int = 3650) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    not_before, not_after = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def make_leaf(ca: Issued, common_name: str, hosts: list[str], server: bool = True, days: int = 825) -> Issued:
    """A certificate signed by `ca` for `hosts` (DNS names or IP addresses); `server=False`
    gives a client-only certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    not_before, not_after = _validity(days)
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(host) for host in hosts]), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def service_hosts(name: str, namespace: str = "specdec") -> list[str]:
    """The names a service is reached by: compose service, Kubernetes Service (short and full),
    and loopback for its own health probe."""
    service = f"specdec-{name}"
    return [
        name,
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        "localhost",
        "127.0.0.1",
    ]


def write(issued: Issued, folder: Path, stem: str) -> tuple[Path, Path]:
    """STEM.crt and STEM.key (the key readable by its owner only)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    cert_path.write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.chmod(0o600)
    key_path.write_bytes(
        issued.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the files to")
    parser.add_argument("--namespace", default="specdec", help="Kubernetes namespace the Services are in")
    parser.add_argument("--days", type=int, default=825, help="validity of the service and client certificates")
    args = parser.parse_args(argv)
    ca = make_ca()
    write(ca, args.out, "ca")
    for name in SERVICES:
        write(make_leaf(ca, f"specdec-{name}", service_hosts(name, args.namespace), days=args.days), args.out, name)
    write(make_leaf(ca, "specdec-client", [], server=False, days=args.days), args.out, "client")
    print(f"wrote ca, {', '.join(SERVICES)} and client certificates to {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
