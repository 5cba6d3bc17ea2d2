"""Dialing the coordinator: the gRPC channel, and TLS (a pinned certificate fetched and
checked, or a plain-text agent told why a TLS coordinator will not hear it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc
from trialkeeper.protos import limits
from trialkeeper.protos.wire import REFUSAL_METADATA_KEY, REFUSED_AS_LEFT

from .tls import SERVER_NAME, TlsPinError, pinned_certificate, speaks_tls

log = logging.getLogger(__name__)


class AgentRefused(Exception):
    """The coordinator refused this agent for good (bad token, protocol mismatch). ``left``:
    because this agent had left its environment (its Leaving is stored), which ended stopped."""

    def __init__(self, message: str, *, left: bool = False) -> None:
        super().__init__(message)
        self.left = left


def refused(
    code: grpc.StatusCode, details: str | None, trailing_metadata: Iterable[tuple[str, str | bytes]] | None
) -> AgentRefused:
    """The refusal a stream ended with, and whether its trailing metadata says the agent had left."""
    left = any(key == REFUSAL_METADATA_KEY and value == REFUSED_AS_LEFT for key, value in trailing_metadata or ())
    return AgentRefused(f"{code.name}: {details}", left=left)


def open_channel(coordinator: str, root_cert: bytes | None, server_name: str | None) -> grpc.aio.Channel:
    """A channel to ``coordinator``: TLS trusting ``root_cert`` when given, else plain text."""
    opts: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", limits.MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", limits.MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.enable_retries", 0),
    ]
    if root_cert is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_cert)
        # The certificate names the coordinator, not the address it is reached at.
        opts.append(("grpc.ssl_target_name_override", server_name or SERVER_NAME))
        return grpc.aio.secure_channel(coordinator, creds, options=opts)
    return grpc.aio.insecure_channel(coordinator, options=opts)


async def pin_certificate(coordinator: str, fingerprint: str, timeout_s: float) -> bytes:
    """The coordinator's certificate, fetched and checked against ``fingerprint``."""
    try:
        cert = await asyncio.to_thread(pinned_certificate, coordinator, fingerprint, timeout_s)
    except TlsPinError as e:
        raise AgentRefused(f"TLS: {e}") from e
    except OSError as e:
        raise ConnectionError(f"cannot fetch the coordinator's TLS certificate: {e}") from e
    log.info("coordinator %s presented the pinned TLS certificate", coordinator)
    return cert


async def refuse_if_tls(coordinator: str, root_cert: bytes | None, timeout_s: float) -> None:
    """A plain-text stream to a TLS coordinator only ever sees "Socket closed": say why."""
    if root_cert is None and await asyncio.to_thread(speaks_tls, coordinator, min(2.0, timeout_s)):
        raise AgentRefused(
            f"the coordinator at {coordinator} requires TLS and this agent was started "
            "without it: pass --tls-fingerprint (or --tls-cert) as the coordinator launches agents"
        )
