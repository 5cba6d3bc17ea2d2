"""The gRPC edge: accepts agent streams, checks them, and hands them to the core as events.

Only this module, ``checks.py`` (what it refuses) and ``wire.py`` (which turns messages
into the core's events and back) touch generated protobuf code on the coordinator's side.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import itertools
import logging
from typing import Literal, NoReturn, Protocol

import grpc
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message
from trialkeeper.protos import limits
from trialkeeper.protos.v1 import coordinator_pb2 as pb
from trialkeeper.protos.v1 import coordinator_pb2_grpc as pb_grpc
from trialkeeper.protos.wire import PROTOCOL_VERSION, REFUSAL_METADATA_KEY, REFUSED_AS_LEFT, TOKEN_METADATA_KEY

from ..engine import checkpoints as ck
from ..engine import events as ev
from . import wire
from .checks import MAX_SEQ, Refusal, over_limit

log = logging.getLogger(__name__)
REGISTER_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = limits.MAX_MESSAGE_BYTES
# Per-stream outbound messages a slow agent may have queued before its stream is ended.
OUTBOUND_LIMIT = 10_000
# How long an ack may wait for later acks to merge with it (see AgentLink).
ACK_LINGER_S = 0.002
MAX_ENVIRONMENT_ID_CHARS = limits.MAX_ID_CHARS
# Notes per trial and message on refused metrics; the rest are counted in one more line.
MAX_NOTES_PER_TRIAL = 10


# Why the core refuses an agent, as the gRPC status the agent sees (and the trailing metadata
# that tells an agent which had left its environment so).
REFUSAL_CODES = {
    ev.Refusal.NOT_NOW: grpc.StatusCode.FAILED_PRECONDITION,
    ev.Refusal.UNKNOWN_ENVIRONMENT: grpc.StatusCode.FAILED_PRECONDITION,
    ev.Refusal.ALREADY_CONNECTED: grpc.StatusCode.FAILED_PRECONDITION,
    ev.Refusal.LEFT: grpc.StatusCode.FAILED_PRECONDITION,
}
REFUSAL_TRAILERS = {ev.Refusal.LEFT: ((REFUSAL_METADATA_KEY, REFUSED_AS_LEFT),)}

_link_ids = itertools.count(1)


class AgentLink:
    """The coordinator's handle on one open agent stream: an ordered outbound queue.

    Acks are coalesced: only the highest pending one is sent, and an ack with nothing
    else to send waits up to ``ACK_LINGER_S`` for the acks of the messages behind it.
    Each write on a gRPC stream costs about as much as handling a small message, so
    under a flood of small messages one ack per message would halve the throughput.
    """

    def __init__(self, peer: str) -> None:
        self.id = next(_link_ids)
        self.peer = peer
        #: Why the core ended this stream with an error ('' for a plain close).
        self.error = ""
        self._queue: collections.deque[pb.CoordinatorMessage | None] = collections.deque()
        self._ack: int | None = None
        self._ack_now = False
        self._wakeup = asyncio.Event()
        self._urgent = asyncio.Event()
        self._wrote = asyncio.Event()  # set after each write: what send_paced waits on
        self.closed = False

    def send(self, message: ev.ToAgent) -> None:
        if self.closed:
            return
        if len(self._queue) >= OUTBOUND_LIMIT:
            log.warning("agent %s is not reading its stream; closing it", self.peer)
            self.close()
            return
        self._queue.append(wire.to_agent(message))
        self._wakeup.set()
        self._urgent.set()

    async def send_paced(self, message: ev.ToAgent, *, max_queued: int, timeout: float) -> bool:
        """Send once at most ``max_queued`` messages wait ahead of it (a long stream of
        them, say a checkpoint going down, holds no more than that in memory). False when
        the stream closed or did not drain within ``timeout``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self._queue) > max_queued and not self.closed:
            self._wrote.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wrote.wait(), left)
        if self.closed:
            return False
        self.send(message)
        return True

    def ack(self, seq: int, *, now: bool = False) -> None:
        """Acknowledge up to ``seq``; ``now``: without lingering (someone waits on it, a trial's save)."""
        self._ack = seq if self._ack is None else max(self._ack, seq)
        self._ack_now = self._ack_now or now
        self._wakeup.set()

    def fail(self, details: str) -> None:
        """End the stream with an INTERNAL error carrying ``details``."""
        self.error = details
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._queue.append(None)
        self._wakeup.set()
        self._urgent.set()

    async def pump(self, context: grpc.aio.ServicerContext) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue and self._ack is not None and ACK_LINGER_S > 0 and not self._ack_now:
                # Only an ack to send: let the acks of messages already arriving join it,
                # but go at once when something else is to be sent.
                self._urgent.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), ACK_LINGER_S)
            self._urgent.clear()
            while self._queue:
                msg = self._queue.popleft()
                if msg is None:
                    return
                await context.write(msg)
                self._wrote.set()
            if self._ack is not None:
                seq, self._ack, self._ack_now = self._ack, None, False
                await context.write(pb.CoordinatorMessage(ack=pb.Ack(seq=seq)))


