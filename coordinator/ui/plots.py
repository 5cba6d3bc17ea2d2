"""The comparison page's JSON answers: curves of chosen trials, the parameters of a sample of
trials with the axis each should be drawn on, the final metric's distribution, the Pareto
front, and each parameter's importance. Built from read-model reads only, each bounded
whatever the experiment's size (a sample, a cache)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..read import analysis, pages, pareto
from ..read.kept import Kept
from ..read.model import ReadModel, TrialSnapshot, to_json
from ..read.space import Axis, search_space
from ..read.space import axes as parameter_axes
from .views import SERIES_POINTS, config_mode, thin

CURVES = 100  # trials whose intermediate curves the comparison draws
CHOSEN_MAX = 100  # trials one may pick to compare
SCATTER_TRIALS = 2000  # trials the parameter charts draw
IMPORTANCE_TRIALS = 1000  # trials importance is computed over (spread evenly when there are more)
STOPPED = ("EARLY_STOPPED", "USER_CANCELED", "SYS_CANCELED")  # ended, maybe without a final metric
_cache_lock = threading.Lock()  # importance's cache below: answers are built on several threads


_compared: Kept[dict[str, Any]] = Kept()


def compare(model: ReadModel, query: Mapping[str, str]) -> dict[str, Any]:
    """Curves of the trials asked for (``ids``, comma-separated), else of the best and latest;
    a sample of every trial's parameters and metric, with each parameter's axis. Kept until
    the trials change (a submitted trial, a status, a result)."""
    ids = query.get("ids", "")
    answer = _compared.get(model, ("compare", ids), lambda: _compare(model, ids))
    analysis.warm()  # the page asks for importance next: its import starts now, as this answer goes
    return answer


def _compare(model: ReadModel, asked: str) -> dict[str, Any]:
    config = model.stored_config()
    mode = config_mode(config)
    ids = [i for i in asked.split(",") if i][:CHOSEN_MAX]
    total = sum(model.trial_counts().values())
    if ids:
        found = [t for t in (model.trial(i) for i in ids) if t is not None]
        missing = sorted(set(ids) - {t.id for t in found})
        if missing:
            raise ValueError(f"ids: no trial {', '.join(missing)}")
        chosen = found
        title = f"Intermediate results of the {len(chosen)} selected trial{'s' if len(chosen) != 1 else ''}"
    else:
        half = CURVES // 2
        best = pages.trial_page(model, sort="metric", descending=mode == "maximize", limit=half).trials
        latest = pages.trial_page(model, sort="sequence", descending=True, limit=half).trials
        chosen = list({t.id: t for t in (*best, *latest)}.values())
        title = (f"Intermediate results of every trial ({total})" if len(chosen) >= total
                 else f"Intermediate results of the {len(best)} best and the {len(latest)} latest trials")
    curves = pages.curves(model, [t.id for t in chosen])
    sample = pages.sample(model, SCATTER_TRIALS)
    names = list(pages.parameter_names(model))
    rows = [_sampled(model, t) for t in sample]
    seen: dict[str, list[Any]] = {n: [] for n in names}
    for t in sample:
        for n in names:
            if n in (t.parameters or {}):
                seen[n].append((t.parameters or {})[n])
    finals, ranked = _final_metric_ranks(model)
    sampled = len(sample) < total
    return {
        "optimize_mode": mode,
        "parameters": names,
        "axes": [to_json(a) for a in parameter_axes(search_space(config), names, seen)],
        "curves_title": title,
        "selected": [t.id for t in chosen] if ids else [],
        "curves": [
            {"id": t.id, "status": t.status.value if t.status else None, "final_metric": t.final_metric,
             "values": thin(list(curves.get(t.id, ())), SERIES_POINTS)}
            for t in chosen if curves.get(t.id)
        ],
        "trials": rows,
        "sampled": sampled,
        "edf": analysis.edf(ranked, finals),
        "edf_trials": finals,
        "pareto": _pareto(config, sample, sampled=sampled),
    }


_ranks: Kept[tuple[int, list[tuple[float, int]]]] = Kept(16)


def _final_metric_ranks(model: ReadModel) -> tuple[int, list[tuple[float, int]]]:
    """The final metrics' distribution (read over every trial with one), read again once the
    store's trials or results changed, as the comparison that draws it is (a final metric
    can be written before its trial's status moves)."""
    return _ranks.get(model, "final metric ranks",
                      lambda: model.read("trials", lambda: model.store.final_metric_ranks(SERIES_POINTS)))


