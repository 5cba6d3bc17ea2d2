"""Environments that are one cloud job each, reached through a platform adapter.

Azure ML runs and PAI-DLC jobs behave alike: submit a job that runs one agent, read its
status, cancel it, list an experiment's jobs. Each platform's SDK stays in one adapter
module (``_aml_sdk``, ``_dlc_sdk``), imported only when that platform is used; this module
holds what the services share. Adapter calls block (the SDKs are synchronous): each runs
in a thread with a deadline, and every failure comes back as data.

Statuses stay in the platform's own words up to here (``"Canceled"``, ``"Stopped"``); the
service maps them to phases, so that a fake adapter answering in those words exercises
the mapping too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from .base import EnvironmentRequest, EnvironmentService, Observation, PlatformConfig, StartResult

log = logging.getLogger(__name__)

Phase = Literal["queued", "running", "succeeded", "failed", "canceled"]
EXPERIMENT_ENV = "TRIALKEEPER_EXPERIMENT_ID"
ENVIRONMENT_ENV = "TRIALKEEPER_ENVIRONMENT_ID"
TOKEN_ENV = "TRIALKEEPER_TOKEN"
CALL_TIMEOUT_S = 60.0
STOP_POLL_S = 0.2
_T = TypeVar("_T")


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


class _CallFailed(Exception):
    pass


def scrub(text: str, secrets: Collection[str]) -> str:
    """``text`` with every secret replaced: SDK messages may echo what they were given."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


@dataclass
class _Job:
    env_id: str
    job_id: str = ""
    started: asyncio.Future[StartResult] | None = None
    stop_requested: bool = False
    last: Observation | None = None
    asked_at: float = -1e18  # when the platform was last asked (monotonic)