class Core(Protocol):
    """What the servicer needs from the coordinator (its shell)."""

    def agent_connected(self, registered: ev.AgentRegistered, link: AgentLink) -> ev.RefuseAgent | None: ...

    def agent_event(self, event: wire.AgentEvent, link: AgentLink) -> None: ...

    def agent_disconnected(self, env_id: str, link: AgentLink) -> None: ...

    def checkpoint_fetch(self, request: ck.CheckpointFetchRequested, link: AgentLink) -> None: ...

    def agent_note(self, env_id: str, trial_id: str, text: str) -> None:
        """Append one line to the trial's stderr log if that trial is placed on that environment."""


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
        authorized = self._authorized(context)
        try:
            # Read before refusing a wrong token: the agent has written its Register by now, and
            # grpcio's asyncio client reports a write that fails on an ended call as INTERNAL
            # instead of the status it was given (grpc/grpc#36066), which the agent retries.
            first = await asyncio.wait_for(context.read(), REGISTER_TIMEOUT_S)
        except (asyncio.TimeoutError, DecodeError) as e:
            first = e
        if not authorized:
            log.warning("refused an agent from %s: missing or wrong token", peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong experiment token")
        if isinstance(first, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Register within 10 s")
        if isinstance(first, DecodeError):
            log.warning("refused a stream from %s: its first message is not an AgentMessage", peer)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message could not be parsed as a Register"
            )
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
        if not _valid_environment_id(reg.environment_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Register.environment_id must be at most {MAX_ENVIRONMENT_ID_CHARS} (MAX_ID_CHARS) "
                "printable characters without slashes",
            )
        bad = _out_of_range(reg)
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register.{bad} is out of range")
        bad = over_limit(first)
        if bad:
            log.warning("refused agent for %s from %s: %s", reg.environment_id, peer, bad)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register refused: {bad}")
        link = AgentLink(peer)
        refusal = self.core.agent_connected(wire.registered(reg, link.id), link)
        if refusal is not None:
            log.warning("refused agent for %s from %s: %s", reg.environment_id, peer, refusal.message)
            await context.abort(REFUSAL_CODES[refusal.why], refusal.message, REFUSAL_TRAILERS.get(refusal.why, ()))
        pump = asyncio.create_task(link.pump(context))
        env_id = reg.environment_id
        # Reads are awaited directly in this task (a task per read would cost two more loop
        # turns per message); the pump ending (the core closed this stream) cancels this
        # task, but only while it waits on a read.
        me = asyncio.current_task()
        reading = False
        pump_ended = False
        refusing = 0  # messages of this stream with refused metrics: the log names only some

        def on_pump_done(_: object) -> None:
            nonlocal pump_ended
            pump_ended = True
            if reading and me is not None:
                me.cancel()

        pump.add_done_callback(on_pump_done)

        async def abort(code: grpc.StatusCode, details: str) -> NoReturn:
            # The status cannot be sent while a write of the pump is in flight: let the
            # pump finish (bounded), then end the call.
            link.close()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(pump, 2.0)
            await context.abort(code, details)
            raise AssertionError("unreachable: abort raises")

        try:
            while not link.closed and not pump_ended:
                try:
                    reading = True
                    try:
                        msg = await context.read()
                    finally:
                        reading = False  # from here on, nothing cancels this task for the pump
                except asyncio.CancelledError:
                    if pump_ended:
                        _uncancel(me)
                        break  # the pump ended: the core closed this stream
                    raise
                except DecodeError:
                    log.warning("environment %s sent an unparsable message; ending its stream", env_id)
                    await abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "a message could not be parsed as an AgentMessage"
                    )
                if msg is grpc.aio.EOF:
                    break
                assert isinstance(msg, pb.AgentMessage)
                seq = msg.seq
                if seq > MAX_SEQ:
                    await abort(grpc.StatusCode.INVALID_ARGUMENT, f"sequence number {seq} is out of range")
                if msg.HasField("heartbeat"):  # checked as it is converted: the most frequent message
                    beat = wire.heartbeat(env_id, link.id, msg.heartbeat)
                    if isinstance(beat, str):
                        log.warning("environment %s: a heartbeat refused: %s; ending its stream", env_id, beat)
                        await abort(grpc.StatusCode.INVALID_ARGUMENT, f"message #{seq} refused: {beat}")
                    self.core.agent_event(beat, link)
                    continue
                # The core skips, loudly, a message it cannot store; the checks here keep every
                # valid message from that path.
                if msg.HasField("metrics"):
                    converted = wire.metrics_reported(env_id, link.id, seq, msg.metrics)
                    if isinstance(converted, str):
                        log.warning(
                            "environment %s: message #%d refused: %s; ending its stream", env_id, seq, converted
                        )
                        await abort(grpc.StatusCode.INVALID_ARGUMENT, f"message #{seq} refused: {converted}")
                    reported, refused = converted
                    # Metrics the core could not store are left out and noted in their trial's
                    # log: what is acknowledged is what is stored.
                    if refused:
                        refusing += 1
                        self._note_refused(env_id, seq, refused, log_it=refusing <= 10 or refusing % 1000 == 0)
                    self.core.agent_event(reported, link)
                    continue
                if bad := over_limit(msg):
                    log.warning("environment %s: message #%d refused: %s; ending its stream", env_id, seq, bad)
                    await abort(grpc.StatusCode.INVALID_ARGUMENT, f"message #{seq} refused: {bad}")
                if msg.HasField("checkpoint_chunk") or msg.HasField("checkpoint_saved") or msg.HasField(
                    "fetch_checkpoint"
                ):
                    bad = _out_of_range(msg)
                    if bad:
                        await abort(grpc.StatusCode.INVALID_ARGUMENT, f"message #{seq}: {bad} is out of range")
                    if msg.HasField("fetch_checkpoint"):  # not numbered: asked again after a reconnect
                        self.core.checkpoint_fetch(wire.fetch_requested(env_id, link.id, msg.fetch_checkpoint), link)
                        continue
                event = wire.agent_event(env_id, link.id, msg)
                if event is None:
                    log.warning("environment %s sent an unexpected %s message; ignored", env_id, msg.WhichOneof("body"))
                    continue
                self.core.agent_event(event, link)
            if link.error:
                await abort(grpc.StatusCode.INTERNAL, link.error)
        except (grpc.aio.AioRpcError, asyncio.CancelledError, ConnectionError) as e:
            log.info("stream of %s ended: %s", env_id, type(e).__name__)
        finally:
            pump.remove_done_callback(on_pump_done)
            self.core.agent_disconnected(env_id, link)
            link.close()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(pump, 2.0)

    def _note_refused(self, env_id: str, seq: int, refused: list[Refusal], *, log_it: bool) -> None:
        if log_it:
            log.warning(
                "environment %s: refused %d metric(s) of message #%d, first: %s",
                env_id, len(refused), seq, refused[0].text,
            )
        per_trial: dict[str, list[Refusal]] = {}
        for r in refused:
            per_trial.setdefault(r.trial_id, []).append(r)
        for trial_id, items in per_trial.items():
            lines = [r.text for r in items[:MAX_NOTES_PER_TRIAL]]
            if len(items) > MAX_NOTES_PER_TRIAL:
                lines.append(
                    f"refused {len(items) - MAX_NOTES_PER_TRIAL} more results from the agent in the same message"
                )
            try:
                for line in lines:
                    self.core.agent_note(env_id, trial_id, line)
            except OSError as e:
                log.warning("environment %s: cannot note a refused metric in trial %r's log: %s", env_id, trial_id, e)


