"""The Pareto front of an experiment with several objectives (its config's ``objectives``):
the trials whose final result keeps the constraints and is dominated by no other's. What
``trialkeeper trials --pareto`` and the dashboard show."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..config import objectives as obj
from ..config.objectives import Objectives
from .model import ReadModel
from .snapshots import TrialSnapshot, optimize_mode

__all__ = ["objectives_of", "pareto_front", "pareto_trials"]


def objectives_of(config: Mapping[str, Any] | None) -> Objectives:
    """What a stored config optimizes: its ``objectives``, else the tuner's (or advisor's)
    ``optimize_mode`` on the ``default`` result."""
    config = config or {}
    raw = config.get("objectives")
    if raw is not None:
        try:
            return obj.parse(raw)
        except obj.ObjectivesError:
            pass  # a store written by a version that read it otherwise: the default stands
    section = config.get("advisor") or config.get("tuner") or {}
    args = section.get("classArgs") if isinstance(section, Mapping) else None
    return obj.single(optimize_mode(args if isinstance(args, Mapping) else None))


def pareto_front(trials: Iterable[TrialSnapshot], objectives: Objectives) -> list[TrialSnapshot]:
    """The trials on the Pareto front of their final results, in the order given."""
    return obj.pareto_front(trials, objectives, _final)


def pareto_trials(model: ReadModel) -> list[TrialSnapshot]:
    """The experiment's Pareto-front trials, as its stored config declares its objectives
    (with one objective: its best trials, ties included)."""
    return pareto_front(model.trials(), objectives_of(model.stored_config()))


def _final(t: TrialSnapshot) -> Any:
    return t.final_metric_value if t.final_metric_value is not None else t.final_metric
