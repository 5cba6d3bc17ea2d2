"""The base of every platform where one environment is one job (Slurm, OpenPAI, DLTS,
Azure ML, PAI-DLC, and plug-ins alike).

A platform says four things, each a small coroutine:

* :meth:`JobEnvironmentService.submit` a job that runs one agent, named so that
  :meth:`~JobEnvironmentService.list_jobs` finds it again from the experiment id alone;
* :meth:`~JobEnvironmentService.observe` some jobs: their phase and the platform's words;
* :meth:`~JobEnvironmentService.kill` a job;
* :meth:`~JobEnvironmentService.list_jobs` the jobs of an experiment that still wait or run.

Each may raise whatever its platform raises: the base runs every call under a deadline,
blanks every known secret from the message, and hands the coordinator data (a
``StartResult.error``, a ``failed`` observation, a log line), never an exception.

The base keeps the contract of :class:`~.base.EnvironmentService` once for all: one job
per env id (concurrent starts of one id share one submit and answer the same platform
id), polling the platform in the background at most every ``poll_interval`` so that the
coordinator's loop never waits on a slow API, stop with grace (the agent was asked over
its stream to exit; its job is killed only if it has not ended after ``grace_s``), a job
that ends without being asked reported ``failed`` with why, and ``sweep`` of an
experiment's leftovers from the platform alone.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

from ._record import EnvRecord
from .base import (
    EnvironmentRequest,
    EnvironmentService,
    Observation,
    PlatformConfig,
    StartResult,
    env_id_in_name,
)

log = logging.getLogger(__name__)

JobPhase = Literal["waiting", "running", "succeeded", "failed", "stopped", "gone"]
FINAL: frozenset[str] = frozenset({"succeeded", "failed", "stopped", "gone"})
JOB_PREFIX = "tk-"
_T = TypeVar("_T")


def job_name(experiment_id: str, env_id: str) -> str:
    """The platform job's name: how ``list_jobs`` finds an experiment's jobs by its id alone."""
    return f"{JOB_PREFIX}{experiment_id}-{env_id}"


def env_of(name: str, experiment_id: str) -> str | None:
    """The environment id in a job name of ``experiment_id``, or None for another's job."""
    return env_id_in_name(name, job_name(experiment_id, ""))


class JobError(Exception):
    """A platform call that failed; its message is shown (after secrets are blanked)."""


@dataclass(frozen=True)
class JobState:
    """What the platform says about one job: its phase and, in its own words, why."""

    phase: JobPhase
    detail: str = ""


@dataclass
class Job(EnvRecord):
    """One environment's job as the service knows it (``platform_id``: the platform's id
    for the job, what ``start`` returned)."""

    phase: JobPhase = "waiting"
    detail: str = ""
    observation: Observation | None = None  # set once the job has ended


