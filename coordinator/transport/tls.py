"""The coordinator's TLS identity: a self-signed certificate made once per experiment.

Agents do not trust any certificate authority for it. They are given the certificate's
SHA-256 fingerprint when they are launched (``--tls-fingerprint``, not a secret), fetch
the certificate from the coordinator, check the fingerprint and then trust exactly that
certificate. Its only name is :data:`SERVER_NAME`, which agents check instead of the
address they dial, so the same certificate serves however the coordinator is reached.

The key and the certificate live in the experiment directory (mode 0600) so that a
resumed coordinator presents the same certificate to agents that pinned it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "trialkeeper-coordinator"
KEY_FILE = "coordinator-key.pem"
CERT_FILE = "coordinator-cert.pem"
VALIDITY = datetime.timedelta(days=3650)


class TlsError(RuntimeError):
    """The coordinator's certificate cannot be made or read."""


@dataclass(frozen=True)
class CoordinatorIdentity:
    """The coordinator's key and certificate (PEM) and the fingerprint agents pin."""

    key_pem: bytes
    cert_pem: bytes
    fingerprint: str

    @property
    def key_cert(self) -> tuple[bytes, bytes]:
        """What ``grpc.ssl_server_credentials`` takes."""
        return self.key_pem, self.cert_pem


def fingerprint(cert_pem: bytes) -> str:
    """The SHA-256 of the certificate's DER form, as 64 lower-case hex digits."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise TlsError(f"not a PEM certificate: {e}") from e
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def load_or_create(directory: Path) -> CoordinatorIdentity:
    """The identity stored in ``directory``, made and stored there first if it has none."""
    key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
    if key_path.exists() and cert_path.exists():
        try:
            key_pem, cert_pem = key_path.read_bytes(), cert_path.read_bytes()
        except OSError as e:
            raise TlsError(f"cannot read the coordinator certificate: {e}") from e
        return CoordinatorIdentity(key_pem, cert_pem, fingerprint(cert_pem))
    key_pem, cert_pem = _generate()
    directory.mkdir(parents=True, exist_ok=True)
    _write_private(key_path, key_pem)
    _write_private(cert_path, cert_pem)
    return CoordinatorIdentity(key_pem, cert_pem, fingerprint(cert_pem))


def _write_private(path: Path, data: bytes) -> None:
    # Written under a temporary name, then renamed: a crash never leaves half a key behind.
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise TlsError(f"cannot write {path}: {e}") from e


def _generate() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # An hour of slack for agents whose clocks run a little behind.
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)
