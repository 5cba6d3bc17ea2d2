"""What the dashboard's analysis charts compute from trials already read: each parameter's
importance to the final metric, and the empirical distribution of the final metric (the
Pareto front of several objectives is ``read/pareto.py``'s).

Importance is Optuna's PED-ANOVA evaluator (``optuna.importance.PedAnovaImportanceEvaluator``)
over an in-memory study of the trials given, each parameter with the distribution its search
space gives it (a ``choice`` categorical, the log types on a log scale). It needs Optuna
(``pip install 'trialkeeper[optuna]'``); without it the answer says so. PED-ANOVA rather than
fANOVA: it takes milliseconds over two thousand trials, where fANOVA's forest takes seconds."""

from __future__ import annotations

import importlib
import logging
import math
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .space import LOG_TYPES, Axis

INSTALL = "pip install 'trialkeeper[optuna]'"
EVALUATOR = "PED-ANOVA (Optuna)"
MIN_TRIALS = 5  # fewer trials with a final metric than this rank nothing


_warming: list[threading.Thread] = []


def warm() -> None:
    """Start importing Optuna's importance evaluators on a thread of their own, once: a page
    that will ask for importance soon (the comparison) finds them loaded (the import takes a
    second or two, the computation a fraction of that)."""
    if not _warming and "optuna.importance" not in sys.modules:
        thread = threading.Thread(target=_import_optuna, name="optuna-import", daemon=True)
        _warming.append(thread)
        thread.start()


def _import_optuna() -> None:
    try:
        importlib.import_module("optuna.importance")
    except ImportError:
        pass  # importance() says that Optuna is needed


@dataclass(frozen=True)
class Importance:
    """Each parameter's importance (they add up to 1), most important first; ``error`` says why
    there is none."""

    evaluator: str
    trials: int
    importances: tuple[tuple[str, float], ...] = ()
    error: str = ""


def importance(
    rows: Sequence[tuple[Mapping[str, Any], float]], axes: Sequence[Axis], mode: str
) -> Importance:
    """The importance of each parameter of ``axes`` to the metric of ``rows`` ((parameters,
    final metric) pairs), for a study that ``mode`` ("maximize" or "minimize")."""
    try:
        import optuna
        from optuna.distributions import CategoricalDistribution, FloatDistribution
    except ImportError:
        return Importance(EVALUATOR, 0, error=f"parameter importance needs Optuna: {INSTALL}")
    rows = [(p, v) for p, v in rows if math.isfinite(v)]
    if len(rows) < MIN_TRIALS:
        return Importance(EVALUATOR, len(rows), error=f"{len(rows)} trial(s) with a final metric: too few to rank")
    distributions: dict[str, Any] = {}
    for axis in axes:
        if axis.kind == "category" and len(axis.categories) > 1:
            distributions[axis.name] = CategoricalDistribution(axis.categories)
        elif axis.kind != "category" and axis.low is not None and axis.high is not None and axis.high > axis.low:
            log = axis.kind == "log" or axis.source in LOG_TYPES
            distributions[axis.name] = FloatDistribution(axis.low, axis.high, log=log and axis.low > 0)
    if not distributions:
        return Importance(EVALUATOR, len(rows), error="no parameter takes more than one value")
    trials = []
    for params, value in rows:
        given = {name: _value(params.get(name), d) for name, d in distributions.items()}
        if any(v is None for v in given.values()):
            continue  # a trial without one of the parameters (a nested space's branch) is left out
        trials.append(optuna.trial.create_trial(params=given, distributions=distributions, value=value))
    if len(trials) < MIN_TRIALS:
        return Importance(EVALUATOR, len(trials), error=f"{len(trials)} trial(s) hold every parameter: too few")
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.WARNING)
    try:
        study = optuna.create_study(direction="maximize" if mode == "maximize" else "minimize")
        study.add_trials(trials)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PED-ANOVA's note that few trials make a coarse estimate
            found = optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(), normalize=True
            )
    finally:
        optuna.logging.set_verbosity(level)
    ranked = sorted(((str(k), float(v)) for k, v in found.items()), key=lambda kv: (-kv[1], kv[0]))
    return Importance(EVALUATOR, len(trials), tuple(ranked))


def _value(v: Any, distribution: Any) -> Any:
    from optuna.distributions import CategoricalDistribution

    from .space import label

    if v is None:
        return None
    if isinstance(distribution, CategoricalDistribution):
        shown = label(v)
        return shown if shown in distribution.choices else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return min(max(float(v), distribution.low), distribution.high)
    return None


def edf(ranked: Sequence[tuple[float, int]], n: int) -> list[tuple[float, float]]:
    """The empirical distribution of ``n`` values from some of them in rank order ((value,
    rank) pairs, rank 1 the lowest): (value, fraction of the values at most it) each, a value
    that repeats at the last rank it holds."""
    out: list[tuple[float, float]] = []
    for value, rank in sorted(ranked, key=lambda vr: vr[1]):
        if out and out[-1][0] == value:
            out.pop()  # equal values: the point of the last of them
        out.append((float(value), rank / n))
    return out