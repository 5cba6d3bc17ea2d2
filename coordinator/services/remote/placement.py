"""Which machine of ``machineList`` takes the next environment, and when a machine that
failed is tried again.

Without reuse, an environment goes to the least loaded machine that works or is due for
another try, and fails at once when none is. In reuse mode an environment stands for a
machine: when the one it would take is failing, it waits for that machine (or for any
change among them) while the environments on the others go on; failing it again and again
would end the experiment.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from .._record import PlatformError
from .machine import Machine, MachineError

# After the n-th failure in a row, a machine is tried again after the n-th delay.
RETRY_DELAYS_S = (5.0, 10.0, 20.0, 40.0, 60.0)


class Placement:
    """The machines of one service and what is known about their failures."""

    def __init__(self, machines: Sequence[Machine], *, reuse: bool) -> None:
        self.machines = list(machines)
        self.reuse = reuse
        self._change: asyncio.Future[None] | None = None
        self._closed = False

    async def choose(self, load: Callable[[], dict[int, int]],
                     hold: Callable[[Machine, str], None]) -> Machine:
        """The machine for the next environment, given ``load`` (machine index -> its live
        environments, this one left out); ``hold`` is told the machine a waiting environment
        stands for and why it waits. Raises PlatformError when no machine can take it."""
        while True:
            m = self.pick(load())
            if m is None:
                errors = "; ".join(x.error for x in self.machines if x.error)
                raise PlatformError(f"no machine can take it: {errors}")
            hold(m, "")
            if not m.broken or self.may_retry(m):
                return m
            if all(x.broken for x in self.machines) or not self.reuse:
                raise PlatformError(m.error)
            hold(m, f"waiting for {m.label}: {m.error}")
            await self._wait_for_change(m)

    def pick(self, live: dict[int, int]) -> Machine | None:
        if self.reuse:
            free = [m for m in self.machines if m.index not in live]
            if not free:
                free = sorted(self.machines, key=lambda m: live.get(m.index, 0))
            # Working machines first; a broken one only when nothing else is free.
            free.sort(key=lambda m: (m.broken and not self.may_retry(m), live.get(m.index, 0)))
            return free[0]
        usable = [m for m in self.machines if not m.broken or self.may_retry(m)]
        if not usable:
            return None
        return min(usable, key=lambda m: (live.get(m.index, 0), m.index))

    def may_retry(self, m: Machine) -> bool:
        return not m.permanent and time.monotonic() >= m.retry_at

    def failed(self, m: Machine, e: MachineError) -> None:
        m.failures += 1
        m.error, m.permanent = str(e), e.permanent
        m.retry_at = time.monotonic() + RETRY_DELAYS_S[min(m.failures, len(RETRY_DELAYS_S)) - 1]
        self.notify()

    def works(self, m: Machine) -> None:
        """``m`` was set up: it is no longer failing."""
        if m.error:
            m.error, m.failures = "", 0
            self.notify()

    def notify(self) -> None:
        """Wake the starts that wait for a machine: something about the machines changed."""
        if self._change is not None and not self._change.done():
            self._change.set_result(None)
        self._change = None

    def close(self) -> None:
        self._closed = True
        self.notify()

    async def _wait_for_change(self, m: Machine) -> None:
        timeout = None if m.permanent else max(0.1, m.retry_at - time.monotonic())
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._change), timeout)
        if self._closed:
            raise asyncio.CancelledError
