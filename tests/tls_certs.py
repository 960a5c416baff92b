"""Throwaway PKI for TLS tests (a helper, not a test file), made with `cryptography`.

write_pki(dir) writes a CA, a server certificate for localhost / 127.0.0.1 signed by it, two
client certificates signed by it, one client certificate signed by another CA, and a key
that belongs to none of them; it returns their paths. EC P-256 keys: quick to make.
"""

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
class Pki:
    ca: Path  # the CA that signs everything below except `stranger`
    server_cert: Path
    server_key: Path
    alice_cert: Path  # two clients, two identities
    alice_key: Path
    bob_cert: Path
    bob_key: Path
    stranger_cert: Path  # a client certificate from another CA
    stranger_key: Path
    other_key: Path  # the key of no certificate here


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        builder = builder.add_extension(usage, critical=True)
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
        purpose = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return path


def write_pki(directory: Path) -> Pki:
    def new_key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, other_ca_key = new_key(), new_key()
    ca = _issue("pagedserve test CA", ca_key, None, ca=True)
    other_ca = _issue("some other CA", other_ca_key, None, ca=True)
    files: dict[str, Path] = {"ca": _write(directory / "ca.pem", ca)}
    for who, issuer, server in (
        ("server", (ca.subject, ca_key), True),
        ("alice", (ca.subject, ca_key), False),
        ("bob", (ca.subject, ca_key), False),
        ("stranger", (other_ca.subject, other_ca_key), False),
    ):
        key = new_key()
        cert = _issue(who, key, issuer, server=server)
        files[f"{who}_cert"] = _write(directory / f"{who}.pem", cert)
        files[f"{who}_key"] = _write(directory / f"{who}.key", None, key)
    files["other_key"] = _write(directory / "other.key", None, new_key())
    return Pki(**files)
