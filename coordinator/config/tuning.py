"""The sections of an experiment config that name the search's algorithms: the tuner, the
assessor, and NNI's advisors in place of both."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .rules import IMPORT_PATH, NON_EMPTY_STR, Issues, is_dir, not_both

__all__ = ["AdvisorConfig", "AssessorConfig", "TunerConfig"]


@dataclass(frozen=True, kw_only=True)
class TunerConfig:
    """A built-in tuner by `name`, or a third-party one by `class_name` ("module:Class")."""

    name: str | None = field(default="random", metadata=NON_EMPTY_STR)
    class_name: str | None = field(default=None, metadata=IMPORT_PATH)
    code_directory: Path | None = None
    class_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues: Issues = []
        if "class_name" in given:
            issues += not_both(given, names, "name", "class_name")
            values["name"] = None
        code_directory = values.get("code_directory")
        if code_directory is not None and not is_dir(code_directory):
            issues.append(("code_directory", f"not an existing directory: {code_directory}"))
        return issues


@dataclass(frozen=True, kw_only=True)
class AssessorConfig(TunerConfig):
    """What stops unpromising trials early: a built-in assessor by `name` (`median`, `asha`),
    `optuna` (its pruners), NNI's (`Medianstop`, `Curvefitting`), or one by `class_name`."""

    name: str | None = field(default=None, metadata=NON_EMPTY_STR)
    _NEEDS: typing.ClassVar[str] = (
        "an assessor needs name (median, asha, optuna, Medianstop, Curvefitting) or className"
    )

    @classmethod
    def _finalize(cls, values: dict[str, Any], given: set[str], names: dict[str, str]) -> Issues:
        issues = super()._finalize(values, given, names)
        if values.get("name") is None and values.get("class_name") is None and not issues:
            issues.append(("name", cls._NEEDS))
        return issues


@dataclass(frozen=True, kw_only=True)
class AdvisorConfig(AssessorConfig):
    """NNI's Hyperband or BOHB by `name`: proposes trials and decides their budgets, in
    place of the tuner and the assessor."""

    _NEEDS: typing.ClassVar[str] = "an advisor needs name (Hyperband, BOHB)"
