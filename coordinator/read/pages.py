"""The read model's paged and charted reads, which a dashboard over 100,000 trials needs:
trials filtered, searched, sorted and paged in the store, an even sample of them, the charts
over time counted and thinned in the store, curves and GPU series.

Functions of a :class:`ReadModel` (and of nothing else): like its snapshots, what they
return is read from the store, never raises for a bad row, and reads the same of a live,
finished or crashed experiment."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..engine.states import TrialStatus
from ..store import metrics as metricstore
from .kept import Kept
from .model import ReadModel
from .rows import _sane, trial_snapshot
from .snapshots import TrialSnapshot


@dataclass(frozen=True)
class TrialPage:
    """One page of trials, filtered and sorted, and how many trials match in all."""

    total: int
    offset: int
    trials: tuple[TrialSnapshot, ...]


@dataclass(frozen=True)
class EndedPoint:
    """A point of the charts over time: when, trials ended by then, best metric by then."""

    at: float
    ended: int
    best: float | None


@dataclass(frozen=True)
class GpuPoint:
    """One stored GPU sample."""

    at: float
    environment_id: str
    uuid: str
    utilization_percent: float
    memory_used_bytes: int
    memory_total_bytes: int
    trial_ids: tuple[str, ...]


class PageError(ValueError):
    """A page asked for with a sort key or status the read model does not know."""


# The columns a page of trials sorts by: a key, and the SQL it sorts on.
TRIAL_SORTS: Mapping[str, str] = MappingProxyType({
    "sequence": "seq",
    "id": "id",
    "status": "status",
    "metric": "final_metric",
    "duration": "(CASE WHEN ended_at IS NULL THEN NULL ELSE ran_s END)",  # an ended trial's, all its attempts
    "submitted": "submitted_at",
    "started": "started_at",
    "ended": "ended_at",
    "environment": "environment_id",
})
UNTIMED = "(ended_at - started_at)"  # the duration in a store from before ran_s (read, not written)
PARAMETER_SORT = "param:"  # followed by a parameter's name
RESULT_SORT = "result:"  # followed by a key of dict final results
MAX_PAGE = 1000  # the most trials one page holds


def trial_page(
    model: ReadModel,
    *,
    status: str | None = None,
    environment: str | None = None,
    search: str = "",
    sort: str = "sequence",
    descending: bool = False,
    offset: int = 0,
    limit: int = 100,
    ids: Sequence[str] = (),
) -> TrialPage:
    """A page of trials: those of ``status`` (any when None), placed last on ``environment``
    (any when None), whose id, parameters or environment contain ``search``, among ``ids``
    when given, sorted by a key of :data:`TRIAL_SORTS`, by ``param:NAME`` or by ``result:KEY``
    (a key of dict final results); trials without a value for the key come last either way."""
    where, args, key, key_args = _selection(status, environment, search, sort, ids, model)
    offset, limit = max(0, int(offset)), max(0, min(int(limit), MAX_PAGE))
    if key_args:
        # By a parameter or a result key, SQLite reads the key out of every trial's JSON: the
        # order is kept (until the trials change), and each page is a slice of it.
        asked = {"where": where, "args": args, "key": key, "key_args": key_args, "descending": descending}
        order = _orders.get(model, repr(sorted(asked.items())), lambda: model.read(
            "trials", lambda: model.store.trial_order(**asked)
        ))
        page = order[offset:offset + limit]
        total, rows = len(order), model.read("trials", lambda: model.store.trials_by_rowid(page))
    else:
        total, rows = model.read("trials", lambda: model.store.trials_page(
            where=where, args=args, key=key, key_args=key_args, descending=descending, offset=offset, limit=limit,
        ))
    return TrialPage(total=total, offset=offset, trials=tuple(trial_snapshot(r) for r in rows))


_orders: Kept[list[int]] = Kept(size=8)  # trials sorted by a key of their JSON: their row ids


def every_trial(
    model: ReadModel, *, status: str | None = None, environment: str | None = None, search: str = "",
    sort: str = "sequence", descending: bool = False, ids: Sequence[str] = (),
) -> Iterator[TrialSnapshot]:
    """Every trial :func:`trial_page` would page through, in its order, read as they are used."""
    where, args, key, key_args = _selection(status, environment, search, sort, ids, model)
    rows = model.read("trials", lambda: model.store.trials_sorted(
        where=where, args=args, key=key, key_args=key_args, descending=descending,
    ))
    while True:
        row = model.read("trials", lambda: next(rows, None))
        if row is None:
            return
        yield trial_snapshot(row)


def every_trial_values(
    model: ReadModel, columns: Sequence[str], size: int, *, status: str | None = None, environment: str | None = None,
    search: str = "", sort: str = "sequence", descending: bool = False, ids: Sequence[str] = (),
    newest: str | None = None,
) -> Iterator[list[tuple[Any, ...]]]:
    """The stored ``columns`` of every trial :func:`every_trial` would give, in its order, as
    the store holds them (unchecked: the caller reads them as :mod:`.rows` does), read as used,
    in lists of ``size`` trials (the last may hold fewer). ``newest``: a kind of result; each
    trial's newest, read in the same query, follows its columns (:func:`newest_result` reads it)."""
    where, args, key, key_args = _selection(status, environment, search, sort, ids, model)
    rows = model.read("trials", lambda: model.store.trial_values_sorted(
        columns, where=where, args=args, key=key, key_args=key_args, descending=descending, newest=newest,
    ))
    n = len(columns) + (metricstore.NEWEST_COLUMNS if newest is not None else 0)
    while some := model.read("trials", lambda: rows.fetchmany(size)):
        yield [row[:n] for row in some]


