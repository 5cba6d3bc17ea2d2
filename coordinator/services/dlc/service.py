"""PAI-DLC environments: each is one DLC job running one agent.

The trial code is copied once per experiment onto the NAS through its local mount
(``localStorageMountPoint``); the jobs see it at ``containerStorageMountPoint``, where
``nasDataSourceId`` is mounted. Each trial runs in its own copy of it, and each agent keeps
its files in ``<mount>/trialkeeper/<experiment>/envs/<env>`` there. The agent dials the
coordinator back over gRPC: the coordinator must be reachable from the jobs (README,
"PAI-DLC").

All of the DLC SDK sits behind the adapter of ``_dlc_sdk``; tests put a fake in its place
with :func:`set_adapter_factory`, the one documented seam.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from .._cloud_jobs import CloudJobService, CloudSetupError, JobAdapter
from .._jobs import JobPhase
from .._launch import agent_argv, agent_environment, copy_code
from ..base import EnvironmentRequest
from . import sdk as _dlc_sdk
from .config import ID_ENV, SECRET_ENV, DlcConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

#: ``factory(config, access_key_id, access_key_secret)`` -> the adapter.
AdapterFactory = Callable[["DlcConfig", str, str], JobAdapter]
MISSING_SDK = "platform dlc needs the alibabacloud-pai-dlc20201203 package: pip install 'trialkeeper[dlc]'"

_adapter_factory: AdapterFactory | None = None


def set_adapter_factory(factory: AdapterFactory | None) -> AdapterFactory | None:
    """Make new services reach PAI-DLC through ``factory`` (``None``: the real SDK);
    returns the factory it replaces. Tests install a fake adapter this way."""
    global _adapter_factory
    previous, _adapter_factory = _adapter_factory, factory
    return previous


def _sdk_adapter(config: DlcConfig, key_id: str, secret: str) -> JobAdapter:
    return _dlc_sdk.DlcSdkAdapter(config.region, config.endpoint, config.workspace_id, key_id, secret)


def access_key(config: DlcConfig) -> tuple[str, str]:
    """(id, secret): from the config, the secret's file, or the standard variables."""
    key_id = config.access_key_id or os.environ.get(ID_ENV, "")
    secret = config.access_key_secret or ""
    if not secret and config.access_key_secret_file is not None:
        try:
            secret = config.access_key_secret_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise CloudSetupError(
                f"platform dlc: cannot read accessKeySecretFile {config.access_key_secret_file}: {e.strerror}"
            ) from None
    secret = secret or os.environ.get(SECRET_ENV, "")
    if not key_id or not secret:
        raise CloudSetupError(
            f"platform dlc needs an access key: accessKeyId and accessKeySecretFile (or {ID_ENV} and {SECRET_ENV})"
        )
    return key_id, secret


class DlcEnvironmentService(CloudJobService[DlcConfig]):
    """Starts agents as PAI-DLC jobs; see the module docstring."""

    platform = "dlc"
    kind = "PAI-DLC job"
    shares_filesystem = False
    # GetJob's statuses.
    PHASES: ClassVar[Mapping[str, JobPhase]] = {
        "Creating": "waiting", "Queuing": "waiting", "Bidding": "waiting", "EnvPreparing": "waiting",
        "SanityChecking": "waiting", "Running": "running", "Restarting": "running", "Stopping": "running",
        "SucceededReserving": "succeeded", "Succeeded": "succeeded",
        "FailedReserving": "failed", "Failed": "failed", "Stopped": "stopped",
    }

    def __init__(self, config: DlcConfig, experiment_dir: Path, code_directory: Path, adapter: JobAdapter,
                 *, secrets: tuple[str, ...] = (), exclude: tuple[Path, ...] = ()) -> None:
        super().__init__(adapter, poll_interval=config.poll_interval, secrets=secrets)
        self.config = config
        self.code_directory = code_directory
        self.exclude = exclude
        digest = hashlib.sha256(str(experiment_dir.resolve()).encode()).hexdigest()[:8]
        self._subdir = f"trialkeeper/{experiment_dir.name}-{digest}"

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: DlcConfig, experiment_dir: Path) -> Self:
        factory = _adapter_factory
        if factory is None:
            if _dlc_sdk.sdk_missing():
                raise CloudSetupError(MISSING_SDK)
            factory = _sdk_adapter
        key_id, secret = access_key(ts)
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, experiment_dir, Path(config.trial_code_directory), factory(ts, key_id, secret),
                   secrets=(secret,), exclude=exclude)

    def _in_container(self, *parts: str) -> str:
        return "/".join([self.config.container_storage_mount_point.rstrip("/"), self._subdir, *parts])

    def working_directory(self) -> str:
        return self._in_container("code")

    async def prepare(self) -> None:
        target = self.config.local_storage_mount_point / self._subdir / "code"
        skip = (*self.exclude, self.config.local_storage_mount_point.resolve())
        await asyncio.to_thread(copy_code, self.code_directory, target, skip)
        log.info("dlc: trial code copied to %s (jobs see it at %s)", target, self.working_directory())
        await super().prepare()

    def job_spec(self, request: EnvironmentRequest) -> _dlc_sdk.DlcJobSpec:
        c = self.config
        argv = agent_argv(request.coordinator_address, request.env_id, self.platform, python="python3",
                          workdir=self._in_container("envs", request.env_id), copy_working_directory=True,
                          agent_args=request.agent_args)
        return _dlc_sdk.DlcJobSpec(
            display_name=_dlc_sdk.display_name(request.experiment_id, request.env_id),
            job_type=c.job_type, role=c.type, image=c.image, pod_count=c.pod_count, ecs_spec=c.ecs_spec,
            user_command=shlex.join(argv),
            workspace_id=c.workspace_id,
            nas_data_source_id=c.nas_data_source_id, nas_mount_path=c.container_storage_mount_point,
            oss_data_source_id=c.oss_data_source_id,
            envs=agent_environment(request.token, request.experiment_id, request.env_id),
        )

