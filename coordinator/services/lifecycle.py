"""One environment lifecycle under every service that builds on it.

Ray autoscaler v2's split: a platform is a small provider, the lifecycle here is the
instance manager. A platform says four things, each a small coroutine:

* :meth:`LifecycleService.launch` one environment running one agent, made findable on the
  platform from the experiment id alone (a name, a label, a marker);
* :meth:`~LifecycleService.observe` some environments: their phase and the platform's words;
* :meth:`~LifecycleService.kill` one (or :meth:`~LifecycleService.terminate` it, where the
  platform itself gives the agent its grace period);
* :meth:`~LifecycleService.list_alive` the environments of an experiment still there.

Each may raise whatever its platform raises: the base runs every call under a deadline,
blanks every known secret from the message, and hands the coordinator data (a
``StartResult.error``, a ``failed`` observation, a log line), never an exception.

The base keeps the contract of :class:`~.base.EnvironmentService` once for all: one record
per env id (concurrent starts of one id share one launch and answer the same platform id;
a failed start may be tried again), polling the platform in the background at most every
``poll_interval`` so that the coordinator's loop never waits on a slow platform for more
than ``POLL_WAIT_S``, stop with grace (the agent was asked over its stream to exit; it is
killed only if it has not ended after ``grace_s``), an environment that ends without
being asked reported ``failed`` with why, and ``sweep`` of an experiment's leftovers from
the platform alone.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Collection, Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

from ._record import FINAL, Phase, PlatformError, Record, State
from .base import EnvironmentRequest, EnvironmentService, Observation, PlatformConfig, StartResult

__all__ = ["FINAL", "LifecycleService", "Phase", "PlatformError", "Record", "State"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
R = TypeVar("R", bound=Record)


class LifecycleService(EnvironmentService[PlatformConfig], Generic[PlatformConfig, R]):
    """Start/poll/stop/sweep over a provider; a subclass implements :meth:`launch`,
    :meth:`observe`, :meth:`kill` (or :meth:`terminate`) and :meth:`list_alive`."""

    #: How messages name one environment on the platform ("OpenPAI job", "agent process").
    kind: ClassVar[str] = "job"
    #: The record type of the platform (a subclass of :class:`Record`).
    record_type: ClassVar[type[Record]] = Record
    #: How long a killed environment may take to be gone.
    STOP_WAIT_S: ClassVar[float] = 30.0
    #: How long a poll waits for the platform's answer before reporting what it saw last.
    POLL_WAIT_S: ClassVar[float] = 1.0
    #: How often a stop or sweep asks whether its environments have ended.
    STOP_POLL_S: ClassVar[float] = 0.2
    #: The grace period ``close`` stops the environments still running with; None: it
    #: leaves them be (the coordinator stops them before it closes the service).
    STOP_ON_CLOSE: ClassVar[float | None] = None
    #: Errors whose message says all (the others are shown with their type's name).
    PLAIN_ERRORS: ClassVar[tuple[type[Exception], ...]] = (PlatformError,)

    def __init__(self, *, poll_interval: float, secrets: Collection[str] = (),
                 call_timeout: float = 60.0) -> None:
        # The coordinator polls twice a second; the platform is asked at most this often.
        self.poll_interval = poll_interval
        self.call_timeout = call_timeout
        self._secrets = {s for s in secrets if s}
        self._records: dict[str, R] = {}
        self._starting: dict[str, asyncio.Future[StartResult]] = {}
        self._launching: dict[str, R] = {}  # env id -> its record while its launch is under way
        # env id -> how its last start ended, where it started nothing
        self._failed: dict[str, Observation] = {}
        self._refreshed_at = 0.0
        self._refreshing: asyncio.Future[None] | None = None

    # ---- what a platform provides ---------------------------------------------------

    @abc.abstractmethod
    async def launch(self, record: R, request: EnvironmentRequest) -> str:
        """Start one agent on the platform for ``record``; return the platform's id for it.
        The agent's token reaches it in its environment or a 0600 file, never its argv."""

    @abc.abstractmethod
    async def observe(self, records: Sequence[R]) -> dict[str, State]:
        """The state of each of ``records`` by env id; one the platform no longer has is
        ``"gone"``, one it could not tell about now is left out."""

    async def kill(self, record: R) -> None:
        """Ask the platform to end ``record`` now; returns once it accepted. One the
        platform no longer has is no error."""
        raise NotImplementedError(f"{type(self).__qualname__} defines neither kill nor terminate")

    async def terminate(self, record: R, grace_s: float) -> None:
        """End ``record``, its agent given ``grace_s`` to exit on its own first. By default
        the base waits, watching :meth:`observe`, then calls :meth:`kill`; a platform whose
        own stop takes a grace period overrides this."""
        if grace_s > 0 and await self._wait_final([record], grace_s):
            return
        await self._call(self.kill(record))

    @abc.abstractmethod
    async def list_alive(self, experiment_id: str) -> dict[str, str]:
        """env id -> platform id of the environments of ``experiment_id`` that still wait
        or run, found from the platform alone, never from this service's memory."""

    def launch_timeout(self, request: EnvironmentRequest) -> float | None:
        """How long :meth:`launch` may take; None: no limit (a launch that waits for
        capacity, each of its platform calls under a deadline of its own)."""
        return self.call_timeout

    def cancels_launch(self, record: R) -> bool:
        """Whether a stop may cancel ``record``'s launch now (it waits for capacity and has
        started nothing) rather than wait for it to finish."""
        return False

    def launch_error(self, request: EnvironmentRequest, error: PlatformError) -> str:
        """What a failed start answers."""
        return f"{self.kind} for {request.env_id} could not be started: {error}"

    def named(self, platform_id: str) -> str:
        """How messages name the environment ``platform_id`` is: its kind, then its id."""
        return f"{self.kind} {platform_id}"

    def ended(self, record: R) -> Observation:
        """What the coordinator is told about an environment that ended without being asked
        to. Platforms that know more (an exit file, a log) say more."""
        what = self.named(record.platform_id)
        why = f": {record.detail}" if record.detail else ""
        pid = record.platform_id
        if record.phase == "succeeded":
            return Observation("exited", "agent exited normally", pid)
        if record.phase == "stopped":
            return Observation("failed", f"{what} was stopped outside trialkeeper{why}", pid)
        if record.phase == "gone":
            return Observation(
                "failed", f"{what} is gone from the platform (deleted outside trialkeeper)", pid
            )
        return Observation("failed", f"{what} failed{why}", pid)

    # ---- the contract ---------------------------------------------------------------

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id and env_id not in self._records:
            self._records[env_id] = self._record(env_id, platform_id, adopted=True, phase="running")
            self._refreshed_at = 0.0

    async def start(self, request: EnvironmentRequest) -> StartResult:
        record = self._records.get(request.env_id)
        if record is not None:
            return StartResult(platform_id=record.platform_id)
        pending = self._starting.get(request.env_id)
        if pending is None:
            self._secrets.add(request.token)
            pending = self._starting[request.env_id] = asyncio.ensure_future(self._start(request))
            # A failed start may be tried again: only a launched environment is remembered.
            pending.add_done_callback(lambda _: self._starting.pop(request.env_id, None))
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            if pending.cancelled():  # by a stop, or by close
                return StartResult(error="the start was canceled")
            raise

    async def start_as_one(self, requests: Sequence[EnvironmentRequest]) -> list[StartResult]:
        """Start a group as one object: the first member's launch makes it (its request names
        every member, ``group_members``); the others share its platform id. Each answered alike."""
        first = await self.start(dataclasses.replace(requests[0], group_members=tuple(r.env_id for r in requests)))
        for r in requests[1:] if not first.error else ():
            self._records.setdefault(r.env_id, self._record(r.env_id, first.platform_id, experiment_id=r.experiment_id))
        return [first] * len(requests)

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        # The platform is asked in the background, waited for at most POLL_WAIT_S: a slow
        # API never holds up the coordinator's loop, which sees its answer on a later poll.
        idle = self._refreshing is None or self._refreshing.done()
        if idle and time.monotonic() - self._refreshed_at >= self.poll_interval:
            self._refreshing = asyncio.ensure_future(self._refresh())
            await asyncio.wait([self._refreshing], timeout=self.POLL_WAIT_S)
        return {env_id: self._observation(env_id) for env_id in env_ids}

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        pending = self._starting.get(env_id)
        if env_id not in self._records and pending is not None:
            launching = self._launching.get(env_id)
            if launching is not None and self.cancels_launch(launching):
                pending.cancel()
                self._failed[env_id] = Observation("exited", "stopped before it was started")
                return
            await asyncio.wait([pending], timeout=self.call_timeout)
        record = self._records.get(env_id)
        if record is None or record.observation is not None:
            return
        record.stop_requested = True
        # The coordinator has asked the agent to shut down over its stream: it may end on
        # its own within the grace period; otherwise the platform stops it.
        try:
            await self.terminate(record, grace_s)
        except PlatformError as e:
            log.warning("environment %s: could not stop %s: %s", env_id, self.named(record.platform_id), e)
            return
        if record.phase not in FINAL and not await self._wait_final([record], self.STOP_WAIT_S):
            log.warning("environment %s: %s did not end after being stopped", env_id, self.named(record.platform_id))
            return
        record.observation = Observation("exited", "stopped", record.platform_id)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        try:
            found = await self._call(self.list_alive(experiment_id))
        except PlatformError as e:
            log.warning("cannot list the %ss of experiment %s: %s", self.kind, experiment_id, e)
            return []
        removed: list[R] = []
        for env_id, ref in sorted(found.items()):
            if env_id in keep:
                continue
            record = self._record(env_id, ref, phase="running", stop_requested=True,
                                  experiment_id=experiment_id)
            if env_id in self._records:
                self._records[env_id].stop_requested = True
            try:
                # Nothing is waited for beyond the platform's own stopping: an orphan's
                # agent has no coordinator to report to.
                await self.terminate(record, 0.0)
            except PlatformError as e:
                log.warning("could not stop %s of experiment %s: %s", self.named(ref), experiment_id, e)
                continue
            removed.append(record)
        if removed and not await self._wait_final(removed, self.STOP_WAIT_S):
            removed = [record for record in removed if record.phase in FINAL]
        for record in removed:
            log.info("environment %s of experiment %s: leftover %s stopped",
                     record.env_id, experiment_id, self.named(record.platform_id))
        return [record.env_id for record in removed]

    async def close(self) -> None:
        if self.STOP_ON_CLOSE is not None:
            live = [env_id for env_id, record in self._records.items() if record.observation is None]
            await asyncio.gather(*(self.stop(env_id, self.STOP_ON_CLOSE) for env_id in live),
                                 return_exceptions=True)
        pending: list[asyncio.Future[Any]] = [*self._starting.values()]
        if self._refreshing is not None:
            pending.append(self._refreshing)
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def redact(self, text: str) -> str:
        """``text`` with every secret this service knows (tokens, keys) replaced by ``***``."""
        for secret in self._secrets:
            # One or two characters would garble every message; no token or key is that short.
            if len(secret) > 2:
                text = text.replace(secret, "***")
        return text

    # ---- inside ---------------------------------------------------------------------

    def _record(self, env_id: str, platform_id: str = "", **fields: Any) -> R:
        return cast(R, self.record_type(env_id, platform_id, **fields))

    async def _call(self, call: Awaitable[_T], timeout: float | None = None, *,
                    bounded: bool = True) -> _T:
        """One platform call under the deadline (``call_timeout`` unless given; none if not
        ``bounded``); any failure becomes a PlatformError whose message holds no secret."""
        limit = self.call_timeout if timeout is None else timeout
        try:
            return await (asyncio.wait_for(call, limit) if bounded else call)
        except asyncio.TimeoutError:
            raise PlatformError(f"no answer within {limit:g} s") from None
        except Exception as e:  # noqa: BLE001 - whatever the platform raises becomes data
            shown = str(e) if isinstance(e, self.PLAIN_ERRORS) else f"{type(e).__name__}: {e}"
            raise PlatformError(self.redact(shown)) from None

    async def _start(self, request: EnvironmentRequest) -> StartResult:
        record = self._launching[request.env_id] = self._record(
            request.env_id, experiment_id=request.experiment_id)
        limit = self.launch_timeout(request)
        try:
            ref = await self._call(self.launch(record, request), limit, bounded=limit is not None)
        except PlatformError as e:
            error = self.launch_error(request, e)
            self._failed[request.env_id] = Observation("failed", error)
            return StartResult(error=error)
        finally:
            self._launching.pop(request.env_id, None)
        self._failed.pop(request.env_id, None)
        record.platform_id = ref
        self._records[request.env_id] = record
        self._refreshed_at = 0.0
        log.info("environment %s: %s started", request.env_id, self.named(ref))
        return StartResult(platform_id=ref)

    def _observation(self, env_id: str) -> Observation:
        record = self._records.get(env_id)
        if record is None:
            if env_id in self._starting:
                launching = self._launching.get(env_id)
                return Observation("starting", launching and launching.detail or "being submitted")
            return self._failed.get(env_id, Observation("unknown"))
        if record.observation is not None:
            return record.observation
        pid = record.platform_id
        if record.phase == "waiting":
            return Observation("starting", record.detail or f"{self.named(pid)} is waiting", pid)
        return Observation("running", record.detail, pid)

    async def _refresh(self) -> None:
        live = [record for record in self._records.values() if record.observation is None]
        try:
            if live:
                await self._update(live)
        except PlatformError as e:  # the next poll asks again; what was seen last stands
            for record in live:
                record.detail = f"cannot ask the platform: {e}"
        finally:
            self._refreshed_at = time.monotonic()
        for record in live:
            if record.phase in FINAL and record.observation is None:
                # Stopped by this coordinator (stop, sweep): an exit, not a failure.
                record.observation = (
                    Observation("exited", "stopped", record.platform_id)
                    if record.stop_requested else self.ended(record)
                )
                log.info("environment %s: %s", record.env_id, record.observation.detail)

    async def _update(self, records: list[R]) -> None:
        seen = await self._call(self.observe(records))
        for record in records:
            state = seen.get(record.env_id)
            if state is not None:
                record.phase, record.detail = state.phase, self.redact(state.detail)

    async def _wait_final(self, records: list[R], timeout: float) -> bool:
        """Whether every one of ``records`` ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._update(records)
            except PlatformError as e:
                log.debug("waiting for %ss to end: %s", self.kind, e)
            if all(record.phase in FINAL for record in records):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.STOP_POLL_S)
