"""The one module that talks to Azure ML through ``azureml-core``.

The SDK is imported inside the functions below, so that importing this module (to read
``AmlRunSpec``) costs nothing and needs nothing installed; its import takes seconds and
pulls in dozens of packages, and it happens only when the platform is used.

Each environment is one run in the Azure ML experiment named after the trialkeeper
experiment, tagged with both ids so that ``list_jobs`` finds them by the experiment id
alone. The experiment token travels in the run's environment variables (the run
configuration's, not the registered Environment asset's), never in its command.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._cloud_jobs import JobView

if TYPE_CHECKING:
    from .config import AmlConfig

PACKAGE = "azureml-core"
TAG_EXPERIMENT = "trialkeeper.experiment"
TAG_ENVIRONMENT = "trialkeeper.environment"


@dataclass(frozen=True)
class AmlRunSpec:
    """One environment's run, in trialkeeper's terms; ``script_run_config`` makes it the SDK's."""

    experiment_name: str
    display_name: str
    source_directory: str
    command: tuple[str, ...]
    compute_target: str
    docker_image: str
    tags: dict[str, str]
    environment_variables: dict[str, str] = field(repr=False)


def experiment_name(experiment_id: str) -> str:
    """The Azure ML experiment of a trialkeeper experiment (letters, digits, - and _)."""
    return "trialkeeper-" + re.sub(r"[^A-Za-z0-9_-]", "-", experiment_id)[:200]


def sdk_missing() -> bool:
    """Whether azureml-core is absent (without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("azureml.core") is None
    except (ImportError, ValueError):  # a parent package blocked or broken
        return True


def environment(spec: AmlRunSpec) -> Any:
    """The Azure ML Environment: the user's image, its own Python (nothing installed)."""
    from azureml.core import Environment

    env = Environment(name=spec.experiment_name)
    env.docker.base_image = spec.docker_image
    env.python.user_managed_dependencies = True
    return env


def script_run_config(spec: AmlRunSpec) -> Any:
    """The ScriptRunConfig that runs the agent on the compute target."""
    from azureml.core import ScriptRunConfig

    src = ScriptRunConfig(
        source_directory=spec.source_directory,
        command=list(spec.command),
        compute_target=spec.compute_target,
        environment=environment(spec),
    )
    src.run_config.environment_variables = dict(spec.environment_variables)
    return src


class AmlSdkAdapter:
    """Runs, statuses and cancels through azureml-core; blocking, called from threads."""

    def __init__(self, config: AmlConfig) -> None:
        self.config = config
        self._workspace: Any = None
        self._lock = threading.Lock()

    def _ws(self) -> Any:
        with self._lock:
            if self._workspace is None:
                from azureml.core import Workspace

                c = self.config
                if c.config_file is not None:
                    self._workspace = Workspace.from_config(path=str(c.config_file))
                else:
                    self._workspace = Workspace(c.subscription_id, c.resource_group, c.workspace_name)
            return self._workspace

    def connect(self) -> None:
        from azureml.core.compute import ComputeTarget

        ComputeTarget(workspace=self._ws(), name=self.config.compute_target)

    def submit(self, spec: AmlRunSpec) -> str:
        from azureml.core import Experiment

        run = Experiment(self._ws(), spec.experiment_name).submit(script_run_config(spec), tags=dict(spec.tags))
        run.display_name = spec.display_name
        return str(run.id)

    def get(self, job_id: str) -> JobView | None:
        from azureml.core import Run
        from azureml.exceptions import ServiceException

        try:
            run = Run.get(self._ws(), job_id)
        except ServiceException as e:
            if getattr(e, "status_code", None) == 404:
                return None
            raise
        return _view(run, with_error=True)

    def cancel(self, job_id: str) -> None:
        from azureml.core import Run

        Run.get(self._ws(), job_id).cancel()

    def list_jobs(self, experiment_id: str) -> list[JobView]:
        from azureml.core import Experiment

        # Looked up, not constructed: Experiment(ws, name) would create it in the workspace.
        found = Experiment.list(self._ws(), experiment_name=experiment_name(experiment_id))
        runs = [run for exp in found for run in exp.get_runs(tags={TAG_EXPERIMENT: experiment_id})]
        return [_view(run, with_error=False) for run in runs]

    def close(self) -> None:
        self._workspace = None


def _view(run: Any, *, with_error: bool) -> JobView:
    tags = run.get_tags() or {}
    status = str(run.get_status())
    detail = ""
    if with_error and status in ("Failed", "Canceled"):
        error = (run.get_details() or {}).get("error") or {}
        detail = str((error.get("error") or {}).get("message") or error.get("message") or "")
    return JobView(
        job_id=str(run.id), status=status, detail=detail,
        experiment_id=str(tags.get(TAG_EXPERIMENT, "")), env_id=str(tags.get(TAG_ENVIRONMENT, "")),
    )
