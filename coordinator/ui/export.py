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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .. import TrialStatus  # the public API
from ..read import pages
from ..read.model import ReadModel, to_json
from ..read.results import reported

FORMATS = {"csv": "text/csv", "json": "application/json"}
FIXED = ("sequence", "id", "status", "metric", "latest", "duration", "started", "ended", "environment")
CHUNK = 2000  # trials a piece of the file holds, as it is written

# What the file is written from: these columns of each stored trial, read as the read model
# reads them (rows.py: a value of the wrong type is None, where the snapshot's ``unreadable``
# would say why), without a snapshot a trial. Their places in a row:
STORED = ("seq", "id", "status", "final_metric", "started_at", "ended_at", "environment_id", "parameters_json",
          "final_metric_json", "ran_s")
SEQ, ID, STATUS, METRIC, STARTED, ENDED, ENV, PARAMS, RESULT, RAN = range(len(STORED))
NEWEST = len(STORED)  # where a row's latest intermediate result, read with it, begins
_KNOWN = frozenset(s.value for s in TrialStatus)
_NUMBERS = (int, float)  # what SQLite gives for a number (never a bool)

Rows = list[tuple[Any, ...]]


def _loads(raw: Any) -> Any:
    """A stored JSON text's value, as :func:`loads_or_none` reads it (None when unreadable)."""
    if raw is None:
        return None
    try:
        return json.loads(raw) if isinstance(raw, (str, bytes)) else None
    except (ValueError, RecursionError):
        return None


def _numbers(rows: Rows, i: int) -> list[float | None]:
    return [float(v) if type(v) in _NUMBERS else None for v in (r[i] for r in rows)]


_LAST_SECOND = 253402300799.0  # 9999-12-31T23:59:59, datetime's last (from 0, the epoch, on: no sign to mind)
_SECONDS = tuple(f"{s:02d}" for s in range(60))


def _times(rows: Rows, i: int) -> list[str | None]:
    """Each time as ``datetime.fromtimestamp(v, timezone.utc).isoformat()`` writes it, the same
    characters, its minute written once for all the times in it (trials start and end by the
    dozen a minute): a time is a look-up and its seconds, not a datetime made and written."""
    utc = timezone.utc
    minutes: dict[int, str] = {}
    written: list[str | None] = []
    for v in _numbers(rows, i):
        if v is None or not 0.0 <= v < _LAST_SECOND:  # (NaN too: datetime says what is wrong)
            written.append(None if v is None else datetime.fromtimestamp(v, utc).isoformat())
            continue
        second = int(v)
        micro = round((v - second) * 1e6)  # rounded half to even, as datetime rounds
        if micro >= 1_000_000:
            second, micro = second + 1, micro - 1_000_000
        minute, s = divmod(second, 60)
        at = minutes.get(minute)
        if at is None:
            at = minutes[minute] = datetime.fromtimestamp(minute * 60, utc).isoformat()[:-8]  # less "SS+00:00"
        written.append(f"{at}{_SECONDS[s]}.{micro:06d}+00:00" if micro else f"{at}{_SECONDS[s]}+00:00")
    return written


class _Piece:
    """Some trials' stored rows, read column by column: each column's values are worked out in
    one pass over the rows, and each JSON text is parsed at most once."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows
        self._parameters: list[Mapping[str, Any]] | None = None
        self._results: list[Any] | None = None

    def parameters(self) -> list[Mapping[str, Any]]:
        if self._parameters is None:
            parsed = (_loads(r[PARAMS]) for r in self.rows)
            self._parameters = [p if isinstance(p, dict) else {} for p in parsed]
        return self._parameters

    def results(self) -> list[Any]:
        if self._results is None:
            self._results = [_loads(r[RESULT]) for r in self.rows]
        return self._results

    def latest(self) -> list[Any]:
        """Each trial's latest intermediate result, read with its row (after the ``STORED`` columns)."""
        got = (pages.newest_result(r, NEWEST) if isinstance(r[ID], str) else None for r in self.rows)
        return [to_json(reported(*last)) if last is not None else None for last in got]

    def column(self, key: str) -> list[Any]:
        rows = self.rows
        if key.startswith(pages.PARAMETER_SORT):
            name = key[len(pages.PARAMETER_SORT):]
            return [to_json(p.get(name)) for p in self.parameters()]
        if key.startswith(pages.RESULT_SORT):
            name = key[len(pages.RESULT_SORT):]
            return [to_json(r.get(name)) if isinstance(r, dict) else None for r in self.results()]
        if key == "sequence":
            return [v if type(v) is int else None for v in (r[SEQ] for r in rows)]
        if key == "id":
            return [v if isinstance(v, str) else "" for v in (r[ID] for r in rows)]
        if key == "status":
            return [v if v in _KNOWN else None for v in (r[STATUS] for r in rows)]
        if key == "metric":
            return [v if v is None or math.isfinite(v) else str(v) for v in _numbers(rows, METRIC)]
        if key == "latest":
            return self.latest()
        if key == "duration":  # an ended trial's, every attempt's (NULL ran_s: a store from before, its last)
            return [(e - s if ran is None else ran) if s is not None and e is not None else None
                    for s, e, ran in zip(_numbers(rows, STARTED), _numbers(rows, ENDED), _numbers(rows, RAN))]
        if key in ("started", "ended"):
            return _times(rows, STARTED if key == "started" else ENDED)
        assert key == "environment", key
        return [v if isinstance(v, str) and v else None for v in (r[ENV] for r in rows)]


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
    """The file, in pieces of :data:`CHUNK` trials, written from the stored rows as read: a
    piece's trials are read (each with its latest result, in the same query) before it is written."""
    # The columns whose values may be a dict or a list (a cell of JSON text in a CSV file).
    nested = {c for c in p.columns if c == "latest" or c.startswith((pages.PARAMETER_SORT, pages.RESULT_SORT))}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if p.kind == "csv":
        writer.writerow(p.columns)
    first = True
    newest = "intermediate" if "latest" in p.columns else None
    for some in pages.every_trial_values(model, STORED, CHUNK, newest=newest, **p.chosen):
        piece = _Piece(some)
        values = [piece.column(c) for c in p.columns]
        if p.kind == "csv":
            writer.writerows(zip(*(list(map(_cell, v)) if c in nested else v for c, v in zip(p.columns, values))))
        else:
            columns, dumps = p.columns, json.dumps
            out.write(("[" if first else ",") + "\n" + ",\n".join(dumps(dict(zip(columns, r))) for r in zip(*values)))
        first = False
        yield out.getvalue()
        out.seek(0)
        out.truncate()
    if p.kind == "json":
        yield ("[" if first else "") + "\n]\n"
    elif first:
        yield out.getvalue()  # the header alone


def export(model: ReadModel, query: Mapping[str, str]) -> tuple[bytes, str, str]:
    """The trials ``query`` selects as a file: (its bytes, its content type, a file name)."""
    p = plan(model, query)
    return "".join(pieces(model, p)).encode(), p.content_type, p.name


def _cell(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v  # (None: csv writes "")
