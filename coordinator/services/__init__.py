"""Environment services by platform name; third-party ones plug in through entry points."""

from __future__ import annotations

import importlib
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


def _lazy(module: str, class_name: str) -> Factory:
    """A factory that imports the service's module (and its SDK) only when it is used."""

    def factory(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService:
        cls = getattr(importlib.import_module(f"{__name__}.{module}"), class_name)
        service: EnvironmentService = cls.from_config(config, experiment_dir)
        return service

    return factory


_kubernetes = _lazy("kubernetes", "KubernetesEnvironmentService")  # all four flavours

BUILTIN: dict[str, Factory] = {
    "local": _local,
    "remote": _lazy("remote", "RemoteEnvironmentService"),
    "slurm": _lazy("slurm", "SlurmEnvironmentService"),
    "kubernetes": _kubernetes,
    "kubeflow": _kubernetes,
    "frameworkcontroller": _kubernetes,
    "adl": _kubernetes,
    "ray": _lazy("ray", "RayEnvironmentService"),
    "openpai": _lazy("openpai", "OpenPaiEnvironmentService"),
    "dlts": _lazy("dlts", "DltsEnvironmentService"),
    "aml": _lazy("aml", "AmlEnvironmentService"),
    "dlc": _lazy("dlc", "DlcEnvironmentService"),
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
