"""Azure ML environments: each is one run of the agent on the configured compute target.

The run's snapshot of the trial code directory is the agent's working directory, and
trials run in it (as local agents run them in the code directory). The agent keeps its
trial directories under ``outputs/``, which Azure ML keeps with the run. The agent dials
the coordinator back over gRPC: the coordinator must be reachable from the compute (see
README, "Azure ML").

All of ``azureml-core`` sits behind the adapter of ``_aml_sdk``; tests put a fake in its
place with :func:`set_adapter_factory`, the one documented seam.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from .._cloud_jobs import CloudJobService, CloudSetupError, JobAdapter
from .._jobs import JobPhase
from .._launch import agent_argv, agent_environment, copy_code
from ..base import EnvironmentRequest
from . import sdk as _aml_sdk
from .config import AmlConfig

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

AdapterFactory = Callable[["AmlConfig"], JobAdapter]
MISSING_SDK = "platform aml needs the azureml-core package: pip install 'trialkeeper[aml]'"
AGENT_WORKDIR = "outputs/trialkeeper"

_adapter_factory: AdapterFactory | None = None


def set_adapter_factory(factory: AdapterFactory | None) -> AdapterFactory | None:
    """Make new services reach Azure ML through ``factory(config)`` (``None``: the real
    SDK); returns the factory it replaces. Tests install a fake adapter this way."""
    global _adapter_factory
    previous, _adapter_factory = _adapter_factory, factory
    return previous


class AmlEnvironmentService(CloudJobService[AmlConfig]):
    """Starts agents as Azure ML runs; see the module docstring."""

    platform = "aml"
    kind = "Azure ML run"
    shares_filesystem = False
    # Run statuses of azureml-core (azureml._restclient.constants.RunStatus).
    PHASES: ClassVar[Mapping[str, JobPhase]] = {
        "NotStarted": "waiting", "Queued": "waiting", "Preparing": "waiting", "Starting": "waiting",
        "Provisioning": "waiting", "Running": "running", "Finalizing": "running",
        "CancelRequested": "running", "NotResponding": "running",
        "Completed": "succeeded", "Failed": "failed", "Canceled": "stopped",
    }

    def __init__(self, config: AmlConfig, code_directory: Path, adapter: JobAdapter, *,
                 experiment_dir: Path | None = None, exclude: tuple[Path, ...] = ()) -> None:
        super().__init__(adapter, poll_interval=config.poll_interval)
        self.config = config
        self.code_directory = code_directory
        self.experiment_dir = experiment_dir
        self.exclude = exclude
        # What each run snapshots: the code directory, or a copy without the experiment's files.
        self.source_directory = code_directory

    @classmethod
    def from_config(cls, config: ExperimentConfig, ts: AmlConfig, experiment_dir: Path) -> Self:
        factory = _adapter_factory
        if factory is None:
            if _aml_sdk.sdk_missing():
                raise CloudSetupError(MISSING_SDK)
            factory = _aml_sdk.AmlSdkAdapter
        exclude = (experiment_dir.resolve(), Path(config.experiment_working_directory).resolve())
        return cls(ts, Path(config.trial_code_directory), factory(ts), experiment_dir=experiment_dir, exclude=exclude)

    async def prepare(self) -> None:
        # A run uploads its whole source directory: never the experiment's token and store.
        code = self.code_directory.resolve()
        inside = [p for p in self.exclude if p == code or code in p.parents]
        if inside and self.experiment_dir is not None:
            staged = self.experiment_dir / "aml-code"
            await asyncio.to_thread(copy_code, self.code_directory, staged, (*inside, staged.resolve()))
            self.source_directory = staged
            log.info("aml: %s holds the experiment directory; runs upload a copy without it (%s)", code, staged)
        await super().prepare()

    def working_directory(self) -> str:
        return "."  # the run's snapshot of the code directory, the agent's cwd

    def gpu_policy(self, env_id: str) -> tuple[int | None, bool | None]:
        return self.config.max_trial_number_per_gpu, None

    def job_spec(self, request: EnvironmentRequest) -> _aml_sdk.AmlRunSpec:
        command = tuple(agent_argv(request.coordinator_address, request.env_id, self.platform, python="python3",
                                   workdir=AGENT_WORKDIR, agent_args=request.agent_args))
        return _aml_sdk.AmlRunSpec(
            experiment_name=_aml_sdk.experiment_name(request.experiment_id),
            display_name=f"{request.experiment_id}/{request.env_id}",
            source_directory=str(self.source_directory),
            command=command,
            compute_target=self.config.compute_target,
            docker_image=self.config.docker_image,
            tags={_aml_sdk.TAG_EXPERIMENT: request.experiment_id, _aml_sdk.TAG_ENVIRONMENT: request.env_id},
            environment_variables=agent_environment(request.token, request.experiment_id, request.env_id),
        )
