"""Everything a secured deployment needs, generated into one folder per machine.

``make_credentials(DIR, hosts, nodes)`` writes::

    DIR/ca/              ca.crt, ca.key         the certificate authority: keep ca.key offline
    DIR/superlink/       ca.crt, server.crt, server.key   TLS for the SuperLink (its names: hosts)
    DIR/supernode-<i>/   ca.crt, node.key, node.pub, sketch-secret
                         ca.crt verifies the SuperLink; node.key authenticates the node (node.pub is
                         registered with `flwr supernode register`); sketch-secret is the federation's
                         shared sketch secret, which must never reach the server.

Private keys and the secret are readable by their owner only. Node keys are ECDSA P-384 in OpenSSH
format, as Flower's SuperNode authentication expects.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedlora.node import write_sketch_secret

VALID_DAYS = 365
MAX_NODES = 10_000  # about 9 ms and 20 KiB a node: a folder of 10,000 takes about 1.5 minutes and 200 MiB
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class Credentials:
    root: Path
    nodes: int

    @property
    def ca_cert(self) -> Path:
        return self.root / "superlink" / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.root / "superlink" / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.root / "superlink" / "server.key"

    def node_dir(self, i: int) -> Path:
        return self.root / f"supernode-{i}"

    def missing(self, *, secret: bool) -> list[Path]:
        """The files a deployment needs that the folder lacks (with ``secret``, the nodes' sketch secrets too)."""
        per_node = ("node.key", "sketch-secret") if secret else ("node.key",)
        needed = [self.ca_cert, *[self.node_dir(i) / f for i in range(self.nodes) for f in per_node]]
        return [f for f in needed if not f.is_file()]


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, public_key, issuer: x509.Name, signing_key, *, ca: bool,
                 hosts: tuple[str, ...] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if hosts:
        names = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot name the SuperLink in its certificate, or None: an IP address, or a DNS name (RFC 1123
    labels). A port or a scheme would be written into the certificate as a name no connection ever matches, and
    TLS would fail only when the SuperNodes connect."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in host.split(".")):
        return None
    return (f"--host '{host}' is not a host name or IP address: give the bare name or address the SuperNodes reach "
            "the SuperLink by (no scheme, port or path).")


def make_credentials(root: str | os.PathLike[str], *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                     nodes: int = 2) -> Credentials:
    """A CA, the SuperLink's certificate for ``hosts``, and for each node a key pair and the sketch secret."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must lie in [1, {MAX_NODES}], got {nodes}.")
    if not hosts:
        raise ValueError("Name at least one host the SuperNodes will reach the SuperLink by (--host).")
    if problems := [p for p in map(host_problem, hosts) if p]:
        raise ValueError("\n".join(problems))
    creds = Credentials(Path(root), nodes)
    if creds.root.exists() and (not creds.root.is_dir() or any(creds.root.iterdir())):
        raise ValueError(f"'{creds.root}' is {'not empty' if creds.root.is_dir() else 'a file'}: credentials are never "
                         "written over (the CA, the node keys and the sketch secret would be lost); choose a new "
                         "directory.")
    for folder in ("ca", "superlink", *[f"supernode-{i}" for i in range(nodes)]):
        (creds.root / folder).mkdir(parents=True, exist_ok=True)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlora CA")])
    ca_pem = _certificate("fedlora CA", ca_key.public_key(), ca_name, ca_key, ca=True).public_bytes(
        serialization.Encoding.PEM)
    (creds.root / "ca" / "ca.crt").write_bytes(ca_pem)
    _write_private(creds.root / "ca" / "ca.key", _pem_key(ca_key))

    server_key = ec.generate_private_key(ec.SECP384R1())
    server = _certificate(hosts[0], server_key.public_key(), ca_name, ca_key, ca=False, hosts=hosts)
    creds.ca_cert.write_bytes(ca_pem)
    creds.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_private(creds.server_key, _pem_key(server_key))

    secret = write_sketch_secret(creds.root / "ca" / "sketch-secret")  # the master copy, with the CA key
    for i in range(nodes):
        folder = creds.node_dir(i)
        (folder / "ca.crt").write_bytes(ca_pem)
        key = ec.generate_private_key(ec.SECP384R1())
        _write_private(folder / "node.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
        (folder / "node.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
        _write_private(folder / "sketch-secret", secret.read_bytes())
    return creds
