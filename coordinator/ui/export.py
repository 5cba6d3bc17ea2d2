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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .. import TrialStatus  # the public API
from ..read import pages
from ..read.model import ReadModel, loads_or_none, to_json
from ..read.results import reported

FORMATS = {"csv": "text/csv", "json": "application/json"}
FIXED = ("sequence", "id", "status", "metric", "latest", "duration", "started", "ended", "environment")
BULK = 5000  # more trials than this: every trial's latest result read in one pass
CHUNK = 2000  # trials a piece of the file holds, as it is written

# What the file is written from: these columns of each stored trial, read as the read
# model reads them (rows.py), without a snapshot a trial. Their places in a row:
STORED = ("seq", "id", "status", "final_metric", "started_at", "ended_at", "environment_id", "parameters_json",
          "final_metric_json")
SEQ, ID, STATUS, METRIC, STARTED, ENDED, ENV, PARAMS, RESULT = range(len(STORED))
_KNOWN = frozenset(s.value for s in TrialStatus)


class _Row:
    """One stored trial's values, read as the read model reads them: a value of the wrong type
    is None (the snapshot's ``unreadable`` would say why); its JSON parsed once, when asked."""

    __slots__ = ("_parameters", "_result", "raw")

    def __init__(self, raw: tuple[Any, ...]) -> None:
        self.raw = raw
        self._parameters: Any = _UNREAD
        self._result: Any = _UNREAD

    def number(self, i: int) -> float | None:
        v = self.raw[i]
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    def text(self, i: int) -> str:
        v = self.raw[i]
        return v if isinstance(v, str) else ""

    @property
    def parameters(self) -> Mapping[str, Any]:
        if self._parameters is _UNREAD:
            value = loads_or_none(self.raw[PARAMS])
            self._parameters = value if isinstance(value, dict) else {}
        return self._parameters

    @property
    def result(self) -> Any:
        if self._result is _UNREAD:
            self._result = loads_or_none(self.raw[RESULT])
        return self._result


_UNREAD = object()


def _time(at: float | None) -> str | None:
    return datetime.fromtimestamp(at, timezone.utc).isoformat() if at is not None else None


def _number(v: float | None) -> Any:
    return v if v is None or math.isfinite(v) else str(v)


def _duration(r: _Row) -> float | None:
    started, ended = r.number(STARTED), r.number(ENDED)
    return ended - started if started is not None and ended is not None else None


def _column(model: ReadModel, key: str, many: bool) -> Callable[[_Row], Any]:
    """How to read the column ``key`` of a stored trial; ``many``: a great many trials are exported."""
    if key.startswith(pages.PARAMETER_SORT):
        name = key[len(pages.PARAMETER_SORT):]
        return lambda r: to_json(r.parameters.get(name))
    if key.startswith(pages.RESULT_SORT):
        name = key[len(pages.RESULT_SORT):]
        return lambda r: to_json(r.result.get(name)) if isinstance(r.result, dict) else None

    lasts: dict[str, Any] = {}

    def latest(r: _Row) -> Any:
        if many and not lasts:  # every trial's at once: one pass over the results, not a query a trial
            lasts.update(model._read("metrics", lambda: model.store.last_metrics("intermediate")) or {"": None})
        tid = r.text(ID)
        last = (lasts.get(tid) if many
                else model._read("metrics", lambda: model.store.last_metric(tid, "intermediate")))
        return to_json(reported(last.value, last.value_json)) if last is not None else None

    def seq(r: _Row) -> int | None:
        v = r.raw[SEQ]
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return {
        "sequence": seq,
        "id": lambda r: r.text(ID),
        "status": lambda r: r.raw[STATUS] if r.raw[STATUS] in _KNOWN else None,
        "metric": lambda r: _number(r.number(METRIC)),
        "latest": latest,
        "duration": _duration,
        "started": lambda r: _time(r.number(STARTED)),
        "ended": lambda r: _time(r.number(ENDED)),
        "environment": lambda r: r.text(ENV) or None,
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


@dataclass(frozen=True)
class Plan:
    """An export asked for, checked: its format, columns, the trials it selects, and its file."""

    kind: str
    columns: list[str]
    chosen: dict[str, Any]
    total: int  # trials it selects
    content_type: str
    name: str


def plan(model: ReadModel, query: Mapping[str, str]) -> Plan:
    """The export ``query`` asks for (the trials it selects as ``/api/trials`` takes them, and
    ``ids``), checked before a byte is written: a bad one raises ValueError (or PageError)."""
    kind = query.get("format", "csv")
    if kind not in FORMATS:
        raise ValueError(f"format: {kind!r} is not csv or json")
    columns = columns_of(model, query)
    chosen: dict[str, Any] = {
        "status": query.get("status") or None, "environment": query.get("environment") or None,
        "search": query.get("q", ""), "sort": query.get("sort", "sequence"),
        "descending": query.get("order", "asc") == "desc", "ids": [i for i in query.get("ids", "").split(",") if i],
    }
    total = pages.trial_page(model, limit=0, **chosen).total  # (which checks the status and the sort)
    exp = model.experiment()
    return Plan(kind, columns, chosen, total, FORMATS[kind], f"{exp.id if exp else 'experiment'}-trials.{kind}")


def pieces(model: ReadModel, p: Plan) -> Iterator[str]:
    """The file, in pieces of :data:`CHUNK` trials, written from the stored rows as read."""
    many = p.total > BULK
    getters = [_column(model, c, many) for c in p.columns]
    # The columns whose values may be a dict or a list (a cell of JSON text in a CSV file).
    nested = [i for i, c in enumerate(p.columns) if c == "latest" or c.startswith((pages.PARAMETER_SORT,
                                                                                     pages.RESULT_SORT))]
    rows = map(_Row, pages.every_trial_values(model, STORED, **p.chosen))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if p.kind == "csv":
        writer.writerow(p.columns)
    else:
        out.write("[")
    for n, r in enumerate(rows):
        values = [get(r) for get in getters]
        if p.kind == "csv":
            for i in nested:
                values[i] = _cell(values[i])
            writer.writerow(values)
        else:
            out.write(("," if n else "") + "\n" + json.dumps(dict(zip(p.columns, values))))
        if n % CHUNK == CHUNK - 1:
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    if p.kind == "json":
        out.write("\n]\n")
    yield out.getvalue()


def export(model: ReadModel, query: Mapping[str, str]) -> tuple[bytes, str, str]:
    """The trials ``query`` selects as a file: (its bytes, its content type, a file name)."""
    p = plan(model, query)
    return "".join(pieces(model, p)).encode(), p.content_type, p.name


def _cell(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v  # (None: csv writes "")
