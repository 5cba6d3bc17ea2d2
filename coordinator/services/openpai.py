"""OpenPAI environments: each is one job, submitted through the REST API v2, running one agent.

The job (protocol version 2, submitted as YAML) has one task role with one instance that
asks for ``trialCpuNumber``/``trialMemorySize``/GPUs per trial slot, runs in
``dockerImage`` on ``virtualCluster``, and mounts the team storage ``storageConfigName``.
Its name is ``tk-<experiment>-<environment>``, so the user's job list finds every job of an
experiment from the id alone (``sweep``); its platform id is OpenPAI's ``user~name``.

The trial code is copied once onto the storage (``localStorageMountPoint`` here, seen as
``containerStorageMountPoint`` in the jobs), or onto ``sharedStorage``, which the job then
mounts itself before starting the agent.

The experiment token reaches the agent through the job's ``secrets`` map, OpenPAI's own
secret mechanism: the command says ``export TRIALKEEPER_TOKEN=<% $secrets.… %>`` and the
runtime fills the value in inside the container. That is cleaner than the alternatives:
the token is stored by the platform as a secret (never returned by its API), it is not
in the job's commands, and no file holding it has to be written to a storage that other
users of the team may read. A storage account key for ``sharedStorage`` travels the same
way.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from trialkeeper.protos.wire import TOKEN_ENV

from . import _shared_storage as storage
from ._jobs import Job, JobEnvironmentService, JobPhase, JobState, env_of
from ._launch import TLS_CERT_FILE, agent_argv, copy_code, write_tls_cert
from ._rest import RestClient, RestError
from .base import EnvironmentRequest
from .openpai_config import OpenPaiConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ..config.experiment import ExperimentConfig, SharedStorageConfig

log = logging.getLogger(__name__)

TOKEN_SECRET = "trialkeeper_token"
KEY_SECRET = "trialkeeper_storage_key"
_PHASES: dict[str, JobPhase] = {
    "WAITING": "waiting", "RUNNING": "running", "STOPPING": "running",
    "SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "stopped",
}


class OpenPaiSetupError(ValueError):
    """The experiment cannot use OpenPAI as configured."""


class OpenPaiEnvironmentService(JobEnvironmentService[OpenPaiConfig]):
    """Starts agents as OpenPAI jobs; see the module docstring."""

    platform = "openpai"
    shares_filesystem = False
    kind = "OpenPAI job"
    PLAIN_ERRORS = (RestError, OSError)

    def __init__(self, config: OpenPaiConfig, experiment_dir: Path, code_directory: Path, *,
                 trial_gpu_number: int = 0, shared: SharedStorageConfig | None = None,
                 exclude: tuple[Path, ...] = ()) -> None:
        key = shared.storage_account_key if shared is not None else None
        super().__init__(poll_interval=config.poll_interval, secrets=(config.token, key or ""))
        self.config = config
        self.experiment_dir = experiment_dir
        self.code_directory = code_directory
        self.shared = shared
        self.exclude = exclude
        self.resources = config.resources(trial_gpu_number)
        if shared is not None:
            self.layout = storage.layout(shared, experiment_dir)
        elif config.local_storage_mount_point is not None and config.container_storage_mount_point is not None:
            self.layout = storage.layout_on(
                config.local_storage_mount_point, config.container_storage_mount_point, experiment_dir
            )
        else:
            raise OpenPaiSetupError(
                "platform openpai needs storage for the trial code: set storageConfigName, "
                "localStorageMountPoint and containerStorageMountPoint, or a sharedStorage section"
            )
        self.client = RestClient(
            f"{config.host.rstrip('/')}/rest-server/api/v2",
            headers={"Authorization": f"Bearer {config.token}"},
            secrets=(config.token, key or ""), timeout=config.api_timeout,
        )

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: OpenPaiConfig, experiment_dir: Path) -> Self:
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), trial_gpu_number=config.trial_gpu_number,
                   shared=config.shared_storage, exclude=exclude)

    # ---- the contract -----------------------------------------------------------------

    def shared_checkpoints(self, experiment_dir: Path) -> tuple[Path, str] | None:
        # On the shared storage every environment mounts: saved there by rename.
        return self.layout.local_root / "checkpoints", f"{self.layout.remote_root}/checkpoints"

    def working_directory(self) -> str:
        return self.layout.remote_code

    async def prepare(self) -> None:
        if self.shared is not None:
            await asyncio.to_thread(storage.ensure_local, self.shared)
        target = self.layout.local_code
        local_root = (self.shared.local_mount_point if self.shared else self.config.local_storage_mount_point)
        assert local_root is not None
        await asyncio.to_thread(copy_code, self.code_directory, target, (*self.exclude, local_root.resolve()))
        log.info("openpai: trial code copied to %s (jobs see it at %s)", target, self.working_directory())

    # ---- the platform -----------------------------------------------------------------

    async def submit(self, request: EnvironmentRequest, name: str) -> str:
        body = yaml.safe_dump(self.protocol(request, name), sort_keys=False).encode()
        try:
            await self.client.call("POST", "/jobs", data=body, content_type="text/yaml")
        except RestError as e:
            if e.status != 409:  # a retried submit whose first answer was lost: the job exists
                raise
        return f"{self.config.username}~{name}"

    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        # One list call for all jobs, as the OpenPAI web portal does, rather than one per job.
        listed = await self._list()
        out: dict[str, JobState] = {}
        for job in jobs:
            name = job.platform_id.split("~", 1)[-1]
            found = listed.get(name)
            if found is None:
                out[job.env_id] = JobState("gone")
                continue
            state = str(found.get("state", ""))
            phase = _PHASES.get(state, "running")
            out[job.env_id] = JobState(phase, await self._why(job.platform_id) if phase == "failed" else "")
        return out

    async def kill(self, job: Job) -> None:
        try:
            await self.client.call("PUT", f"/jobs/{job.platform_id}/executionType", json_body={"value": "STOP"})
        except RestError as e:
            if e.status != 404:  # gone already: what a kill wants
                raise

    async def list_jobs(self, experiment_id: str) -> dict[str, str]:
        out = {}
        for name, job in (await self._list()).items():
            env_id = env_of(name, experiment_id)
            if env_id is not None and job.get("state") in ("WAITING", "RUNNING", "STOPPING"):
                out[env_id] = f"{self.config.username}~{name}"
        return out

    async def _list(self) -> dict[str, dict[str, Any]]:
        answer = (await self.client.call("GET", "/jobs", query={"username": self.config.username})).json()
        if not isinstance(answer, list):
            raise RestError(200, "the job list is not a list")
        return {str(j.get("name")): j for j in answer if isinstance(j, dict)}

    async def _why(self, ref: str) -> str:
        """The job's exit code and diagnostics, which OpenPAI keeps in the job's status."""
        try:
            status = (await self.client.call("GET", f"/jobs/{ref}")).json().get("jobStatus") or {}
        except (RestError, AttributeError):
            return ""
        code, diag = status.get("appExitCode"), str(status.get("appExitDiagnostics") or "").strip()
        text = f"exit code {code}" if code is not None else ""
        return f"{text}: {diag[-600:]}" if diag else text

    # ---- the job ----------------------------------------------------------------------

    def protocol(self, request: EnvironmentRequest, name: str) -> dict[str, Any]:
        """The job in OpenPAI's protocol version 2 (as a mapping; submitted as YAML)."""
        c = self.config
        secrets = {TOKEN_SECRET: request.token}
        if self.shared is not None and self.shared.storage_account_key:
            secrets[KEY_SECRET] = self.shared.storage_account_key
        job: dict[str, Any] = {
            "protocolVersion": 2,
            "name": name,
            "type": "job",
            "jobRetryCount": 0,
            "prerequisites": [{"type": "dockerimage", "name": "image", "uri": c.docker_image}],
            "secrets": secrets,
            "taskRoles": {
                "agent": {
                    "instances": 1,
                    "completion": {"minFailedInstances": 1, "minSucceededInstances": 1},
                    "taskRetryCount": 0,
                    "dockerImage": "image",
                    "resourcePerInstance": dict(self.resources),
                    "commands": self.commands(request),
                }
            },
            "defaults": {"virtualCluster": c.virtual_cluster},
            "extras": {"submitFrom": "trialkeeper"},
        }
        if c.storage_config_name is not None and self.shared is None:
            job["extras"]["com.microsoft.pai.runtimeplugin"] = [
                {"plugin": "teamwise_storage", "parameters": {"storageConfigNames": [c.storage_config_name]}}
            ]
        return job

    def commands(self, request: EnvironmentRequest) -> list[str]:
        """The task's commands; the token is a reference to the job's secret, never its value."""
        workdir = self.layout.remote_env(request.env_id)
        # Written into the shared storage, read by the job where it mounts that.
        cert = write_tls_cert(self.layout.local_env(request.env_id), request.tls_cert_pem)
        tls_cert = f"{workdir}/{TLS_CERT_FILE}" if cert is not None else None
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform,
                          python=self.config.python_path, workdir=workdir, copy_working_directory=True,
                          no_gpu=self.resources["gpu"] == 0, tls_cert=tls_cert, agent_args=request.agent_args)
        lines = [f"export {TOKEN_ENV}='<% $secrets.{TOKEN_SECRET} %>'"]
        if self.shared is not None:
            lines.append(storage.mount_step(self.shared, self.shared.remote_mount_point,
                                            key_expr=f"'<% $secrets.{KEY_SECRET} %>'"))
        lines += [f"mkdir -p {shlex.quote(workdir)}", f"exec {shlex.join(argv)}"]
        return lines