class JobEnvironmentService(EnvironmentService[PlatformConfig]):
    """An environment per job; subclasses name the platform and build the job spec."""

    #: The platform's status words and what each means.
    PHASES: ClassVar[Mapping[str, Phase]] = {}

    def __init__(self, adapter: JobAdapter, *, poll_interval: float = 5.0, secrets: Collection[str] = (),
                 call_timeout: float = CALL_TIMEOUT_S) -> None:
        self.adapter = adapter
        # The coordinator polls twice a second; cloud APIs are asked at most this often per job.
        self.poll_interval = poll_interval
        self.call_timeout = call_timeout
        self._secrets = {s for s in secrets if s}
        self._jobs: dict[str, _Job] = {}

    def job_spec(self, request: EnvironmentRequest) -> Any:
        """What ``adapter.submit`` takes for this environment."""
        raise NotImplementedError

    # ---- the contract -------------------------------------------------------------------

    async def prepare(self) -> None:
        try:
            await self._call(self.adapter.connect)
        except _CallFailed as e:
            raise CloudSetupError(f"platform {self.platform}: {e}") from None

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id and env_id not in self._jobs:
            self._jobs[env_id] = _Job(env_id, job_id=platform_id)

    async def start(self, request: EnvironmentRequest) -> StartResult:
        job = self._jobs.setdefault(request.env_id, _Job(request.env_id))
        if job.started is None and job.job_id:
            return StartResult(platform_id=job.job_id)  # adopted: an earlier coordinator started it
        if job.started is None:
            self._secrets.add(request.token)
            job.started = asyncio.ensure_future(self._submit(job, request))
        return await asyncio.shield(job.started)

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        seen = await asyncio.gather(*(self._observe(env_id) for env_id in env_ids))
        return dict(zip(env_ids, seen))

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        job = self._jobs.get(env_id)
        if job is None:
            return
        job.stop_requested = True
        job.asked_at = -1e18  # what poll says next must reflect the stop
        if job.started is not None and not job.started.done():
            await asyncio.wait([job.started], timeout=self.call_timeout)
        if not job.job_id:
            return
        try:
            # The agent was asked to exit over its stream: give it the grace period first.
            if await self._active_after(job.job_id, grace_s):
                await self._call(self.adapter.cancel, job.job_id)
                log.info("environment %s: %s job %s canceled", env_id, self.platform, job.job_id)
        except _CallFailed as e:
            log.warning("environment %s: could not cancel %s job %s: %s", env_id, self.platform, job.job_id, e)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        try:
            found = await self._call(self.adapter.list_jobs, experiment_id)
        except _CallFailed as e:
            log.warning("sweep of experiment %s: cannot list its %s jobs: %s", experiment_id, self.platform, e)
            return []
        removed = []
        for view in found:
            if view.experiment_id != experiment_id or not view.env_id or view.env_id in keep:
                continue
            if self._phase(view.status) not in ("queued", "running"):
                continue
            try:
                await self._call(self.adapter.cancel, view.job_id)
            except _CallFailed as e:
                log.warning("sweep: could not cancel %s job %s: %s", self.platform, view.job_id, e)
                continue
            if view.env_id in self._jobs:
                self._jobs[view.env_id].stop_requested = True
                self._jobs[view.env_id].asked_at = -1e18
            log.info("environment %s of experiment %s: leftover %s job %s canceled", view.env_id, experiment_id, self.platform, view.job_id)
            removed.append(view.env_id)
        return sorted(removed)

    async def close(self) -> None:
        try:
            await self._call(self.adapter.close)
        except _CallFailed as e:
            log.warning("%s: closing the client failed: %s", self.platform, e)

    # ---- inside ---------------------------------------------------------------------------

    async def _submit(self, job: _Job, request: EnvironmentRequest) -> StartResult:
        try:
            spec = self.job_spec(request)
        except Exception as e:  # noqa: BLE001 - a spec that cannot be built fails this start only
            job.last = Observation("failed", f"could not describe the job: {e}")
            return StartResult(error=f"{self.platform}: could not describe the job of {request.env_id}: {e}")
        try:
            job.job_id = await self._call(self.adapter.submit, spec)
        except _CallFailed as e:
            job.last = Observation("failed", f"could not submit the job: {e}")
            return StartResult(error=f"{self.platform}: could not submit the job of {request.env_id}: {e}")
        log.info("environment %s: %s job %s submitted", request.env_id, self.platform, job.job_id)
        return StartResult(platform_id=job.job_id)

    async def _observe(self, env_id: str) -> Observation:
        job = self._jobs.get(env_id)
        if job is None:
            return Observation("unknown")
        if job.started is not None and not job.started.done():
            return Observation("starting", "being submitted")
        if job.started is not None and job.started.result().error:
            return Observation("failed", job.started.result().error or "", "")
        now = asyncio.get_running_loop().time()
        if job.last is not None and now - job.asked_at < self.poll_interval:
            return job.last
        job.asked_at = now
        try:
            view = await self._call(self.adapter.get, job.job_id)
        except _CallFailed as e:
            prev = job.last or Observation("starting")
            return Observation(prev.state, f"cannot ask {self.platform}: {e}", job.job_id)
        job.last = self._judge(job, view)
        return job.last

    def _judge(self, job: _Job, view: JobView | None) -> Observation:
        if view is None:
            if job.stop_requested:
                return Observation("exited", "removed", job.job_id)
            return Observation("failed", f"{self.platform} no longer knows job {job.job_id}", job.job_id)
        phase = self._phase(view.status)
        detail = scrub(view.detail, self._secrets)
        words = f"job {job.job_id} is {view.status}" + (f": {detail}" if detail else "")
        if phase == "queued":
            return Observation("starting", words, job.job_id)
        if phase == "running":
            return Observation("running", "", job.job_id)
        if phase == "succeeded":
            return Observation("exited", words, job.job_id)
        if phase == "canceled" and job.stop_requested:
            return Observation("exited", words, job.job_id)
        if phase == "canceled":
            return Observation("failed", f"{words} (canceled outside trialkeeper)", job.job_id)
        return Observation("failed", words, job.job_id)

    def _phase(self, status: str) -> Phase:
        # A status word this version does not know yet: the job is there, not ended.
        return self.PHASES.get(status, "queued")

    async def _active_after(self, job_id: str, wait_s: float) -> bool:
        """Whether the job still runs after up to ``wait_s`` seconds of waiting for it to end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_s)
        while True:
            view = await self._call(self.adapter.get, job_id)
            if view is None or self._phase(view.status) not in ("queued", "running"):
                return False
            if loop.time() >= deadline:
                return True
            await asyncio.sleep(STOP_POLL_S)

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.call_timeout)
        except asyncio.TimeoutError:
            raise _CallFailed(f"no answer within {self.call_timeout:g} s") from None
        except Exception as e:  # noqa: BLE001 - whatever the SDK raises becomes data
            raise _CallFailed(scrub(f"{type(e).__name__}: {e}", self._secrets)) from None


def copy_code(source: Path, target: Path, exclude: Collection[Path]) -> None:
    """A fresh copy of the trial code at ``target``, without the experiment's own files
    (its token among them) where the experiment directory lies inside the code."""
    skip = {os.path.normpath(p) for p in exclude}

    def ignore(directory: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or os.path.normpath(os.path.join(directory, n)) in skip}

    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, ignore=ignore, symlinks=True)
