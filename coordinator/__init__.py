"""The coordinator: embed it in a tuner, or run it from a YAML config with ``trialkeeper run``.

    from trialkeeper.coordinator import Coordinator, load_config
"""

from .config import ConfigError, ExperimentConfig, load_config, parse_config
from .core import Coordinator, CoordinatorError, TrialHandle, TrialRefused
from .model import MetricEvent, StatusEvent, TrialInfo
from .states import TrialStatus
from .sync import SyncCoordinator, SyncTrialHandle

__all__ = [
    "ConfigError",
    "Coordinator",
    "CoordinatorError",
    "ExperimentConfig",
    "MetricEvent",
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