def _pareto(config: Mapping[str, Any] | None, sample: tuple[TrialSnapshot, ...], *, sampled: bool) -> Any:
    """With several objectives: each sampled trial's first two objectives, and whether it is on
    the Pareto front of all of them (among the trials sampled); None with one objective."""
    objectives = pareto.objectives_of(config)
    if not objectives.several:
        return None
    front = {t.id for t in pareto.pareto_front(sample, objectives)}
    points = []
    for t in sample:
        values = objectives.values(t.final_metric_value if t.final_metric_value is not None else t.final_metric)
        if values is not None:
            points.append([t.id, values[0], values[1], t.id in front])
    return {
        "objectives": list(objectives.keys[:2]), "all_objectives": list(objectives.keys),
        "maximize": [d == "maximize" for d in objectives.directions[:2]], "points": points,
        "trials": len(sample), "sampled": sampled,
    }


def _sampled(model: ReadModel, t: TrialSnapshot) -> dict[str, Any]:
    """A trial as the parameter charts take it: an early-stopped one (no final metric) with its
    last intermediate result in its place, marked ``stopped``."""
    status = t.status.value if t.status else None
    value, stopped = t.final_metric, False
    if value is None and status in STOPPED:
        last = model.read("metrics", lambda: model.store.last_metric(t.id, "intermediate"))
        if last is not None and isinstance(last.value, (int, float)):
            value, stopped = float(last.value), True
    return {"id": t.id, "status": status, "final_metric": t.final_metric, "value": value, "stopped": stopped,
            "parameters": t.parameters or {}}


# Importance is computed once for each state of the trials: a finished experiment's once.
_cache: dict[str, tuple[Any, dict[str, Any], float]] = {}  # experiment -> (its trials' state, answer, when)
RECOMPUTE_S = 30.0


@dataclass(frozen=True)
class Pending:
    """What an importance not cached yet is computed from: read from the store, computed
    after (away from the thread that reads, as it takes a while)."""

    where: str
    key: Any
    rows: list[tuple[Mapping[str, Any], float]]
    axes: list[Axis]
    mode: str
    total: int


def importance(model: ReadModel) -> dict[str, Any]:
    """Each parameter's importance to the final metric (see :func:`importance_input`)."""
    found = importance_input(model)
    return importance_of(found) if isinstance(found, Pending) else found


def importance_input(model: ReadModel) -> dict[str, Any] | Pending:
    """The answer when the trials are as they were when it was computed; else what to compute
    it from: at most ``IMPORTANCE_TRIALS`` trials with a final metric, spread evenly."""
    counts = model.trial_counts()
    key = model.changes()  # moves whenever a trial or a result is written
    where = str(model.experiment_dir)
    with _cache_lock:
        cached = _cache.get(where)
    # The same trials: the same answer. Trials that changed (a running experiment's) are
    # looked at again at most every RECOMPUTE_S, the answer saying over how many it was made.
    if cached is not None and (cached[0] == key or time.monotonic() - cached[2] < RECOMPUTE_S):
        return cached[1]
    config = model.stored_config()
    sample = [t for t in pages.sample(model, IMPORTANCE_TRIALS) if t.final_metric is not None]
    names = list(pages.parameter_names(model))
    seen = {n: [(t.parameters or {})[n] for t in sample if n in (t.parameters or {})] for n in names}
    rows = [(t.parameters or {}, t.final_metric) for t in sample if t.final_metric is not None]
    return Pending(where, key, rows, parameter_axes(search_space(config), names, seen), config_mode(config),
                   sum(counts.values()))


def importance_of(pending: Pending) -> dict[str, Any]:
    """The importance computed, and kept for as long as the trials stay as they are."""
    found = analysis.importance(pending.rows, pending.axes, pending.mode)
    answer = {
        "evaluator": found.evaluator, "trials": found.trials, "of": pending.total,
        "importances": [list(kv) for kv in found.importances], "error": found.error,
    }
    with _cache_lock:
        if len(_cache) > 16:
            _cache.clear()
        _cache[pending.where] = (pending.key, answer, time.monotonic())
    return answer
