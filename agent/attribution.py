"""Which trial a process belongs to: NVML lists processes on a GPU by pid, the agent reports
them by trial."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable

import psutil

# How long a pid stays attributed to its trial after it was last seen alive.
ATTRIBUTION_MEMORY_S = 300.0


def owner(pid: int, roots: dict[int, str]) -> str:
    """The trial whose root (``roots``: root pid -> trial id) leads ``pid``'s process group or
    is one of its ancestors; "" if none."""
    with contextlib.suppress(OSError):
        tid = roots.get(os.getpgid(pid))
        if tid:
            return tid
    with contextlib.suppress(psutil.Error):
        for parent in psutil.Process(pid).parents():
            tid = roots.get(parent.pid)
            if tid:
                return tid
    return ""


class Attribution:
    """Attributions remembered for a while, so that a process NVML still lists a moment after
    it exited keeps counting as its trial's. Safe to use from a worker thread."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (trial id, last seen)

    def attribute(self, pids: Iterable[int], roots: dict[int, str]) -> dict[int, str]:
        now = time.monotonic()
        found: dict[int, str] = {}
        for pid in pids:
            tid = roots.get(pid) or owner(pid, roots)
            if tid:
                self._seen[pid] = (tid, now)
            elif pid in self._seen:
                tid = self._seen[pid][0]
            if tid:
                found[pid] = tid
        for pid, (_, seen) in list(self._seen.items()):
            if now - seen > ATTRIBUTION_MEMORY_S:
                del self._seen[pid]
        return found
