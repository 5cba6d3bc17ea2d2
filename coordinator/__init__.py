"""The coordinator: embed it in a tuner, or run it from a YAML config with ``trialkeeper run``.

    from trialkeeper.coordinator import Coordinator, load_config
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _moved

_moved.install()

if TYPE_CHECKING:
    from .config.experiment import ConfigError, ExperimentConfig, load_config, parse_config
    from .core import Coordinator, CoordinatorError, TrialHandle, TrialRefused
    from .engine.model import MetricEvent, StatusEvent, TrialInfo
    from .engine.states import EnvStatus, TrialStatus
    from .read.model import ReadModel
    from .sync import SyncCoordinator, SyncTrialHandle

# Each name and the module it comes from, imported when first used: the CLI's reading
# commands import this package, and need none of the coordinator's engine (a quarter of a
# second of imports before `trialkeeper status` could answer).
_FROM = {
    "ConfigError": "config.experiment", "ExperimentConfig": "config.experiment",
    "load_config": "config.experiment", "parse_config": "config.experiment",
    "Coordinator": "core", "CoordinatorError": "core", "TrialHandle": "core", "TrialRefused": "core",
    "MetricEvent": "engine.model", "StatusEvent": "engine.model", "TrialInfo": "engine.model",
    "TrialStatus": "engine.states", "EnvStatus": "engine.states",
    "ReadModel": "read.model",
    "SyncCoordinator": "sync", "SyncTrialHandle": "sync",
}

__all__ = [
    "ConfigError",
    "Coordinator",
    "CoordinatorError",
    "EnvStatus",
    "ExperimentConfig",
    "MetricEvent",
    "ReadModel",
    "StatusEvent",
    "SyncCoordinator",
    "SyncTrialHandle",
    "TrialHandle",
    "TrialInfo",
    "TrialRefused",
    "TrialStatus",
    "load_config",
    "parse_config",
]


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM])
