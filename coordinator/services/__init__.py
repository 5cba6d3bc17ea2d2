"""Environment services by platform name; third-party ones plug in through entry points."""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from .base import EnvironmentService

if TYPE_CHECKING:
    from ..config import ExperimentConfig

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "trialkeeper.environment_services"

Factory = Callable[["ExperimentConfig", Path], EnvironmentService]


def _local(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .local import LocalEnvironmentService

    return LocalEnvironmentService(experiment_dir, Path(config.trial_code_directory))


def _remote(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .remote import RemoteEnvironmentService

    return RemoteEnvironmentService.from_config(config, experiment_dir)


def _slurm(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .slurm import SlurmEnvironmentService

    return SlurmEnvironmentService.from_config(config, experiment_dir)


def _kubernetes(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    # One service for plain pods/jobs and the operator flavours (kubeflow, frameworkcontroller, adl).
    from .kubernetes import KubernetesEnvironmentService

    return KubernetesEnvironmentService.from_config(config, experiment_dir)


def _ray(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .ray import RayEnvironmentService

    return RayEnvironmentService.from_config(config, experiment_dir)


def _openpai(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .openpai import OpenPaiEnvironmentService

    return OpenPaiEnvironmentService.from_config(config, experiment_dir)


def _dlts(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .dlts import DltsEnvironmentService

    return DltsEnvironmentService.from_config(config, experiment_dir)


def _aml(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .aml import AmlEnvironmentService

    return AmlEnvironmentService.from_config(config, experiment_dir)


def _dlc(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    from .dlc import DlcEnvironmentService

    return DlcEnvironmentService.from_config(config, experiment_dir)


BUILTIN: dict[str, Factory] = {
    "local": _local,
    "remote": _remote,
    "slurm": _slurm,
    "kubernetes": _kubernetes,
    "kubeflow": _kubernetes,
    "frameworkcontroller": _kubernetes,
    "adl": _kubernetes,
    "ray": _ray,
    "openpai": _openpai,
    "dlts": _dlts,
    "aml": _aml,
    "dlc": _dlc,
}


def factories() -> dict[str, Factory]:
    """Built-in factories plus those other packages register under the entry-point group."""
    found = dict(BUILTIN)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            found[ep.name] = ep.load()
    return found


def create_service(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
    platform = config.training_service.platform
    known = factories()
    if platform not in known:
        raise ValueError(f"no environment service for platform {platform!r}; known: {', '.join(sorted(known))}")
    return known[platform](config, experiment_dir)
