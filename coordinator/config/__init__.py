"""The experiment config: parsed and validated once, at start, then passed down.

``experiment`` holds the whole config and its parser, ``platform`` the base of every
``trainingService`` section, ``rules`` the vocabulary of validation (public to plug-ins),
``walk`` the walker from plain data to dataclasses, ``nni`` NNI's configs as they are, and
``redacted`` the secrets a stored config blanks.

    from trialkeeper.coordinator.config import ExperimentConfig, parse_config
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .experiment import ConfigError, ExperimentConfig, config_to_dict, load_config, parse_config

# Handed on when first used, so that importing ``config.rules`` (as every platform's section
# does) does not import the whole config and the platform registry with it.
_PUBLIC = ("ConfigError", "ExperimentConfig", "config_to_dict", "load_config", "parse_config")

__all__ = ["ConfigError", "ExperimentConfig", "config_to_dict", "load_config", "parse_config"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(".experiment", __name__), name)