def newest_result(row: tuple[Any, ...], at: int) -> tuple[float, str] | None:
    """The (value, JSON) of the newest result :func:`every_trial_values` read with a trial (its
    row, from ``at``); None when it has none."""
    return metricstore.newest_of(row[at:at + metricstore.NEWEST_COLUMNS])


def _selection(
    status: str | None, environment: str | None, search: str, sort: str, ids: Sequence[str], model: ReadModel
) -> tuple[str, list[Any], str, list[Any]]:
    """The SQL that selects and sorts the trials asked for: (where, its arguments, sort key, its arguments)."""
    where, args = ["1=1"], []
    if status is not None:
        if status not in {s.value for s in TrialStatus}:
            raise PageError(f"status: {status!r} is not one of {', '.join(s.value for s in TrialStatus)}")
        where.append("status = ?")
        args.append(status)
    if environment is not None:
        where.append("environment_id = ?")
        args.append(environment)
    if search:
        pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        where.append(
            "(id LIKE ? ESCAPE '\\' OR parameters_json LIKE ? ESCAPE '\\'"
            " OR coalesce(environment_id, '') LIKE ? ESCAPE '\\')"
        )
        args += [pattern] * 3
    if ids:
        where.append(f"id IN ({','.join('?' * len(ids))})")
        args += list(ids)
    key_args: list[Any] = []
    if sort.startswith(PARAMETER_SORT) and len(sort) > len(PARAMETER_SORT):
        # A JSON path with the name quoted, so any name is one key.
        key = "(CASE WHEN json_valid(parameters_json) THEN json_extract(parameters_json, ?) END)"
        key_args = [f'$."{sort[len(PARAMETER_SORT):]}"']
    elif sort.startswith(RESULT_SORT) and len(sort) > len(RESULT_SORT):
        key = "(CASE WHEN json_valid(final_metric_json) THEN json_extract(final_metric_json, ?) END)"
        key_args = [f'$."{sort[len(RESULT_SORT):]}"']
    elif sort in TRIAL_SORTS:
        key = TRIAL_SORTS[sort] if sort != "duration" or "ran_s" in model.store.trial_columns else UNTIMED
    else:
        raise PageError(
            f"sort: {sort!r} is not one of {', '.join(TRIAL_SORTS)}, {PARAMETER_SORT}NAME or {RESULT_SORT}KEY"
        )
    return " AND ".join(where), args, key, key_args


def sample(model: ReadModel, n: int) -> tuple[TrialSnapshot, ...]:
    """About ``n`` trials spread evenly over the submission order (every one when fewer)."""
    total = sum(model.trial_counts().values())
    step = -(-total // n) if n > 0 else total + 1
    rows = model.read("trials", lambda: model.store.trials_every(step, n))
    return tuple(trial_snapshot(r) for r in rows)


def ended_series(model: ReadModel, mode: str, points: int = 400) -> tuple[EndedPoint, ...]:
    """How many trials had ended, and the best final metric so far, as trials ended:
    about ``points`` of them spread evenly over the time trials ended in (every end when fewer),
    each exact at its moment, the last always kept. Kept until the trials change."""
    return _series.get(model, ("ended", mode, points), lambda: tuple(
        EndedPoint(float(at), int(n), float(best) if best is not None else None)
        for at, n, best in model.read("trials", lambda: model.store.ended_series(mode == "maximize", points))
    ))


_series: Kept[tuple[EndedPoint, ...]] = Kept()


def parameter_names(model: ReadModel, recent: int = 1000) -> tuple[str, ...]:
    """The names of the parameters of the last ``recent`` trials."""
    return tuple(model.read("trials", lambda: model.store.parameter_names(recent)))


def result_keys(model: ReadModel, recent: int = 1000) -> tuple[str, ...]:
    """The keys of the dict final results of the last ``recent`` trials, ``default`` first."""
    keys = model.read("trials", lambda: model.store.result_keys(recent))
    return tuple(sorted(keys, key=lambda k: k != "default"))


def curves(model: ReadModel, trial_ids: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """Each of these trials' intermediate results, in the order they were reported."""
    out: dict[str, list[float]] = {t: [] for t in trial_ids}
    for m in model.read("metrics", lambda: model.store.metrics_of(list(trial_ids))):
        if m.kind == "intermediate" and isinstance(m.value, (int, float)):
            out[m.trial_id].append(float(m.value))
    return {t: tuple(v) for t, v in out.items()}


def gpu_series(
    model: ReadModel, *, environment_id: str | None = None, trial_id: str | None = None
) -> tuple[GpuPoint, ...]:
    """The stored GPU samples of an environment or of a trial, oldest first."""
    rows = model.read("GPU samples", lambda: model.store.gpu_samples(environment_id=environment_id, trial_id=trial_id))
    return tuple(
        GpuPoint(float(r.at), r.environment_id, r.uuid, float(r.utilization), int(r.memory_used_bytes),
                 int(r.memory_total_bytes), r.trial_ids)
        for r in rows if _sane(r)
    )
