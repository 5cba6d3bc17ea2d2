"""The base of every platform where one environment is one job (Slurm, OpenPAI, DLTS,
Azure ML, PAI-DLC, and plug-ins alike).

A platform says four things, each a small coroutine:

* :meth:`JobEnvironmentService.submit` a job that runs one agent, named so that
  :meth:`~JobEnvironmentService.list_jobs` finds it again from the experiment id alone;
* :meth:`~JobEnvironmentService.observe` some jobs: their phase and the platform's words;
* :meth:`~JobEnvironmentService.kill` a job;
* :meth:`~JobEnvironmentService.list_jobs` the jobs of an experiment that still wait or run.

Everything else (one job per env id, polling under a deadline, stop with grace, sweep,
errors as data with every secret blanked) is the lifecycle every service shares,
:class:`~.lifecycle.LifecycleService`; a job is its record, :class:`Job`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from .base import EnvironmentRequest, PlatformConfig, env_id_in_name
from .lifecycle import FINAL, LifecycleService, PlatformError, Record, State
from .lifecycle import Phase as JobPhase

__all__ = [
    "FINAL", "JOB_PREFIX", "Job", "JobEnvironmentService", "JobError", "JobPhase", "JobState",
    "env_of", "job_name",
]

JOB_PREFIX = "tk-"

#: A platform call that failed; its message is shown (after secrets are blanked).
JobError = PlatformError
#: What the platform says about one job: its phase and, in its own words, why.
JobState = State
#: One environment's job as the service knows it (``platform_id``: the platform's id for
#: the job, what ``start`` returned).
Job = Record


def job_name(experiment_id: str, env_id: str) -> str:
    """The platform job's name: how ``list_jobs`` finds an experiment's jobs by its id alone."""
    return f"{JOB_PREFIX}{experiment_id}-{env_id}"


def env_of(name: str, experiment_id: str) -> str | None:
    """The environment id in a job name of ``experiment_id``, or None for another's job."""
    return env_id_in_name(name, job_name(experiment_id, ""))


class JobEnvironmentService(LifecycleService[PlatformConfig, Job]):
    """Start/poll/stop/sweep for a platform where one environment is one job; a subclass
    implements :meth:`submit`, :meth:`observe`, :meth:`kill` and :meth:`list_jobs`."""

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

    async def launch(self, record: Job, request: EnvironmentRequest) -> str:
        return await self.submit(request, job_name(request.experiment_id, request.env_id))

    async def list_alive(self, experiment_id: str) -> dict[str, str]:
        return await self.list_jobs(experiment_id)

    def launch_error(self, request: EnvironmentRequest, error: JobError) -> str:
        name = job_name(request.experiment_id, request.env_id)
        return f"{self.kind} {name} could not be submitted: {error}"