def probe_coordinator(address: str, token: str, timeout: float) -> Literal["ours", "other", "unknown"]:
    """Whether the coordinator at ``address`` is the one ``token`` belongs to.

    Presents the token with a Register of a protocol no coordinator speaks: the token's
    coordinator refuses it as a version mismatch (and joins no environment), another one as
    a wrong token; anything else (no gRPC, TLS) is "unknown"."""
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.CoordinatorStub(channel).Session(
            iter([pb.AgentMessage(register=pb.Register(protocol_version=0, environment_id="probe"))]),
            metadata=[(TOKEN_METADATA_KEY, token)],
            timeout=timeout,
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "other"
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return "ours"
    return "unknown"


def _uncancel(task: asyncio.Task[object] | None) -> None:
    """Take back a cancel this module asked for and caught (Python 3.11+ counts them)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is not None:
        uncancel()


def _out_of_range(msg: Message) -> str:
    """The first uint64 field of ``msg`` (or of a message in it) that SQLite cannot hold.

    Runs on every heartbeat, so it visits only the fields that can hold such a value, as
    listed once per message type by :func:`_uint64_layout`."""
    ints, messages = _uint64_layout(msg.DESCRIPTOR)
    for name, repeated in ints:
        value = getattr(msg, name)
        if (max(value, default=0) if repeated else value) > MAX_SEQ:
            return name
    for name, repeated in messages:
        if repeated:
            for i, item in enumerate(getattr(msg, name)):
                inner = _out_of_range(item)
                if inner:
                    return f"{name}[{i}].{inner}"
        elif msg.HasField(name):
            inner = _out_of_range(getattr(msg, name))
            if inner:
                return f"{name}.{inner}"
    return ""


@functools.cache
def _uint64_layout(desc: Descriptor) -> tuple[tuple[tuple[str, bool], ...], tuple[tuple[str, bool], ...]]:
    """The uint64 fields of a message type, and its message fields that may contain some."""
    ints = tuple((f.name, f.is_repeated) for f in desc.fields if f.type == f.TYPE_UINT64)
    messages = tuple(
        (f.name, f.is_repeated)
        for f in desc.fields
        if f.type == f.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry and _may_hold_uint64(f.message_type)
    )
    return ints, messages


def _may_hold_uint64(desc: Descriptor, seen: frozenset[str] = frozenset()) -> bool:
    if desc.full_name in seen:
        return False
    seen = seen | {desc.full_name}
    return any(
        f.type == f.TYPE_UINT64 or (f.type == f.TYPE_MESSAGE and _may_hold_uint64(f.message_type, seen))
        for f in desc.fields
    )


def _valid_environment_id(env_id: str) -> bool:
    return (
        len(env_id) <= MAX_ENVIRONMENT_ID_CHARS
        and env_id.isprintable()
        and "/" not in env_id
        and "\\" not in env_id
        and env_id not in (".", "..")
    )


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
    try:
        if tls_key_cert is not None:
            port = server.add_secure_port(address, grpc.ssl_server_credentials([tls_key_cert]))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio's "Failed to bind to address"
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: the port is in use, or the host is not this machine's")
    await server.start()
    return server, port


async def listen(
    address: str, configured: str, servicer: Servicer, tls_key_cert: tuple[bytes, bytes] | None
) -> tuple[grpc.aio.Server, int, str]:
    """``create_server`` on ``address`` (a resumed experiment's port from before), or, where
    another process has taken it since and the config (``configured``) asks for no port in
    particular, on a new one; returns the address it listens on too."""
    try:
        return (*await create_server(address, servicer, tls_key_cert=tls_key_cert), address)
    except OSError as e:
        if address == configured or not configured.endswith(":0"):
            raise
        log.warning("%s; listening on a new port: agents from before cannot dial back and are replaced", e)
    return (*await create_server(configured, servicer, tls_key_cert=tls_key_cert), configured)
