"""Secrets that the stored config holds as ``***``, and where a resume takes them from.

The config record in the store has every secret replaced by ``***`` (see
``config_to_dict(..., redact=True)``), so a coordinator rebuilt from that record alone
would hand ``***`` to its trials and its platform. A secret ``trialEnv`` variable is
taken from the environment of the resuming process, where a user keeps such a
variable anyway; every other secret (a platform's password, key or token, a tuner's
``classArgs``) lives only in the config file, so it has to come from there.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The rule config_to_dict redacts by: the two must agree on what is a secret.
from .experiment import _is_secret, has_redacted_url_password

log = logging.getLogger(__name__)

REDACTED = "***"  # what config_to_dict(redact=True) writes in place of a secret
TRIAL_ENV = "trialEnv"  # the stored (camelCase) key of ExperimentConfig.trial_env
_GIVE_CONFIG = "pass the config file with --config FILE"


@dataclass(frozen=True)
class RedactedValue:
    """One secret the stored config holds as ``***``, by its place in the config."""

    path: tuple[str | int, ...]

    @property
    def where(self) -> str:
        """The field path as config errors write it: ``trainingService.machineList[0].password``."""
        text = ""
        for step in self.path:
            if isinstance(step, int):
                text += f"[{step}]"
            else:
                text += f".{step}" if text else step
        return text

    @property
    def variable(self) -> str | None:
        """The environment variable's name, for a ``trialEnv`` entry; None otherwise."""
        if len(self.path) == 2 and self.path[0] == TRIAL_ENV and isinstance(self.path[1], str):
            return self.path[1]
        return None


@dataclass(frozen=True)
class Restored:
    """The stored config with what could be filled, and what is still ``***``."""

    data: Any
    filled: list[RedactedValue]
    missing: list[RedactedValue]


class SecretsMissing(ValueError):
    """Secrets the stored config lacks and nothing given supplies; the message names each
    one and how to give it, on one line."""

    def __init__(self, missing: list[RedactedValue]) -> None:
        self.missing = list(missing)
        super().__init__(describe_missing(self.missing))


def find_redacted(data: object) -> list[RedactedValue]:
    """Every redacted value in ``data`` (a stored config, as plain data), in document order.

    A ``***`` under a key that does not look secret is a value the user wrote, not a
    redaction, and is left alone; a URL whose password reads ``***`` (``optunaStorage``)
    is a redaction wherever it stands.
    """
    found: list[RedactedValue] = []

    def walk(value: object, path: tuple[str | int, ...]) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if item == REDACTED and _is_secret(str(key)):
                    found.append(RedactedValue((*path, str(key))))
                else:
                    walk(item, (*path, str(key)))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, (*path, i))
        elif isinstance(value, str) and path and has_redacted_url_password(value):
            found.append(RedactedValue(path))

    walk(data, ())
    return found


def fill_redacted(data: object, environ: Mapping[str, str]) -> Restored:
    """A copy of ``data`` with each redacted ``trialEnv`` variable set to its value in
    ``environ``; what ``environ`` lacks, and every other redacted field, is ``missing``."""
    result: Any = copy.deepcopy(data)
    filled: list[RedactedValue] = []
    missing: list[RedactedValue] = []
    for item in find_redacted(result):
        name = item.variable
        if name is not None and name in environ:
            result[TRIAL_ENV][name] = environ[name]
            filled.append(item)
        else:
            missing.append(item)
    return Restored(result, filled, missing)


def restore_redacted(data: object, environ: Mapping[str, str]) -> Any:
    """``data`` with its redacted ``trialEnv`` variables taken from ``environ``.

    Raises SecretsMissing when any redacted value is still unknown, so that nothing
    starts with ``***`` in place of a secret.
    """
    restored = fill_redacted(data, environ)
    if restored.missing:
        raise SecretsMissing(restored.missing)
    if restored.filled:
        names = ", ".join(str(item.variable) for item in restored.filled)
        log.info("the redacted trialEnv variables %s are taken from the environment", names)
    return restored.data


def describe_missing(missing: list[RedactedValue]) -> str:
    """One line naming each missing secret and how to give it."""
    variables = [item.variable for item in missing if item.variable is not None]
    fields = [item.where for item in missing if item.variable is None]
    ways: list[str] = []
    if variables:
        them = "it" if len(variables) == 1 else "each"
        ways.append(
            f"trialEnv {', '.join(variables)}: set {them} in the environment of "
            f"`trialkeeper resume`, or {_GIVE_CONFIG}"
        )
    if fields:
        ways.append(f"{', '.join(fields)}: {_GIVE_CONFIG} (not read from the environment)")
    return "the stored config has secrets redacted (***) that the experiment needs: " + "; ".join(ways)


def stored_config_for(stored: Any, experiment_dir: Path, environ: Mapping[str, str]) -> Any:
    """The experiment config kept in a store (``stored``, secrets redacted), parsed, with its
    redacted ``trialEnv`` variables from ``environ``. Raises ValueError saying what to do
    when it cannot be used (unreadable, a secret missing, no longer valid)."""
    from .experiment import ConfigError, parse_config

    if stored is None:
        raise ValueError(f"the stored config of {experiment_dir} is unreadable; pass the config file")
    try:
        return parse_config(restore_redacted(stored, environ), experiment_dir)
    except SecretsMissing:
        raise
    except (ConfigError, ValueError) as e:
        raise ValueError(
            f"the stored config of {experiment_dir} cannot be used as it is ({e}); pass the config file"
        ) from e
