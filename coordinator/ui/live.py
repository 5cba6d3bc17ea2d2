"""The dashboard's live updates: one look at the store a second, shared by every open stream.

A reader of the store has nothing to wait on, so changes are found by polling. Polled once per
server rather than once per open page, ten open tabs over 100,000 trials cost what one does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)
Marker = dict[str, Any]


class LiveChanges:
    """The latest change marker and a version that grows when it changes; polled by one task
    while at least one stream follows it."""

    def __init__(self, look: Callable[[], Awaitable[Marker]], interval_s: float) -> None:
        self._look = look
        self._interval_s = interval_s
        self._changed = asyncio.Condition()
        self._marker: Marker | None = None
        self._version = 0
        self._followers = 0
        self._poller: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while self._followers > 0:
            try:
                marker = await self._look()
            except Exception as e:  # told to the pages, and tried again at the next look
                log.exception("reading the experiment's changes failed")
                marker = {"error": f"reading the experiment's changes failed: {e}"}
            if marker != self._marker:
                async with self._changed:
                    self._marker = marker
                    self._version += 1
                    self._changed.notify_all()
            await asyncio.sleep(self._interval_s)

    @property
    def polling(self) -> bool:
        return self._poller is not None and not self._poller.done()

    @contextlib.asynccontextmanager
    async def follow(self) -> AsyncIterator[Callable[[float], Awaitable[Marker | None]]]:
        """While the block runs, ``await next_change(timeout)`` gives each new marker (the
        current one first), or None when ``timeout`` passed without a change."""
        self._followers += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        seen = 0

        async def next_change(timeout: float) -> Marker | None:
            nonlocal seen
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self._version != seen), timeout)
                except asyncio.TimeoutError:
                    return None
                seen = self._version
                return self._marker

        try:
            yield next_change
        finally:
            self._followers -= 1

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
