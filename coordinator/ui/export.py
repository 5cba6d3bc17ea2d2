"""The trials table exported as CSV or JSON: the trials it shows (its filter, search, sort
or selection) with the columns it shows, every one of them, not just the rows in view.

Columns are named by the keys the table sorts by (``sequence``, ``id``, ``status``,
``metric``, ``duration``, ``started``, ``ended``, ``environment``, ``param:NAME``,
``result:KEY``) and ``latest`` (the latest intermediate result). Times are ISO 8601 in UTC."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from ..read import pages
from ..read.model import ReadModel, TrialSnapshot, to_json
from ..read.results import reported

FORMATS = {"csv": "text/csv", "json": "application/json"}
FIXED = ("sequence", "id", "status", "metric", "latest", "duration", "started", "ended", "environment")


def _time(at: float | None) -> str | None:
    return datetime.fromtimestamp(at, timezone.utc).isoformat() if at is not None else None


def _number(v: float | None) -> Any:
    return v if v is None or math.isfinite(v) else str(v)


BULK = 5000  # more trials than this: every trial's latest result read in one pass


def _column(model: ReadModel, key: str, many: bool) -> Callable[[TrialSnapshot], Any]:
    """How to read the column ``key`` of a trial; ``many``: a great many trials are exported."""
    if key.startswith(pages.PARAMETER_SORT):
        name = key[len(pages.PARAMETER_SORT):]
        return lambda t: to_json((t.parameters or {}).get(name))
    if key.startswith(pages.RESULT_SORT):
        name = key[len(pages.RESULT_SORT):]
        return lambda t: to_json(t.final_metric_value.get(name)) if isinstance(t.final_metric_value, dict) else None

    lasts: dict[str, Any] = {}

    def latest(t: TrialSnapshot) -> Any:
        if many and not lasts:  # every trial's at once: one pass over the results, not a query a trial
            lasts.update(model._read("metrics", lambda: model.store.last_metrics("intermediate")) or {"": None})
        last = (lasts.get(t.id) if many
                else model._read("metrics", lambda: model.store.last_metric(t.id, "intermediate")))
        return to_json(reported(last.value, last.value_json)) if last is not None else None

    return {
        "sequence": lambda t: t.sequence_id,
        "id": lambda t: t.id,
        "status": lambda t: t.status.value if t.status else None,
        "metric": lambda t: _number(t.final_metric),
        "latest": latest,
        "duration": lambda t: (t.ended_at - t.started_at) if t.started_at is not None and t.ended_at is not None
        else None,
        "started": lambda t: _time(t.started_at),
        "ended": lambda t: _time(t.ended_at),
        "environment": lambda t: t.environment_id,
    }[key]


def columns_of(model: ReadModel, query: Mapping[str, str]) -> list[str]:
    """The columns asked for (``columns``, comma-separated), checked; the table's own when none."""
    asked = [c for c in query.get("columns", "").split(",") if c]
    if not asked:
        return [*FIXED, *(pages.PARAMETER_SORT + n for n in pages.parameter_names(model))]
    for c in asked:
        prefixed = c.startswith((pages.PARAMETER_SORT, pages.RESULT_SORT)) and c.split(":", 1)[1]
        if c not in FIXED and not prefixed:
            raise ValueError(
                f"columns: {c!r} is not one of {', '.join(FIXED)}, {pages.PARAMETER_SORT}NAME or {pages.RESULT_SORT}KEY"
            )
    return asked


def export(model: ReadModel, query: Mapping[str, str]) -> tuple[bytes, str, str]:
    """The trials ``query`` selects (as ``/api/trials`` takes it, and ``ids``), as a file:
    (its bytes, its content type, a file name)."""
    kind = query.get("format", "csv")
    if kind not in FORMATS:
        raise ValueError(f"format: {kind!r} is not csv or json")
    columns = columns_of(model, query)
    chosen: dict[str, Any] = {
        "status": query.get("status") or None, "environment": query.get("environment") or None,
        "search": query.get("q", ""), "sort": query.get("sort", "sequence"),
        "descending": query.get("order", "asc") == "desc", "ids": [i for i in query.get("ids", "").split(",") if i],
    }
    many = pages.trial_page(model, limit=0, **chosen).total > BULK
    getters = [_column(model, c, many) for c in columns]
    trials = pages.every_trial(model, **chosen)
    out = io.StringIO()
    if kind == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for t in trials:
            writer.writerow(["" if v is None else _cell(v) for v in (get(t) for get in getters)])
    else:
        out.write("[")
        for n, t in enumerate(trials):
            out.write(("," if n else "") + "\n" + json.dumps(dict(zip(columns, (get(t) for get in getters)))))
        out.write("\n]\n")
    exp = model.experiment()
    name = f"{exp.id if exp else 'experiment'}-trials.{kind}"
    return out.getvalue().encode(), FORMATS[kind], name


def _cell(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v
