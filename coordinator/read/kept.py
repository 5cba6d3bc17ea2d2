"""Answers kept until the experiment changes: what a dashboard reads over every trial (its
comparison) is built once for each state of the store, not once a request.

Whether the store changed is asked of SQLite first (``PRAGMA data_version``, which moves
when another connection commits: a lookup, not a read of the trials); when it moved, of the
trials' counts by status and the count of metrics, which change when a trial is submitted,
changes status or reports (a GPU sample or a heartbeat changes neither, and keeps the answer).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .model import ReadModel

T = TypeVar("T")


def trials_state(model: ReadModel) -> tuple[Any, ...]:
    """What changes whenever a trial is submitted, changes status or reports a result."""
    return tuple(sorted(model.trial_counts().items())), model._read("metrics", model.store.metric_count)


@dataclass
class _Entry(Generic[T]):
    store: object  # the connection whose data_version ``version`` is (each has its own)
    version: int
    state: tuple[Any, ...]
    answer: T


class Kept(Generic[T]):
    """Up to ``size`` answers, each kept for one store (by its experiment directory) and key
    until the store's trials change. Safe to use from several threads."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, Hashable], _Entry[T]] = OrderedDict()

    def get(self, model: ReadModel, key: Hashable, compute: Callable[[], T]) -> T:
        """The answer kept for ``key`` while the store is as it was; else ``compute()``, kept."""
        where = (str(model.experiment_dir), key)
        # Both read before computing: a change made while it computes is seen the next time.
        version = model._read("store", model.store.data_version)
        with self._lock:
            entry = self._entries.get(where)
            if entry is not None:
                self._entries.move_to_end(where)
        if entry is not None and entry.store is model.store and entry.version == version:
            return entry.answer
        state = trials_state(model)
        if entry is not None and entry.state == state:
            entry.store, entry.version = model.store, version  # something else changed: the answer holds
            return entry.answer
        answer = compute()
        with self._lock:
            self._entries[where] = _Entry(model.store, version, state, answer)
            self._entries.move_to_end(where)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return answer
