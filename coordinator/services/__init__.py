"""Environment services, one module (or folder) per platform with its config beside it.

Which service a platform name stands for is the registry's business (``platforms.py``);
:func:`create_service` builds the one a config names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.experiment import ExperimentConfig
from ..platforms import ENTRY_POINT_GROUP, factory, platform, platform_names
from .base import EnvironmentService

__all__ = ["ENTRY_POINT_GROUP", "create_service"]


def create_service(config: ExperimentConfig, experiment_dir: Path) -> EnvironmentService[Any]:
    """The environment service of the config's platform, built from the config."""
    section = config.training_service
    name = section.platform
    found = platform(name)
    if found is not None:
        if not isinstance(section, found.config_class()):
            raise TypeError(f"platform {name!r} takes a {found.config}, not a {type(section).__qualname__}")
        service: EnvironmentService[Any] = found.service_class().from_config(config, section, experiment_dir)
        return service
    made = factory(name)
    if made is not None:
        return made(config, experiment_dir)  # type: ignore[no-any-return]
    raise ValueError(f"no environment service for platform {name!r}; known: {', '.join(sorted(platform_names()))}")
