"""Certificates made at test time: a CA, a server certificate for localhost, a client
certificate for mutual TLS, and the bad ones (another CA's, an expired one, one for another
host)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    """A PEM certificate and its PEM private key."""

    cert: bytes
    key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Authority:
    """A CA that signs leaf certificates."""

    def __init__(self, name: str) -> None:
        self._key = _key()
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pem = self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        *,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        client: bool = False,
        expired: bool = False,
    ) -> Pair:
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = (
            (now - datetime.timedelta(days=10), now - datetime.timedelta(days=5))
            if expired
            else (
                now - datetime.timedelta(days=1),
                now + datetime.timedelta(days=30),
            )
        )
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "isthmus tests"),
                x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            ]
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]
                ),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


@dataclass(frozen=True)
class Certs:
    """Everything the TLS tests use, as PEM bytes."""

    ca: bytes
    server: Pair
    client: Pair
    other_ca: bytes
    other_client: Pair
    expired_server: Pair
    wrong_host_server: Pair

    def write(self, directory: Path) -> dict[str, Path]:
        """Writes each PEM to a file (for grpcurl); returns the paths by name."""
        files = {
            "ca": self.ca,
            "server.crt": self.server.cert,
            "server.key": self.server.key,
            "client.crt": self.client.cert,
            "client.key": self.client.key,
        }
        paths = {}
        for name, data in files.items():
            path = directory / name
            path.write_bytes(data)
            paths[name] = path
        return paths


def make() -> Certs:
    ca = Authority("isthmus test CA")
    other = Authority("some other CA")
    return Certs(
        ca=ca.pem,
        server=ca.issue("localhost", dns=("localhost",), ips=("127.0.0.1", "::1")),
        client=ca.issue(
            "client", dns=("client.example",), uris=("spiffe://isthmus.test/client",), client=True
        ),
        other_ca=other.pem,
        other_client=other.issue("intruder", dns=("intruder.example",), client=True),
        expired_server=ca.issue("localhost", dns=("localhost",), ips=("127.0.0.1",), expired=True),
        wrong_host_server=ca.issue("elsewhere", dns=("elsewhere.example",)),
    )
