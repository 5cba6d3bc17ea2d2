"""A fake DLTS (DLWorkspace) dashboard on 127.0.0.1 that really runs the jobs as local processes.

DLTS has no published API specification; this fake implements exactly the calls NNI's
DLTS training service made (and trialkeeper's DLTS service makes), all under ``/api`` and
authenticated by the ``email`` and ``password`` query parameters:

* ``GET /api/teams/{team}/clusters/{cluster}``: ``{"metadata": "<JSON of GPU types>"}``
* ``POST /api/clusters/{cluster}/jobs``: submit (validated: jobName, resourcegpu, image,
  cmd, team/vcName, userName, gpuType, jobtrainingtype, env); answers ``{"jobId": ...}``
* ``GET /api/v2/clusters/{cluster}/jobs/{jobId}``: the job with its ``jobStatus``
* ``PUT /api/clusters/{cluster}/jobs/{jobId}/status``: ``{"status": "killing"}``
* ``GET /api/teams/{team}/jobs``: the user's jobs of the team (``limit``, default 10)

Errors are plain text with the status, as the dashboard (Koa) answers them. A job runs
its ``cmd`` through ``/bin/sh`` with its ``env`` exported and the DLWS_* variables set;
states: running, then finished or failed by exit code, killing/killed when killed.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fake_openpai import STOP_GRACE_S, FakeHttpServer, HttpError, ProcessJob

_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class DltsJob:
    job_id: str
    body: dict[str, Any]
    run: ProcessJob
    killed_by: str = ""
    error: str = ""


class FakeDlts(FakeHttpServer):
    """The server: ``start()``/``stop()`` it (stopping kills every job), or use ``running()``."""

    def __init__(self, root: Path, *, email: str = "alice@example.com", password: str | None = None,
                 team: str = "platform", cluster: str = "fake-cluster", gpu_types: tuple[str, ...] = ("P40",)) -> None:
        super().__init__()
        self.root = root
        self.email = email
        self.password = password or f"pw-{uuid.uuid4().hex}"
        self.team = team
        self.cluster = cluster
        self.gpu_types = gpu_types
        self.path_prefix: tuple[str, ...] = ()
        self.jobs: dict[str, DltsJob] = {}
        self.submitted: list[dict[str, Any]] = []

    def error_body(self, e: HttpError) -> Any:
        return e.message.encode()

    # ---- what tests use ---------------------------------------------------------------

    def job_named(self, name: str) -> DltsJob:
        with self.lock:
            return next(j for j in self.jobs.values() if j.body["jobName"] == name)

    def fail_job(self, name: str) -> None:
        job = self.job_named(name)
        job.error = "the job's pod was evicted"
        job.run.kill()

    def kill_outside(self, name: str) -> None:
        job = self.job_named(name)
        job.killed_by = "admin"
        job.run.kill(STOP_GRACE_S)

    def delete_job(self, name: str) -> None:
        job = self.job_named(name)
        job.run.kill()
        with self.lock:
            del self.jobs[job.job_id]

    def stop(self) -> None:
        self.shutdown()
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            job.run.kill()

    # ---- the API ------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, str], headers: Any, body: bytes) -> tuple[int, Any]:
        if query.get("email") != self.email or query.get("password") != self.password:
            raise HttpError(403, "", "Forbidden")
        parts = path.strip("/").split("/")
        if parts[0] != "api":
            raise HttpError(404, "", "Not Found")
        parts = parts[1:]
        if len(parts) == 4 and parts[0] == "teams" and parts[2] == "clusters" and method == "GET":
            self._team_cluster(parts[1], parts[3])
            return 200, {"metadata": json.dumps({t: {"perNode": 4, "memory": "24GB"} for t in self.gpu_types})}
        if len(parts) == 3 and parts[0] == "teams" and parts[2] == "jobs" and method == "GET":
            self._team_cluster(parts[1], self.cluster)
            return 200, self._list(int(query.get("limit") or 10))
        if len(parts) == 3 and parts[0] == "clusters" and parts[2] == "jobs" and method == "POST":
            self._team_cluster(self.team, parts[1])
            return 200, self._submit(body)
        if len(parts) == 5 and parts[:2] == ["v2", "clusters"] and parts[3] == "jobs" and method == "GET":
            self._team_cluster(self.team, parts[2])
            return 200, self._view(self._job(parts[4]))
        if (
            len(parts) == 5
            and parts[0] == "clusters"
            and parts[2] == "jobs"
            and parts[4] == "status"
            and method == "PUT"
        ):
            self._team_cluster(self.team, parts[1])
            return 200, self._set_status(self._job(parts[3]), body)
        raise HttpError(404, "", "Not Found")

    def _team_cluster(self, team: str, cluster: str) -> None:
        if cluster != self.cluster:
            raise HttpError(404, "", "Not Found")
        if team != self.team:
            raise HttpError(403, "", "Forbidden")

    def _job(self, job_id: str) -> DltsJob:
        with self.lock:
            job = self.jobs.get(job_id)
        if job is None:
            raise HttpError(404, "", "Not Found")
        return job

    def _submit(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            raise HttpError(400, "", "Bad Request: the body is not JSON") from None
        problems = self.validate(body)
        if problems:
            raise HttpError(400, "", "Bad Request: " + "; ".join(problems))
        self.submitted.append(body)
        job_id = str(uuid.uuid4())
        job = DltsJob(job_id, body, ProcessJob(job_id, self.root / "jobs" / job_id[:13]))
        with self.lock:
            self.jobs[job_id] = job
        exports = [f'export {e["name"]}="{e["value"]}"' for e in body["env"]]
        script = "\n".join([*exports, 'mkdir -p "${TMPDIR:-/tmp}"', body["cmd"]]) + "\n"
        env = {"DLWS_JOB_ID": job_id, "DLWS_USER_EMAIL": self.email, "DLWS_VC_NAME": body["vcName"],
               "DLWS_NUM_GPU_PER_WORKER": str(body["resourcegpu"])}
        try:
            job.run.run(script, env, self.path_prefix)
        except OSError as e:
            job.error = f"cannot start the job: {e}"
        return {"jobId": job_id}

    def validate(self, body: object) -> list[str]:
        if not isinstance(body, dict):
            return ["the job must be a JSON object"]
        out = []
        for key in ("jobName", "image", "cmd", "team", "vcName", "userName", "gpuType", "jobtrainingtype"):
            if not isinstance(body.get(key), str) or not body[key].strip():
                out.append(f"{key} must be a non-empty string")
        gpus = body.get("resourcegpu")
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
            out.append("resourcegpu must be a non-negative integer")
        if body.get("team") != self.team or body.get("vcName") != self.team:
            out.append(f"team and vcName must be {self.team!r}")
        if body.get("userName") != self.email:
            out.append("userName must be the authenticated user's email")
        if body.get("gpuType") not in self.gpu_types:
            out.append(f"gpuType {body.get('gpuType')!r} is not a GPU type of the cluster")
        if body.get("jobtrainingtype") not in ("RegularJob", "PSDistJob", "InferenceJob"):
            out.append("jobtrainingtype must be RegularJob, PSDistJob or InferenceJob")
        env = body.get("env", [])
        if not isinstance(env, list) or not all(
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and _VAR.fullmatch(e["name"])
            and isinstance(e.get("value"), str)
            for e in env
        ):
            out.append("env must be a list of {name, value} strings")
        return out

    def _status(self, job: DltsJob) -> str:
        if job.run.proc is None:
            return "failed" if job.error else "queued"
        if job.run.exit_code is None:
            return "killing" if job.killed_by else "running"
        if job.killed_by:
            return "killed"
        return "finished" if job.run.exit_code == 0 else "failed"

    def _view(self, job: DltsJob) -> dict[str, Any]:
        status = self._status(job)
        error = job.error or (job.run.log_tail() if status == "failed" else "")
        params = {k: v for k, v in job.body.items() if k != "env"}
        return {
            "jobId": job.job_id, "jobName": job.body["jobName"], "userName": job.body["userName"],
            "vcName": job.body["vcName"], "jobStatus": status, "cluster": self.cluster,
            "jobTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job.run.created)),
            "jobStatusDetail": [{"startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(job.run.created))}],
            "errorMsg": error, "jobParams": params,
        }

    def _set_status(self, job: DltsJob, raw: bytes) -> dict[str, Any]:
        try:
            status = json.loads(raw or b"{}").get("status")
        except (ValueError, AttributeError):
            status = None
        if status not in ("killing", "pausing", "queued", "approved"):
            raise HttpError(400, "", "Bad Request: unknown status")
        if status == "killing" and self._status(job) in ("queued", "running"):
            job.killed_by = self.email
            threading.Thread(target=job.run.kill, args=(STOP_GRACE_S,), daemon=True).start()
        return {"result": f"Success, the job is scheduled to be {status}"}

    def _list(self, limit: int) -> list[dict[str, Any]]:
        with self.lock:
            jobs = list(self.jobs.values())
        jobs.sort(key=lambda j: j.run.created, reverse=True)
        return [self._view(j) for j in jobs][:limit]


@contextlib.contextmanager
def running(root: Path) -> Iterator[FakeDlts]:
    """A started fake; on exit every job it runs is killed."""
    fake = FakeDlts(root)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def section(fake: FakeDlts, **extra: Any) -> dict[str, Any]:
    """A `trainingService` section for this fake, as a user writes it."""
    out: dict[str, Any] = {
        "platform": "dlts",
        "dashboard": fake.url + "/",
        "cluster": fake.cluster,
        "team": fake.team,
        "email": fake.email,
        "password": fake.password,
        "image": "registry.example/trialkeeper:test",
        "pollInterval": 0.3,
    }
    out.update(extra)
    return out


def shell_words(cmd: str) -> list[str]:
    """The words of a job's ``cmd`` (for tests that look at what would run)."""
    return shlex.split(cmd)
