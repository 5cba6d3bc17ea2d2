"""A TCP proxy for tests: forwards to a target and cuts every connection on demand."""

from __future__ import annotations

import asyncio
import contextlib


class CuttingProxy:
    """Listens on 127.0.0.1; each client connection is forwarded to ``target`` (host,
    port), which may be set after the proxy started. :meth:`cut` aborts every open
    connection at once, as a network failure would."""

    def __init__(self) -> None:
        self.target: tuple[str, int] | None = None
        self.port = 0
        self.cuts = 0
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await asyncio.wait_for(self._server.wait_closed(), 10.0)

    def cut(self) -> int:
        """Abort every open connection; returns how many there were."""
        n = len(self._open)
        for w in list(self._open):
            w.transport.abort()
        self._open.clear()
        if n:
            self.cuts += 1
        return n

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.target is None:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 10.0)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()
            return
        self.connections += 1
        self._open.update((writer, up_writer))
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._open.discard(writer)
            with contextlib.suppress(OSError):
                writer.transport.abort()
