"""What an embedding program hears of a live experiment: callbacks for stored metrics,
status changes and saved checkpoints, and an iterator of metric and status events.

The Coordinator (``core.py``) is a Listening: what is registered before it starts is handed
to its shell when the shell exists (``_listen``); the engine publishes metrics and
checkpoints only while someone listens, since each costs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..engine.events import CheckpointSaved
from ..engine.model import MetricEvent, StatusEvent

__all__ = ["CheckpointSaved", "Listening"]


class Listening:
    """The listening half of the Coordinator's API."""

    _engine: Any  # the Engine once started, else None

    def __init__(self) -> None:
        # Registered before start() too: handed to the shell when it exists.
        self._metric_callbacks: list[Callable[[MetricEvent], Any]] = []
        self._status_callbacks: list[Callable[[StatusEvent], Any]] = []
        self._checkpoint_callbacks: list[Callable[[CheckpointSaved], Any]] = []
        self._subscribers: set[asyncio.Queue[MetricEvent | StatusEvent | None]] = set()

    def _listen(self, engine: Any, shell: Any) -> None:
        """The engine and the shell exist: they publish to what is registered."""
        shell.metric_callbacks, shell.status_callbacks, shell.subscribers = (
            self._metric_callbacks, self._status_callbacks, self._subscribers
        )
        shell.checkpoint_callbacks = self._checkpoint_callbacks
        engine.publish_metrics = bool(self._metric_callbacks or self._subscribers)
        engine.publish_checkpoints = bool(self._checkpoint_callbacks)

    def on_metric(self, callback: Callable[[MetricEvent], Any]) -> None:
        """Call ``callback(event)`` for every stored metric (async callbacks are scheduled)."""
        self._metric_callbacks.append(callback)
        if self._engine is not None:
            self._engine.publish_metrics = True

    def on_status(self, callback: Callable[[StatusEvent], Any]) -> None:
        """Call ``callback(event)`` for every trial status change."""
        self._status_callbacks.append(callback)

    def on_checkpoint(self, callback: Callable[[CheckpointSaved], Any]) -> None:
        """Call ``callback(event)`` for every checkpoint a trial saves, once it is recorded
        (async callbacks are scheduled)."""
        self._checkpoint_callbacks.append(callback)
        if self._engine is not None:
            self._engine.publish_checkpoints = True

    async def events(self) -> AsyncIterator[MetricEvent | StatusEvent]:
        """Iterate over metric and status events from now on, until the coordinator stops."""
        q: asyncio.Queue[MetricEvent | StatusEvent | None] = asyncio.Queue()
        self._subscribers.add(q)
        if self._engine is not None:
            self._engine.publish_metrics = True
        try:
            while (event := await q.get()) is not None:  # None: it stopped
                yield event
        finally:
            self._subscribers.discard(q)
