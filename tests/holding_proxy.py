"""A TCP proxy between agents and a coordinator that can hold what goes through it.

Tests use it to stop a checkpoint's journey at a chosen point and keep it there while they
kill something:

- :meth:`HoldingProxy.hold_up_after` lets ``n`` more bytes go from the agents to the
  coordinator, then holds the rest (an upload stops part way, whatever the machine's speed);
  :meth:`hold_up` holds from now on.
- :meth:`HoldingProxy.hold_down_messages` holds the coordinator's gRPC messages to the agents
  (its acks among them) but lets HTTP/2's flow control through (WINDOW_UPDATE, SETTINGS and
  PING frames), so that the agents go on sending: a message goes up and is recorded, its ack
  never comes down.

:meth:`release` sends what was held and stops holding; :meth:`cut` aborts every connection,
dropping what was held, as a network failure would. Connections opened after a cut are not
held until asked again.

:meth:`HoldingProxy.hold_new_connections` keeps the connections opened from then on waiting,
unanswered, until :meth:`connect_held` names where they go: an agent dials while its
coordinator restarts and reaches the new one, whatever the restart takes.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

# HTTP/2 frame types that keep a connection's flow control and liveness going.
_PASSED_FRAMES = {4, 6, 8}  # SETTINGS, PING, WINDOW_UPDATE
_FRAME_HEADER = 9


@dataclass
class _Link:
    to_coordinator: asyncio.StreamWriter
    to_agent: asyncio.StreamWriter
    held_up: list[bytes] = field(default_factory=list)
    held_down: list[bytes] = field(default_factory=list)
    down_buffer: bytearray = field(default_factory=bytearray)


class HoldingProxy:
    """Listens on 127.0.0.1; forwards each connection to ``target`` (host, port), which may
    be set after the proxy started."""

    def __init__(self) -> None:
        self.target: tuple[str, int] | None = None
        self.port = 0
        self.connections = 0
        self.up_bytes = 0  # forwarded to the coordinator, over all connections
        self._up_limit: int | None = None  # hold what goes up past this many forwarded bytes
        self._down_held = False
        self.holding_up = asyncio.Event()  # set once something went unforwarded upstream
        self._connecting = asyncio.Event()  # cleared: new connections wait for it
        self._connecting.set()
        self._server: asyncio.base_events.Server | None = None
        self._links: list[_Link] = []

    async def start(self) -> HoldingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._connecting.set()  # connections still waiting go (or are aborted, without a target)
        self.cut()
        if self._server is not None:
            self._server.close()
            await asyncio.wait_for(self._server.wait_closed(), 10.0)

    # ---- what the tests ask -------------------------------------------------------------------

    def hold_up_after(self, n: int) -> None:
        """Forward ``n`` more bytes towards the coordinator, then hold the rest."""
        self._up_limit = self.up_bytes + n

    def hold_up(self) -> None:
        self.hold_up_after(0)

    def hold_down_messages(self) -> None:
        self._down_held = True

    def hold_new_connections(self) -> None:
        """Connections opened from now on wait, unanswered, until :meth:`connect_held`."""
        self._connecting.clear()

    def connect_held(self, target: tuple[str, int]) -> None:
        """Forward the waiting connections, and those to come, to ``target``."""
        self.target = target
        self._connecting.set()

    @property
    def held_up_bytes(self) -> int:
        return sum(len(b) for link in self._links for b in link.held_up)

    def release(self) -> None:
        """Send what was held, in order, and hold nothing more."""
        self._up_limit = None
        self._down_held = False
        self.holding_up.clear()
        for link in self._links:
            for data in link.held_up:
                self._write(link.to_coordinator, data)
            for frame in link.held_down:
                self._write(link.to_agent, frame)
            link.held_up.clear()
            link.held_down.clear()

    def cut(self) -> int:
        """Abort every open connection (what was held is dropped); returns how many."""
        links, self._links = self._links, []
        for link in links:
            link.to_coordinator.transport.abort()
            link.to_agent.transport.abort()
        self._up_limit = None
        self._down_held = False
        self.holding_up.clear()
        return len(links)

    # ---- forwarding ---------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._connecting.wait()
        if self.target is None:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 10.0)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()
            return
        self.connections += 1
        link = _Link(to_coordinator=up_writer, to_agent=writer)
        self._links.append(link)
        try:
            await asyncio.gather(self._pump_up(reader, link), self._pump_down(up_reader, link))
        finally:
            with contextlib.suppress(ValueError):
                self._links.remove(link)
            for w in (writer, up_writer):
                w.transport.abort()

    async def _pump_up(self, reader: asyncio.StreamReader, link: _Link) -> None:
        try:
            while data := await reader.read(65536):
                if link.held_up or (self._up_limit is not None and self.up_bytes + len(data) > self._up_limit):
                    room = 0 if link.held_up or self._up_limit is None else max(0, self._up_limit - self.up_bytes)
                    if room:
                        self._forward_up(link, data[:room])
                    link.held_up.append(data[room:])
                    self.holding_up.set()
                    continue
                self._forward_up(link, data)
                await link.to_coordinator.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.to_coordinator.transport.abort()

    def _forward_up(self, link: _Link, data: bytes) -> None:
        self.up_bytes += len(data)
        self._write(link.to_coordinator, data)

    async def _pump_down(self, reader: asyncio.StreamReader, link: _Link) -> None:
        # The server side of an HTTP/2 connection sends frames from its first byte on.
        try:
            while data := await reader.read(65536):
                link.down_buffer += data
                while len(link.down_buffer) >= _FRAME_HEADER:
                    length = int.from_bytes(link.down_buffer[:3], "big")
                    if len(link.down_buffer) < _FRAME_HEADER + length:
                        break
                    frame = bytes(link.down_buffer[: _FRAME_HEADER + length])
                    del link.down_buffer[: _FRAME_HEADER + length]
                    if self._down_held and frame[3] not in _PASSED_FRAMES:
                        link.held_down.append(frame)
                        continue
                    self._write(link.to_agent, frame)
                await link.to_agent.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.to_agent.transport.abort()

    @staticmethod
    def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
        if not writer.transport.is_closing():
            writer.write(data)
