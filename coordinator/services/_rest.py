"""A small REST client for the cluster platforms that speak HTTP (OpenPAI, DLTS).

Their APIs are plain JSON/YAML over HTTP with no SDK worth depending on, so this is
``urllib`` with what a long-running coordinator needs: a timeout on every call, retries
with backoff when the server is briefly away (connection errors, 502/503/504), and error
messages that never carry a credential. URLs are shown without their query string (DLTS
passes the password there) and every known secret is blanked from response bodies
before they reach a message, because those messages end up in logs and in the store.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .base import (
    EnvironmentRequest,
    EnvironmentService,
    Observation,
    PlatformConfig,
    StartResult,
    env_id_in_name,
)

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})


class RestError(Exception):
    """A call that failed; ``status`` is the HTTP status, 0 when no answer came."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Response:
    """An answer with a 2xx status."""

    status: int
    body: bytes

    def json(self) -> Any:
        if not self.body.strip():
            return None
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise RestError(self.status, f"the server answered with invalid JSON: {e}") from None


class RestClient:
    """Blocking calls (``request``) and their asyncio form (``call``) against one base URL."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 query: Mapping[str, str] | None = None, secrets: Collection[str] = (),
                 timeout: float = 30.0, retries: int = 3, backoff: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers or {})
        # Sent with every call (DLTS authenticates by query); never shown.
        self._query = dict(query or {})
        self._secrets = tuple(s for s in secrets if s)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    def redact(self, text: str) -> str:
        """``text`` with every secret this client knows replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    async def call(self, method: str, path: str, **kwargs: Any) -> Response:
        """:meth:`request` in a thread, so that the event loop never waits on the network."""
        return await asyncio.to_thread(self.request, method, path, **kwargs)

    def request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                json_body: Any = None, data: bytes | None = None, content_type: str | None = None,
                retry: bool = True) -> Response:
        """One call; retried (when ``retry``) on connection errors and 502/503/504.

        Raises RestError for any other failure, with the status and the server's message.
        A POST that creates something should pass ``retry=False`` unless the server refuses
        duplicates, since a lost answer does not mean the request was lost."""
        params = {**self._query, **(query or {})}
        url = f"{self.base_url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        shown = f"{method} {self.base_url}{path}"
        headers = dict(self._headers)
        if json_body is not None:
            data = json.dumps(json_body).encode()
            content_type = content_type or "application/json"
        if content_type:
            headers["Content-Type"] = content_type
        headers.setdefault("Accept", "application/json")
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                return self._once(method, url, data, headers)
            except urllib.error.HTTPError as e:
                body = _read(e)
                if e.code in RETRY_STATUSES and not last:
                    self._pause(attempt, shown, f"HTTP {e.code}")
                    continue
                raise RestError(e.code, f"{shown}: HTTP {e.code}: {self.redact(_message(body, e.reason))}") from None
            except (TimeoutError, urllib.error.URLError, OSError) as e:
                why = self.redact(str(getattr(e, "reason", e)) or type(e).__name__)
                if not last:
                    self._pause(attempt, shown, why)
                    continue
                raise RestError(0, f"{shown}: no answer ({why})") from None
        raise AssertionError("unreachable")

    def _once(self, method: str, url: str, data: bytes | None, headers: dict[str, str]) -> Response:
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout) as answer:
            return Response(answer.status, answer.read())

    def _pause(self, attempt: int, shown: str, why: str) -> None:
        delay = self.backoff * (2**attempt)
        log.debug("%s: %s; trying again in %.1f s", shown, why, delay)
        time.sleep(delay)


def _read(error: urllib.error.HTTPError) -> bytes:
    try:
        return error.read()
    except OSError:
        return b""


def _message(body: bytes, reason: object) -> str:
    """The server's own words: a JSON ``message`` field, else the text, else the reason."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        parts = [str(data[k]) for k in ("code", "message", "error") if data.get(k)]
        if parts:
            return ": ".join(parts)
    return text[:500] if text else str(reason)


# ---- the part every REST job platform shares ----------------------------------------------

JobPhase = Literal["waiting", "running", "succeeded", "failed", "stopped", "gone"]
_FINAL: frozenset[str] = frozenset({"succeeded", "failed", "stopped", "gone"})
JOB_PREFIX = "tk-"


def job_name(experiment_id: str, env_id: str) -> str:
    """The platform job's name: how ``sweep`` finds an experiment's jobs by its id alone."""
    return f"{JOB_PREFIX}{experiment_id}-{env_id}"


def env_of(name: str, experiment_id: str) -> str | None:
    """The environment id in a job name of ``experiment_id``, or None for another's job."""
    return env_id_in_name(name, job_name(experiment_id, ""))


