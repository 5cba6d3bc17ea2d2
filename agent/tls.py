"""Pinning the coordinator's certificate: the agent trusts one certificate and no CA.

The coordinator makes a self-signed certificate per experiment and launches agents with
its SHA-256 fingerprint. Before its first connection the agent fetches the certificate the
coordinator presents, compares its fingerprint with the pinned one in constant time, and
then gives gRPC exactly that certificate as its only trusted root. A man in the middle
would have to present this certificate, and without its private key it cannot complete
the handshake. Standard library only: agents need no crypto package for this.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl

# The name in the certificate's SAN, checked instead of the address the agent dials.
SERVER_NAME = "trialkeeper-coordinator"
_HEX = frozenset("0123456789abcdef")


class TlsPinError(Exception):
    """The coordinator cannot be trusted, or does not speak TLS: retrying will not help."""


def normalize_fingerprint(text: str) -> str:
    """``text`` as 64 lower-case hex digits; colons, spaces and a ``sha256:`` prefix are
    accepted. Raises ValueError when it is not a SHA-256 fingerprint."""
    fp = text.strip().lower().removeprefix("sha256:").replace(":", "").replace(" ", "")
    if len(fp) != 64 or not set(fp) <= _HEX:
        raise ValueError(f"expected a SHA-256 fingerprint (64 hex digits), got {text!r}")
    return fp


def certificate_fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of a PEM certificate's DER form, 64 lower-case hex digits."""
    try:
        der = ssl.PEM_cert_to_DER_cert(cert_pem.decode("ascii"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a PEM certificate: {e}") from e
    return hashlib.sha256(der).hexdigest()


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _client_context() -> ssl.SSLContext:
    # Verification is the fingerprint comparison below, not a CA chain: nothing is trusted
    # yet, that is what this connection is for.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    return ctx


def fetch_certificate(address: str, timeout: float) -> bytes:
    """The certificate (DER) the server at ``address`` presents in a TLS handshake.

    Raises :class:`TlsPinError` when the server answers but not with TLS, and OSError
    when it cannot be reached (worth retrying).
    """
    host, port = split_address(address)
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with _client_context().wrap_socket(raw, server_hostname=SERVER_NAME) as tls:
                der = tls.getpeercert(binary_form=True)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            raise  # the connection went away mid-handshake: an OSError, retried
        except ssl.SSLError as e:
            raise TlsPinError(
                f"the coordinator at {address} does not speak TLS ({e.reason or e}); "
                "it was started without coordinator.tls, so start this agent without "
                "--tls-fingerprint/--tls-cert"
            ) from e
    if not der:
        raise TlsPinError(f"the coordinator at {address} presented no certificate")
    return der


def pinned_certificate(address: str, expected_fingerprint: str, timeout: float) -> bytes:
    """Fetch the coordinator's certificate and return it (PEM) if its SHA-256 fingerprint
    is ``expected_fingerprint``; raise :class:`TlsPinError` if it is not."""
    expected = normalize_fingerprint(expected_fingerprint)
    der = fetch_certificate(address, timeout)
    got = hashlib.sha256(der).hexdigest()
    if not hmac.compare_digest(got.encode(), expected.encode()):
        raise TlsPinError(
            f"the certificate presented by {address} has SHA-256 fingerprint {got}, not the "
            f"pinned {expected}: this is not the coordinator this agent was launched for "
            "(or someone is intercepting the connection); refusing to connect"
        )
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii")


def speaks_tls(address: str, timeout: float) -> bool:
    """True when the server at ``address`` completes a TLS handshake (used to explain why
    a plain-text connection failed)."""
    try:
        fetch_certificate(address, timeout)
    except (OSError, TlsPinError, ValueError):
        return False
    return True