class JobEnvironmentService(EnvironmentService[PlatformConfig]):
    """Start/poll/stop/sweep for a platform where one environment is one job; a subclass
    implements :meth:`submit`, :meth:`observe`, :meth:`kill` and :meth:`list_jobs`."""

    #: How messages name the platform's job ("OpenPAI job").
    kind: ClassVar[str] = "job"
    #: How long a killed job may take to be gone.
    STOP_WAIT_S: ClassVar[float] = 30.0
    #: How long a poll waits for the platform's answer before reporting what it saw last.
    POLL_WAIT_S: ClassVar[float] = 1.0
    #: How often a stop or sweep asks whether its jobs have ended.
    STOP_POLL_S: ClassVar[float] = 0.2
    #: Errors whose message says all (the others are shown with their type's name).
    PLAIN_ERRORS: ClassVar[tuple[type[Exception], ...]] = (JobError,)

    def __init__(self, *, poll_interval: float, secrets: Collection[str] = (), call_timeout: float = 60.0) -> None:
        # The coordinator polls twice a second; the platform is asked at most this often.
        self.poll_interval = poll_interval
        self.call_timeout = call_timeout
        self._secrets = {s for s in secrets if s}
        self._jobs: dict[str, Job] = {}
        self._starting: dict[str, asyncio.Future[StartResult]] = {}
        self._failed: dict[str, Observation] = {}  # env id -> why its last start failed
        self._refreshed_at = 0.0
        self._refreshing: asyncio.Future[None] | None = None

    # ---- what a platform provides ---------------------------------------------------

    @abc.abstractmethod
    async def submit(self, request: EnvironmentRequest, name: str) -> str:
        """Submit the job named ``name`` running one agent; return its platform id. The
        agent's command line is :func:`._launch.agent_argv`, its token in its environment
        (:func:`._launch.agent_environment`) or a 0600 file, never in argv."""

    @abc.abstractmethod
    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        """The state of each of ``jobs`` by env id; one the platform no longer has is
        ``"gone"``, one it could not tell about now is left out."""

    @abc.abstractmethod
    async def kill(self, job: Job) -> None:
        """Ask the platform to stop ``job``; returns once it accepted. A job the platform no
        longer has is no error."""

    @abc.abstractmethod
    async def list_jobs(self, experiment_id: str) -> dict[str, str]:
        """env id -> platform id of the jobs of ``experiment_id`` that still wait or run,
        found from the platform alone (names, labels), never from this service's memory."""

    def ended(self, job: Job) -> Observation:
        """What the coordinator is told about a job that ended without being asked to.
        Platforms that know more (an exit file, a log) say more."""
        what = f"{self.kind} {job.platform_id}"
        why = f": {job.detail}" if job.detail else ""
        if job.phase == "succeeded":
            return Observation("exited", "agent exited normally", job.platform_id)
        if job.phase == "stopped":
            return Observation("failed", f"{what} was stopped outside trialkeeper{why}", job.platform_id)
        if job.phase == "gone":
            return Observation("failed", f"{what} is gone from the platform (deleted outside trialkeeper)", job.platform_id)
        return Observation("failed", f"{what} failed{why}", job.platform_id)

    # ---- the contract ---------------------------------------------------------------

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id and env_id not in self._jobs:
            self._jobs[env_id] = Job(env_id, platform_id, adopted=True, phase="running")
            self._refreshed_at = 0.0

    async def start(self, request: EnvironmentRequest) -> StartResult:
        job = self._jobs.get(request.env_id)
        if job is not None:
            return StartResult(platform_id=job.platform_id)
        pending = self._starting.get(request.env_id)
        if pending is None:
            self._secrets.add(request.token)
            pending = self._starting[request.env_id] = asyncio.ensure_future(self._start(request))
            # A failed start may be tried again: only a submitted job is remembered.
            pending.add_done_callback(lambda _: self._starting.pop(request.env_id, None))
        return await asyncio.shield(pending)

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
        if env_id not in self._jobs and pending is not None:
            await asyncio.wait([pending], timeout=self.call_timeout)
        job = self._jobs.get(env_id)
        if job is None or job.observation is not None:
            return
        job.stop_requested = True
        # The coordinator has asked the agent to shut down over its stream: its job may
        # end on its own within the grace period; otherwise the platform stops it.
        if grace_s <= 0 or not await self._wait_final([job], grace_s):
            try:
                await self._call(self.kill(job))
            except JobError as e:
                log.warning("environment %s: could not stop %s %s: %s", env_id, self.kind, job.platform_id, e)
                return
            if not await self._wait_final([job], self.STOP_WAIT_S):
                log.warning("environment %s: %s %s did not end after being stopped", env_id, self.kind, job.platform_id)
                return
        job.observation = Observation("exited", "stopped", job.platform_id)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        try:
            found = await self._call(self.list_jobs(experiment_id))
        except JobError as e:
            log.warning("cannot list the %ss of experiment %s: %s", self.kind, experiment_id, e)
            return []
        removed: list[Job] = []
        for env_id, ref in sorted(found.items()):
            if env_id in keep:
                continue
            job = Job(env_id, ref, phase="running", stop_requested=True)
            if env_id in self._jobs:
                self._jobs[env_id].stop_requested = True
            try:
                await self._call(self.kill(job))
            except JobError as e:
                log.warning("could not stop %s %s of experiment %s: %s", self.kind, ref, experiment_id, e)
                continue
            removed.append(job)
        # Nothing is waited for beyond the platform's own stopping: an orphan's agent has
        # no coordinator to report to.
        if removed and not await self._wait_final(removed, self.STOP_WAIT_S):
            removed = [job for job in removed if job.phase in FINAL]
        for job in removed:
            log.info("environment %s of experiment %s: leftover %s %s stopped", job.env_id, experiment_id, self.kind, job.platform_id)
        return [job.env_id for job in removed]

    async def close(self) -> None:
        pending: list[asyncio.Future[object]] = [*self._starting.values()]  # type: ignore[list-item]
        if self._refreshing is not None:
            pending.append(self._refreshing)  # type: ignore[arg-type]
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def redact(self, text: str) -> str:
        """``text`` with every secret this service knows (tokens, keys) replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # ---- inside ---------------------------------------------------------------------

    async def _call(self, call: Awaitable[_T]) -> _T:
        """One platform call under the deadline; any failure becomes a JobError whose
        message holds no secret."""
        try:
            return await asyncio.wait_for(call, self.call_timeout)
        except asyncio.TimeoutError:
            raise JobError(f"no answer within {self.call_timeout:g} s") from None
        except Exception as e:  # noqa: BLE001 - whatever the platform raises becomes data
            shown = str(e) if isinstance(e, self.PLAIN_ERRORS) else f"{type(e).__name__}: {e}"
            raise JobError(self.redact(shown)) from None

    async def _start(self, request: EnvironmentRequest) -> StartResult:
        name = job_name(request.experiment_id, request.env_id)
        try:
            ref = await self._call(self.submit(request, name))
        except JobError as e:
            error = f"{self.kind} {name} could not be submitted: {e}"
            self._failed[request.env_id] = Observation("failed", error)
            return StartResult(error=error)
        self._failed.pop(request.env_id, None)
        self._jobs[request.env_id] = Job(request.env_id, ref)
        self._refreshed_at = 0.0
        log.info("environment %s: %s %s submitted", request.env_id, self.kind, ref)
        return StartResult(platform_id=ref)

    def _observation(self, env_id: str) -> Observation:
        job = self._jobs.get(env_id)
        if job is None:
            if env_id in self._starting:
                return Observation("starting", "being submitted")
            return self._failed.get(env_id, Observation("unknown"))
        if job.observation is not None:
            return job.observation
        if job.phase == "waiting":
            return Observation("starting", job.detail or f"{self.kind} {job.platform_id} is waiting", job.platform_id)
        return Observation("running", job.detail, job.platform_id)

    async def _refresh(self) -> None:
        live = [job for job in self._jobs.values() if job.observation is None]
        try:
            if live:
                await self._update(live)
        except JobError as e:  # the next poll asks again; what was seen last stands
            for job in live:
                job.detail = f"cannot ask the platform: {e}"
        finally:
            self._refreshed_at = time.monotonic()
        for job in live:
            if job.phase in FINAL and job.observation is None:
                # Stopped by this coordinator (stop, sweep): an exit, not a failure.
                job.observation = Observation("exited", "stopped", job.platform_id) if job.stop_requested else self.ended(job)
                log.info("environment %s: %s", job.env_id, job.observation.detail)

    async def _update(self, jobs: list[Job]) -> None:
        seen = await self._call(self.observe(jobs))
        for job in jobs:
            state = seen.get(job.env_id)
            if state is not None:
                job.phase, job.detail = state.phase, self.redact(state.detail)

    async def _wait_final(self, jobs: list[Job], timeout: float) -> bool:
        """Whether every job of ``jobs`` ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._update(jobs)
            except JobError as e:
                log.debug("waiting for %ss to end: %s", self.kind, e)
            if all(job.phase in FINAL for job in jobs):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.STOP_POLL_S)