@dataclass
class Job:
    """One environment's job as this service knows it."""

    env_id: str
    ref: str  # the platform's id for the job (what ``start`` returned)
    phase: JobPhase = "waiting"
    detail: str = ""
    stop_requested: bool = False
    observation: Observation | None = None  # set once the job has ended


class RestJobService(EnvironmentService[PlatformConfig]):
    """Start/poll/stop/sweep for platforms where one environment is one job behind a REST API.

    A subclass says how to submit a job, read the phases of some jobs, kill one, and list
    the live jobs of an experiment; this class keeps the contract: one job per env id,
    errors as data, polling the platform at most every ``poll_interval``, stop that waits
    for the agent to end on its own before killing, and a job that ends without being
    asked (failed, stopped or deleted outside trialkeeper) reported ``failed`` with why."""

    kind = "job"  # how messages name the platform's job ("OpenPAI job")
    STOP_WAIT_S = 30.0

    def __init__(self, *, poll_interval: float, secrets: Collection[str] = ()) -> None:
        self.poll_interval = poll_interval
        self._secrets = tuple(s for s in secrets if s)
        self._jobs: dict[str, Job] = {}
        self._starting: dict[str, asyncio.Future[StartResult]] = {}
        self._refreshed_at = 0.0
        self._refreshing: asyncio.Future[None] | None = None

    # ---- what a platform provides ---------------------------------------------------

    @abc.abstractmethod
    async def _submit(self, request: EnvironmentRequest, name: str) -> str:
        """Submit the job named ``name``; its platform id. Raises RestError or OSError."""

    @abc.abstractmethod
    async def _phases(self, jobs: list[Job]) -> dict[str, tuple[JobPhase, str]]:
        """(phase, detail) of each job by env id; a job the platform no longer has is "gone"."""

    @abc.abstractmethod
    async def _kill(self, ref: str) -> None:
        """Ask the platform to stop the job; returns once it accepted."""

    @abc.abstractmethod
    async def _live(self, experiment_id: str) -> dict[str, str]:
        """env id -> platform id of the jobs of ``experiment_id`` that still wait or run."""

    # ---- the contract ---------------------------------------------------------------

    def adopt(self, env_id: str, platform_id: str) -> None:
        if platform_id and env_id not in self._jobs:
            self._jobs[env_id] = Job(env_id, platform_id, phase="running")
            self._refreshed_at = 0.0

    async def start(self, request: EnvironmentRequest) -> StartResult:
        job = self._jobs.get(request.env_id)
        if job is not None:
            return StartResult(platform_id=job.ref)
        pending = self._starting.get(request.env_id)
        if pending is None:
            pending = self._starting[request.env_id] = asyncio.ensure_future(self._start(request))
            pending.add_done_callback(lambda _: self._starting.pop(request.env_id, None))
        return await asyncio.shield(pending)

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        # The platform is asked in the background: a slow API server never holds up the
        # coordinator's loop, which sees the newest answer on a later poll.
        idle = self._refreshing is None or self._refreshing.done()
        if idle and time.monotonic() - self._refreshed_at >= self.poll_interval:
            self._refreshing = asyncio.ensure_future(self._refresh())
        return {env_id: self._observe(env_id) for env_id in env_ids}

    async def stop(self, env_id: str, grace_s: float = 5.0) -> None:
        pending = self._starting.get(env_id)
        if env_id not in self._jobs and pending is not None:
            await asyncio.wait([pending], timeout=60.0)
        job = self._jobs.get(env_id)
        if job is None or job.observation is not None:
            return
        job.stop_requested = True
        # The coordinator has asked the agent to shut down over its stream: its job may
        # end on its own within the grace period; otherwise the platform stops it.
        if grace_s <= 0 or not await self._wait_final([job], grace_s):
            try:
                await self._kill(job.ref)
            except RestError as e:
                if e.status != 404:
                    log.warning("environment %s: could not stop %s %s: %s", env_id, self.kind, job.ref, self.redact(str(e)))
                    return
            if not await self._wait_final([job], self.STOP_WAIT_S):
                log.warning("environment %s: %s %s did not end after being stopped", env_id, self.kind, job.ref)
                return
        job.observation = Observation("exited", "stopped", job.ref)

    async def sweep(self, experiment_id: str, keep: Collection[str] = ()) -> list[str]:
        try:
            found = await self._live(experiment_id)
        except RestError as e:
            log.warning("cannot list the %ss of experiment %s: %s", self.kind, experiment_id, self.redact(str(e)))
            return []
        doomed = [Job(env_id, ref) for env_id, ref in sorted(found.items()) if env_id not in keep]
        removed = []
        for job in doomed:
            if job.env_id in self._jobs:
                self._jobs[job.env_id].stop_requested = True
            try:
                await self._kill(job.ref)
            except RestError as e:
                log.warning("could not stop %s %s of experiment %s: %s", self.kind, job.ref, experiment_id, self.redact(str(e)))
                continue
            removed.append(job)
        if removed and not await self._wait_final(removed, self.STOP_WAIT_S):
            removed = [job for job in removed if job.phase in _FINAL]
        for job in removed:
            log.info("environment %s of experiment %s: leftover %s %s stopped", job.env_id, experiment_id, self.kind, job.ref)
        return [job.env_id for job in removed]

    async def close(self) -> None:
        pending = [*self._starting.values()]
        if self._refreshing is not None:
            pending.append(self._refreshing)  # type: ignore[arg-type]
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # ---- inside ---------------------------------------------------------------------

    async def _start(self, request: EnvironmentRequest) -> StartResult:
        name = job_name(request.experiment_id, request.env_id)
        try:
            ref = await self._submit(request, name)
        except (RestError, OSError) as e:
            return StartResult(error=self.redact(f"{self.kind} {name} could not be submitted: {e}"))
        self._jobs[request.env_id] = Job(request.env_id, ref)
        self._refreshed_at = 0.0
        log.info("environment %s: %s %s submitted", request.env_id, self.kind, ref)
        return StartResult(platform_id=ref)

    def _observe(self, env_id: str) -> Observation:
        job = self._jobs.get(env_id)
        if job is None:
            return Observation("starting") if env_id in self._starting else Observation("unknown")
        if job.observation is not None:
            return job.observation
        if job.phase == "waiting":
            return Observation("starting", job.detail or f"{self.kind} {job.ref} is waiting", job.ref)
        return Observation("running", job.detail, job.ref)

    async def _refresh(self) -> None:
        live = [job for job in self._jobs.values() if job.observation is None]
        try:
            if live:
                await self._update(live)
        except RestError as e:  # the next poll asks again; what was seen last stands
            for job in live:
                job.detail = self.redact(f"cannot ask the platform: {e}")
        except Exception:  # a malformed answer must not end the polling
            log.exception("asking the platform about its %ss failed", self.kind)
        finally:
            self._refreshed_at = time.monotonic()
        for job in live:
            if job.phase in _FINAL and job.observation is None:
                # Stopped by this coordinator (stop, sweep): an exit, not a failure.
                job.observation = Observation("exited", "stopped", job.ref) if job.stop_requested else self._ended(job)
                log.info("environment %s: %s", job.env_id, job.observation.detail)

    async def _update(self, jobs: list[Job]) -> None:
        seen = await self._phases(jobs)
        for job in jobs:
            if job.env_id in seen:
                job.phase, detail = seen[job.env_id]
                job.detail = self.redact(detail)

    async def _wait_final(self, jobs: list[Job], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._update(jobs)
            except RestError as e:
                log.debug("waiting for %ss to end: %s", self.kind, self.redact(str(e)))
            if all(job.phase in _FINAL for job in jobs):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.2)

    def _ended(self, job: Job) -> Observation:
        what = f"{self.kind} {job.ref}"
        why = f": {job.detail}" if job.detail else ""
        if job.phase == "succeeded":
            return Observation("exited", "agent exited normally", job.ref)
        if job.phase == "stopped":
            return Observation("failed", f"{what} was stopped outside trialkeeper{why}", job.ref)
        if job.phase == "gone":
            return Observation("failed", f"{what} is gone from the platform (deleted outside trialkeeper)", job.ref)
        return Observation("failed", f"{what} failed{why}", job.ref)
