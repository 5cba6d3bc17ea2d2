"""DLTS (DLWorkspace) environments: each is one job, submitted through the dashboard's REST API.

DLTS publishes no specification of this API. The calls below are those NNI's DLTS
training service made, with the same paths, query authentication (``email`` and
``password``) and bodies; the job list used by ``sweep`` is the dashboard's own
``/api/teams/{team}/jobs`` route, which NNI did not need::

    GET  /api/teams/{team}/clusters/{cluster}          cluster metadata (the GPU type)
    POST /api/clusters/{cluster}/jobs                  submit; answers {"jobId": ...}
    GET  /api/v2/clusters/{cluster}/jobs/{jobId}       the job, with "jobStatus"
    PUT  /api/clusters/{cluster}/jobs/{jobId}/status   {"status": "killing"}
    GET  /api/teams/{team}/jobs                        the team's jobs (names, states)

The job is named ``tk-<experiment>-<environment>``. As with NNI, the jobs see the
coordinator's file system (the DLTS work path): the trial code is read in place, agents
write into the experiment directory, and the experiment token reaches the agent as a
0600 file there (``--token-file``), since the job's ``env`` list is shown to anyone who
can read the job. With ``sharedStorage`` the code and trial outputs go there instead and
the job mounts it first. The password travels in the query string, as the API demands;
no URL with its query is ever logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _shared_storage as storage
from ._jobs import Job, JobEnvironmentService, JobPhase, JobState, env_of
from ._launch import agent_argv, copy_code, write_tls_cert
from ._rest import RestClient, RestError
from .base import EnvironmentRequest
from .dlts_config import DltsConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig, SharedStorageConfig

log = logging.getLogger(__name__)

_PHASES: dict[str, JobPhase] = {
    "unapproved": "waiting", "queued": "waiting", "scheduling": "waiting",
    "running": "running", "pausing": "running", "paused": "running", "killing": "running",
    "finished": "succeeded", "failed": "failed", "error": "failed", "killed": "stopped",
}
_LIVE = frozenset({"unapproved", "queued", "scheduling", "running", "pausing", "paused", "killing"})
LIST_LIMIT = 10000


class DltsEnvironmentService(JobEnvironmentService[DltsConfig]):
    """Starts agents as DLTS jobs; see the module docstring."""

    platform = "dlts"
    shares_filesystem = True
    kind = "DLTS job"
    PLAIN_ERRORS = (RestError, OSError)

    def __init__(self, config: DltsConfig, experiment_dir: Path, code_directory: Path, *,
                 trial_gpu_number: int = 0, shared: SharedStorageConfig | None = None,
                 exclude: tuple[Path, ...] = ()) -> None:
        key = shared.storage_account_key if shared is not None else None
        super().__init__(poll_interval=config.poll_interval, secrets=(config.password, key or ""))
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.shared = shared
        self.exclude = exclude
        self.gpus = config.gpus_per_job(trial_gpu_number)
        self.layout = storage.layout(shared, experiment_dir) if shared is not None else None
        if shared is not None:
            # Trials work on the storage, at a path this machine sees elsewhere: logs are streamed.
            self.shares_filesystem = False  # type: ignore[misc]
        self.client = RestClient(
            f"{config.dashboard.rstrip('/')}/api",
            query={"email": config.email, "password": config.password},
            secrets=(config.password, key or ""), timeout=config.api_timeout,
        )
        self._gpu_type: asyncio.Future[str] | None = None

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: DltsConfig, experiment_dir: Path) -> Self:
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), trial_gpu_number=config.trial_gpu_number,
                   shared=config.shared_storage, exclude=exclude)

    # ---- the contract -----------------------------------------------------------------

    def shared_checkpoints(self, experiment_dir: Path) -> tuple[Path, str] | None:
        # On the shared storage every environment mounts (when there is one): saved there by rename.
        if self.layout is None:
            return super().shared_checkpoints(experiment_dir)
        return self.layout.local_root / "checkpoints", f"{self.layout.remote_root}/checkpoints"

    def working_directory(self) -> str:
        return self.layout.remote_code if self.layout is not None else str(self.code_directory)

    async def prepare(self) -> None:
        self.experiment_dir.mkdir(parents=True, exist_ok=True)
        if self.shared is None or self.layout is None:
            return
        await asyncio.to_thread(storage.ensure_local, self.shared)
        await asyncio.to_thread(copy_code, self.code_directory, self.layout.local_code,
                                (*self.exclude, self.shared.local_mount_point.resolve()))
        log.info("dlts: trial code copied to %s (jobs see it at %s)", self.layout.local_code, self.working_directory())

    # ---- the platform -----------------------------------------------------------------

    async def submit(self, request: EnvironmentRequest, name: str) -> str:
        c = self.config
        body = {
            "jobName": name, "team": c.team, "vcName": c.team, "userName": c.email,
            "gpuType": await self._gpu(), "resourcegpu": self.gpus, "image": c.image,
            "cmd": await asyncio.to_thread(self.command, request), "interactivePorts": [],
            "jobType": "training", "jobtrainingtype": "RegularJob",
            "ssh": False, "ipython": False, "tensorboard": False,
            "workPath": "", "enableworkpath": True, "dataPath": "", "enabledatapath": False,
            "jobPath": "", "enablejobpath": True, "mountpoints": [],
            "env": [{"name": "TMPDIR", "value": "$HOME/tmp"}],
            "hostNetwork": False, "useGPUTopology": False, "isPrivileged": False, "hostIPC": False,
            "preemptionAllowed": "False",
        }
        try:
            # Each POST creates a job: not retried blindly, but looked for by name when the answer is lost.
            answer = (await self.client.call("POST", f"/clusters/{c.cluster}/jobs", json_body=body, retry=False)).json()
        except RestError as e:
            if e.status != 0 and e.status < 500:
                raise
            found = (await self.list_jobs(request.experiment_id)).get(request.env_id)
            if found is None:
                raise
            return found
        job_id = answer.get("jobId") if isinstance(answer, dict) else None
        if not job_id:
            raise RestError(200, f"the dashboard gave no jobId: {str(answer)[:200]}")
        return str(job_id)

    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        out: dict[str, JobState] = {}
        for job in jobs:
            try:
                answer = (
                    await self.client.call("GET", f"/v2/clusters/{self.config.cluster}/jobs/{job.platform_id}")
                ).json()
            except RestError as e:
                if e.status != 404:
                    raise
                answer = None
            if not isinstance(answer, dict) or not answer.get("jobStatus"):
                out[job.env_id] = JobState("gone")
                continue
            status = str(answer["jobStatus"])
            phase = _PHASES.get(status, "running")
            out[job.env_id] = JobState(
                phase, str(answer.get("errorMsg") or "").strip()[-600:] if phase == "failed" else ""
            )
        return out

    async def kill(self, job: Job) -> None:
        try:
            await self.client.call("PUT", f"/clusters/{self.config.cluster}/jobs/{job.platform_id}/status",
                                   json_body={"status": "killing"})
        except RestError as e:
            if e.status != 404:  # gone already: what a kill wants
                raise

    async def list_jobs(self, experiment_id: str) -> dict[str, str]:
        answer = (
            await self.client.call("GET", f"/teams/{self.config.team}/jobs", query={"limit": str(LIST_LIMIT)})
        ).json()
        if not isinstance(answer, list):
            raise RestError(200, "the team's job list is not a list")
        out = {}
        for job in answer:
            if not isinstance(job, dict) or job.get("cluster", self.config.cluster) != self.config.cluster:
                continue
            env_id = env_of(str(job.get("jobName", "")), experiment_id)
            if (
                env_id is not None
                and job.get("jobStatus") in _LIVE
                and job.get("userName", self.config.email) == self.config.email
            ):
                out[env_id] = str(job.get("jobId"))
        return out

    async def _gpu(self) -> str:
        """The configured GPU type, else the first one the cluster's metadata names (as NNI did)."""
        if self.config.gpu_type is not None:
            return self.config.gpu_type
        if self._gpu_type is None or (self._gpu_type.done() and self._gpu_type.exception() is not None):
            self._gpu_type = asyncio.ensure_future(self._ask_gpu_type())
        return await asyncio.shield(self._gpu_type)

    async def _ask_gpu_type(self) -> str:
        c = self.config
        answer = (await self.client.call("GET", f"/teams/{c.team}/clusters/{c.cluster}")).json()
        try:
            metadata: Any = (
                json.loads(answer["metadata"]) if isinstance(answer["metadata"], str) else answer["metadata"]
            )
            return str(next(iter(metadata)))
        except (KeyError, TypeError, ValueError, StopIteration):
            raise RestError(200, f"team {c.team} on cluster {c.cluster} names no GPU type; set gpuType") from None

    # ---- the job ----------------------------------------------------------------------

    def command(self, request: EnvironmentRequest) -> str:
        """The job's ``cmd``, one line as DLTS runs it; the token is in a 0600 file, never here."""
        env_dir = self.experiment_dir / "envs" / request.env_id
        token_file = env_dir / "token"
        storage.write_private(token_file, request.token.encode())
        steps = []
        workdir, copy = str(self.experiment_dir), False
        if self.shared is not None and self.layout is not None:
            key_expr = '""'
            if self.shared.storage_account_key:
                key_file = env_dir / "storage.key"
                storage.write_private(key_file, self.shared.storage_account_key.encode())
                key_expr = f'"$(cat {shlex.quote(str(key_file))})"'
            steps += storage.mount_step(self.shared, self.shared.remote_mount_point, key_expr=key_expr).splitlines()
            workdir = self.layout.remote_env(request.env_id)
            steps.append(f"mkdir -p {shlex.quote(workdir)}")
            copy = True
        cert = write_tls_cert(env_dir, request.tls_cert_pem)
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform,
                          python=self.config.python_path, workdir=workdir, copy_working_directory=copy,
                          no_gpu=self.gpus == 0, token_file=str(token_file), tls_cert=cert,
                          agent_args=request.agent_args)
        steps.append(f"exec {shlex.join(argv)}")
        return "; ".join(steps)
