"""Environments that are one cloud job each, reached through a platform adapter.

Azure ML runs and PAI-DLC jobs behave alike: submit a job that runs one agent, read its
status, cancel it, list an experiment's jobs. Each platform's SDK stays in one adapter
module (``_aml_sdk``, ``_dlc_sdk``), imported only when that platform is used; this module
gives the job base (:mod:`._jobs`) its four platform calls through the adapter. Adapter
calls block (the SDKs are synchronous): each runs in a thread, under the base's deadline,
and every failure comes back as data.

Statuses stay in the platform's own words up to here (``"Canceled"``, ``"Stopped"``); the
service maps them to phases, so that a fake adapter answering in those words exercises
the mapping too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ._jobs import Job, JobEnvironmentService, JobError, JobPhase, JobState
from .base import EnvironmentRequest, Observation, PlatformConfig

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JobView:
    """What the platform says about one job, in its own words."""

    job_id: str
    status: str
    detail: str = ""
    experiment_id: str = ""
    env_id: str = ""


class JobAdapter(Protocol):
    """The platform boundary: the SDK adapter, or a fake with the same methods."""

    def connect(self) -> None:
        """Check that the platform can be used (credentials, workspace); raise if not."""

    def submit(self, spec: Any) -> str:
        """Submit one job; return its id on the platform."""

    def get(self, job_id: str) -> JobView | None:
        """The job's status; None when the platform does not know the id."""

    def cancel(self, job_id: str) -> None:
        """Ask the platform to stop the job."""

    def list_jobs(self, experiment_id: str) -> list[JobView]:
        """Every job this experiment submitted that the platform still lists."""

    def close(self) -> None:
        """Release connections."""


class CloudSetupError(ValueError):
    """The platform cannot be used as configured (SDK missing, workspace unreachable)."""


class CloudJobService(JobEnvironmentService[PlatformConfig]):
    """An environment per cloud job, through the adapter; subclasses name the platform,
    its status words (``PHASES``) and build the job spec (:meth:`job_spec`)."""

    #: The platform's status words and what each means; a word not here is "waiting".
    PHASES: ClassVar[Mapping[str, JobPhase]] = {}

    def __init__(self, adapter: JobAdapter, *, poll_interval: float = 5.0, secrets: Collection[str] = (),
                 call_timeout: float = CALL_TIMEOUT_S) -> None:
        super().__init__(poll_interval=poll_interval, secrets=secrets, call_timeout=call_timeout)
        self.adapter = adapter

    def job_spec(self, request: EnvironmentRequest) -> Any:
        """What ``adapter.submit`` takes for this environment."""
        raise NotImplementedError

    # ---- the four platform calls: the SDKs block, so each runs in a thread ------------

    async def submit(self, request: EnvironmentRequest, name: str) -> str:
        return await asyncio.to_thread(self.adapter.submit, self.job_spec(request))

    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        views = await asyncio.gather(*(asyncio.to_thread(self.adapter.get, job.platform_id) for job in jobs))
        return {job.env_id: self._state(job.platform_id, view) for job, view in zip(jobs, views)}

    async def kill(self, job: Job) -> None:
        await asyncio.to_thread(self.adapter.cancel, job.platform_id)

    async def list_jobs(self, experiment_id: str) -> dict[str, str]:
        found = await asyncio.to_thread(self.adapter.list_jobs, experiment_id)
        return {
            view.env_id: view.job_id
            for view in found
            if view.experiment_id == experiment_id
            and view.env_id
            and self._phase(view.status) in ("waiting", "running")
        }

    def ended(self, job: Job) -> Observation:
        if job.phase == "gone":
            return Observation("failed", f"{self.platform} no longer knows job {job.platform_id}", job.platform_id)
        if job.phase == "succeeded":
            return Observation("exited", job.detail, job.platform_id)
        if job.phase == "stopped":
            return Observation("failed", f"{job.detail} (canceled outside trialkeeper)", job.platform_id)
        return Observation("failed", job.detail, job.platform_id)

    # ---- the rest of the contract -------------------------------------------------------

    async def prepare(self) -> None:
        try:
            await self._call(asyncio.to_thread(self.adapter.connect))
        except JobError as e:
            raise CloudSetupError(f"platform {self.platform}: {e}") from None

    async def close(self) -> None:
        await super().close()
        try:
            await self._call(asyncio.to_thread(self.adapter.close))
        except JobError as e:
            log.warning("%s: closing the client failed: %s", self.platform, e)

    def _state(self, job_id: str, view: JobView | None) -> JobState:
        if view is None:
            return JobState("gone")
        phase = self._phase(view.status)
        detail = view.detail
        words = f"job {job_id} is {view.status}" + (f": {detail}" if detail else "")
        return JobState(phase, "" if phase == "running" else words)

    def _phase(self, status: str) -> JobPhase:
        # A status word this version does not know yet: the job is there, not ended.
        return self.PHASES.get(status, "waiting")
