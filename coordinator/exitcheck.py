"""After an agent's stream ends, ask its platform again soon while it still says the agent runs.

A killed agent's stream ends as the kernel closes its sockets, which is before its process
can be seen to have exited: the local platform learns of the exit only when asyncio's child
watcher has reaped the process, a moment later. The poll the stream's end asks for at once
may so find the agent still running, and without another look the loss would wait for the
monitor's next tick (half a second). So the platform is asked again a few milliseconds
later, then at doubling intervals, until it says the agent ended, the agent reconnects, or
the regular ticks take over. Pure: the shell carries it out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .engine.events import Observation

#: The first look again after a stream's end found its agent running.
FIRST_RECHECK_S = 0.002


@dataclass
class _Pending:
    due_at: float
    delay: float
    until: float


class ExitCheck:
    """Which environments to poll again soon, and when."""

    def __init__(self, horizon_s: float) -> None:
        # Past it, the monitor's ticks poll often enough.
        self.horizon_s = horizon_s
        self._pending: dict[str, _Pending] = {}

    def stream_ended(self, env_id: str, now: float) -> None:
        """An agent's stream ended: the poll that follows may be too early to see its exit."""
        self._pending[env_id] = _Pending(now, FIRST_RECHECK_S, now + self.horizon_s)

    def polled(
        self, seen: Mapping[str, Observation], now: float, connected: Callable[[str], bool]
    ) -> None:
        """The platform answered: look again later at those it still says run."""
        for env_id, p in list(self._pending.items()):
            obs = seen.get(env_id)
            if obs is None or obs.state != "running" or connected(env_id) or now >= p.until:
                del self._pending[env_id]
            elif p.due_at <= now:
                p.due_at = now + p.delay
                p.delay *= 2

    def due_in(self, now: float) -> float | None:
        """Seconds until the next look again (0 when one is due), None when none is."""
        if not self._pending:
            return None
        return max(0.0, min(p.due_at for p in self._pending.values()) - now)
