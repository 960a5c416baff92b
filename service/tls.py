"""TLS for the gRPC port and the REST shim, from PEM files: checked once, at config time.

The same three files serve both protocols: a certificate chain and its private key (TLS),
and optionally a CA bundle that client certificates must chain to (mTLS: a client without
one is refused during the handshake). `check_tls_files` opens and parses them with the ssl
module, so a missing, unreadable, malformed or mismatched file stops startup with a line
that names the setting, instead of a handshake error on the first call.

Under mTLS a caller has an identity: `caller_scope` turns the client certificate of a gRPC
call into a short fingerprint, which scopes the request ids that caller chooses.
"""

from __future__ import annotations

import hashlib
import ssl
from dataclasses import dataclass

from engine.errors import ValidationError


@dataclass(frozen=True)
class TlsFiles:
    """A server's PEM files: its certificate chain and key, and the CA that client
    certificates must chain to (None: no client certificates asked for)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValidationError(field, f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ValidationError(field, f"{path} is not a PEM file")
    return data


def check_tls_files(cert_file: str, key_file: str, client_ca_file: str | None) -> None:
    """ValidationError(field, why) unless the files make a usable TLS (and mTLS) server."""
    _read("tls_cert_file", cert_file)
    _read("tls_key_file", key_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def no_password() -> bytes:  # else an encrypted key makes the ssl module ask on the tty
        raise ValidationError("tls_key_file", f"{key_file} is encrypted; give an unencrypted key")

    try:
        context.load_cert_chain(cert_file, key_file, password=no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise ValidationError(
                "tls_key_file", f"{key_file} is not the key of the certificate in {cert_file}"
            ) from None
        raise ValidationError(
            "tls_cert_file", f"{cert_file} / {key_file}: not a certificate and its key ({exc})"
        ) from None
    if client_ca_file is not None:
        _read("tls_client_ca_file", client_ca_file)
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except ssl.SSLError as exc:
            raise ValidationError(
                "tls_client_ca_file", f"{client_ca_file}: no CA certificate in it ({exc})"
            ) from None


def read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def caller_scope(context) -> str:
    """Whose request ids a gRPC call's are: a fingerprint of its client certificate under
    mTLS, else "" (without client certificates every caller is the same principal)."""
    certs = context.auth_context().get("x509_pem_cert")
    return hashlib.sha256(certs[0]).hexdigest()[:32] if certs else ""
