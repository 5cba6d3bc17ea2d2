"""Answers kept until the experiment changes: what a dashboard reads over every trial (its
comparison) is built once for each state of the store, not once a request.

Whether the trials changed is asked of the store's change counter (:meth:`ReadModel.changes`:
one lookup), which moves whenever a trial is submitted, changes status or anything else of its
row, or a result is stored, in the same transaction; a GPU sample, an event or a heartbeat
leaves it, and the answer holds. Two changes that leave every count as it was (one trial ending
as another starts) move it too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .model import ReadModel

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    state: Hashable  # the store's changes() when the answer was computed
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
        # Read before computing: a change made while it computes is seen the next time.
        state = model.changes()
        with self._lock:
            entry = self._entries.get(where)
            if entry is not None and entry.state == state:
                self._entries.move_to_end(where)
                return entry.answer
        answer = compute()
        with self._lock:
            self._entries[where] = _Entry(state, answer)
            self._entries.move_to_end(where)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return answer
