"""The gRPC edge: accepts agent streams, checks them, and hands messages to the core.

Only this module and the agent's session touch generated protobuf code on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Protocol

import grpc
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-trialkeeper-token"
PROTOCOL_VERSION = 1
REGISTER_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Per-stream outbound messages a slow agent may have queued before its stream is ended.
OUTBOUND_LIMIT = 10_000


class AgentRejected(Exception):
    """The core refuses an agent; ``code`` is the gRPC status the agent sees."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class AgentLink:
    """The coordinator's handle on one open agent stream: an ordered outbound queue.

    Acks are coalesced: only the highest pending one is sent.
    """

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self._queue: asyncio.Queue[pb.CoordinatorMessage | None] = asyncio.Queue()
        self._ack: int | None = None
        self._wakeup = asyncio.Event()
        self.closed = False

    def send(self, msg: pb.CoordinatorMessage) -> None:
        if self.closed:
            return
        if self._queue.qsize() >= OUTBOUND_LIMIT:
            log.warning("agent %s is not reading its stream; closing it", self.peer)
            self.close()
            return
        self._queue.put_nowait(msg)
        self._wakeup.set()

    def ack(self, seq: int) -> None:
        self._ack = seq if self._ack is None else max(self._ack, seq)
        self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self._queue.put_nowait(None)
        self._wakeup.set()

    async def pump(self, context: grpc.aio.ServicerContext) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while not self._queue.empty():
                msg = self._queue.get_nowait()
                if msg is None:
                    return
                await context.write(msg)
            if self._ack is not None:
                seq, self._ack = self._ack, None
                await context.write(pb.CoordinatorMessage(ack=pb.Ack(seq=seq)))


class Core(Protocol):
    """What the servicer needs from the coordinator."""

    def agent_connected(self, register: pb.Register, link: AgentLink) -> None: ...

    def agent_message(self, env_id: str, link: AgentLink, msg: pb.AgentMessage) -> None: ...

    def agent_disconnected(self, env_id: str, link: AgentLink) -> None: ...


class Servicer(pb_grpc.CoordinatorServicer):
    def __init__(self, core: Core, token: str) -> None:
        self.core = core
        self._token = token.encode()

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._token)
        return False

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        if not self._authorized(context):
            log.warning("refused an agent from %s: missing or wrong token", peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong experiment token")
        try:
            first = await asyncio.wait_for(context.read(), REGISTER_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Register within 10 s")
        if first is grpc.aio.EOF or not first.HasField("register"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Register")
        reg = first.register
        if reg.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version mismatch: agent speaks {reg.protocol_version}, coordinator "
                f"speaks {PROTOCOL_VERSION}; install the same trialkeeper version on both",
            )
        if not reg.environment_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Register.environment_id is empty")
        link = AgentLink(peer)
        try:
            self.core.agent_connected(reg, link)
        except AgentRejected as e:
            log.warning("refused agent for %s from %s: %s", reg.environment_id, peer, e)
            await context.abort(e.code, str(e))
        pump = asyncio.create_task(link.pump(context))
        env_id = reg.environment_id
        try:
            while not link.closed:
                reader = asyncio.ensure_future(context.read())
                done, _ = await asyncio.wait({reader, pump}, return_when=asyncio.FIRST_COMPLETED)
                if reader not in done:
                    reader.cancel()
                    break  # the pump ended: the core closed this stream
                msg = reader.result()
                if msg is grpc.aio.EOF:
                    break
                self.core.agent_message(env_id, link, msg)
        except (grpc.aio.AioRpcError, asyncio.CancelledError, ConnectionError) as e:
            log.info("stream of %s ended: %s", env_id, type(e).__name__)
        finally:
            self.core.agent_disconnected(env_id, link)
            link.close()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(pump, 2.0)


async def create_server(
    address: str, servicer: Servicer, *, tls_key_cert: tuple[bytes, bytes] | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start a server on ``address`` (port 0 picks a free one). Returns it and its port."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    if tls_key_cert is not None:
        creds = grpc.ssl_server_credentials([tls_key_cert])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, port
