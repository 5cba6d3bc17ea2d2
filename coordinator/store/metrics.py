"""How the store keeps metrics: a run of results (one trial, one kind, consecutive indexes)
is one row of ``metric_runs``, its numbers packed as doubles, so that a trial reporting in a
tight loop costs one row per message rather than one per result. Stores written before runs
keep a row per result in ``metrics``; both tables are read, and a result in both (a replay)
is read once.
"""

from __future__ import annotations

import json
import sqlite3
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import chain, groupby
from operator import attrgetter
from typing import Any

from ..engine.rows import MetricRow, MetricRun

SCHEMA = """
CREATE TABLE IF NOT EXISTS metric_runs (
    trial_id TEXT NOT NULL,
    idx INTEGER NOT NULL,     -- the index of the first result
    n INTEGER NOT NULL,       -- how many results, with indexes idx .. idx + n - 1
    kind TEXT NOT NULL,
    vals BLOB NOT NULL,       -- n doubles, little-endian
    value_json TEXT,          -- NULL where each value's JSON is its repr; else a JSON list ("" for a repr)
    reported_at BLOB NOT NULL, -- n doubles, little-endian
    PRIMARY KEY (trial_id, idx)
) WITHOUT ROWID;
"""

_LITTLE = sys.byteorder == "little"
_INSERT = "INSERT INTO metric_runs VALUES (?, ?, ?, ?, ?, ?, ?)"
_by_trial_and_index = attrgetter("trial_id", "index")


def _pack(numbers: Sequence[float]) -> bytes:
    packed = array("d", numbers)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _unpack(data: bytes) -> array[float]:
    numbers = array("d")
    numbers.frombytes(data)
    if not _LITTLE:
        numbers.byteswap()
    return numbers


# Per trial, the end of the last run this process stored, up to this many trials: a run that
# starts there or later (a trial's next results, the common case) overlaps nothing stored.
MAX_KNOWN_ENDS = 100_000


def insert(db: sqlite3.Connection, runs: Iterable[MetricRun], known_ends: dict[str, int]) -> int:
    """Store ``runs``, one row each, less any result stored before (a replay: the first
    write of a trial's index wins, and runs never overlap). ``known_ends``: the end of each
    trial's last run stored by this process, kept up to date here. Returns how many results
    were added."""
    added = 0
    for r in runs:
        start, end = r.first_index, r.first_index + len(r.values)
        if start == end:
            continue
        known = known_ends.get(r.trial_id)
        if len(known_ends) >= MAX_KNOWN_ENDS and known is None:
            known_ends.clear()
        known_ends[r.trial_id] = max(end, known or 0)
        if known is not None and start >= known:
            _insert(db, r)
            added += end - start
            continue
        covered = [
            (idx, idx + n)
            for idx, n in chain(
                db.execute(_RUN_AT_OR_BEFORE, (r.trial_id, start)), db.execute(_RUNS_WITHIN, (r.trial_id, start, end))
            )
            if idx + n > start
        ]
        if not covered:  # the common case: nothing of it stored yet
            _insert(db, r)
            added += end - start
            continue
        at = start
        for lo, hi in sorted(covered):
            if lo > at:
                _insert(db, _part(r, at, lo))
                added += lo - at
            at = max(at, hi)
        if at < end:
            _insert(db, _part(r, at, end))
            added += end - at
    return added


_RUN_AT_OR_BEFORE = "SELECT idx, n FROM metric_runs WHERE trial_id = ? AND idx <= ? ORDER BY idx DESC LIMIT 1"
_RUNS_WITHIN = "SELECT idx, n FROM metric_runs WHERE trial_id = ? AND idx > ? AND idx < ?"


def _insert(db: sqlite3.Connection, r: MetricRun) -> None:
    jsons = json.dumps(list(r.value_jsons), separators=(",", ":")) if r.value_jsons is not None else None
    db.execute(
        _INSERT, (r.trial_id, r.first_index, len(r.values), r.kind, _pack(r.values), jsons, _pack(r.reported_at))
    )


def _part(r: MetricRun, lo: int, hi: int) -> MetricRun:
    """The results of ``r`` with indexes lo .. hi - 1."""
    a, b = lo - r.first_index, hi - r.first_index
    jsons = r.value_jsons[a:b] if r.value_jsons is not None else None
    return r._replace(first_index=lo, values=r.values[a:b], value_jsons=jsons, reported_at=r.reported_at[a:b])


def _expand(row: sqlite3.Row | tuple) -> Iterable[MetricRow]:
    trial_id, idx, n, kind, vals, value_json, reported_at = row
    values, ats = _unpack(vals), _unpack(reported_at)
    jsons = json.loads(value_json) if value_json is not None else None
    for k in range(n):
        value = values[k]
        given = jsons[k] if jsons is not None else ""
        yield MetricRow(trial_id, idx + k, kind, value, given or repr(value), ats[k])


def _newest(row: sqlite3.Row | tuple) -> MetricRow:
    """The last result of a run (what :func:`_expand` gives last, without the others)."""
    trial_id, idx, n, kind, vals, value_json, reported_at = row
    (value,) = _DOUBLE.unpack_from(vals, 8 * (n - 1))
    (at,) = _DOUBLE.unpack_from(reported_at, 8 * (n - 1))
    given = json.loads(value_json)[n - 1] if value_json is not None else ""
    return MetricRow(trial_id, idx + n - 1, kind, value, given or repr(value), at)


_DOUBLE = struct.Struct("<d")  # a double of a packed run (little-endian, as _pack stores them)


def read(db: sqlite3.Connection, where: str, args: Sequence[object], *, has_runs: bool) -> list[MetricRow]:
    """The metrics of the trials ``where`` selects (a condition on ``trial_id``), by trial
    and index, from both tables; one row per (trial, index)."""
    plain = [
        MetricRow(*r)
        for r in db.execute(
            f"SELECT trial_id, idx, kind, value, value_json, reported_at FROM metrics {where} ORDER BY trial_id, idx",
            args,
        )
    ]
    if not has_runs:
        return plain
    runs = db.execute(f"SELECT * FROM metric_runs {where} ORDER BY trial_id, idx", args).fetchall()
    if not runs:
        return plain
    # Sorted (in linear time, as it mostly is) and each index once: a result may be in both
    # tables, or in two runs that a replay split differently.
    rows = sorted(chain(plain, chain.from_iterable(map(_expand, runs))), key=_by_trial_and_index)
    return [next(same) for _, same in groupby(rows, key=_by_trial_and_index)]


def last(db: sqlite3.Connection, trial_id: str, kind: str, *, has_runs: bool) -> MetricRow | None:
    """The trial's result of ``kind`` with the highest index, from either table."""
    row = db.execute(
        "SELECT trial_id, idx, kind, value, value_json, reported_at FROM metrics"
        " WHERE trial_id = ? AND kind = ? ORDER BY idx DESC LIMIT 1", (trial_id, kind),
    ).fetchone()
    found = MetricRow(*row) if row else None
    if has_runs:
        run = db.execute(
            "SELECT * FROM metric_runs WHERE trial_id = ? AND kind = ? ORDER BY idx DESC LIMIT 1", (trial_id, kind)
        ).fetchone()
        if run is not None:
            *_, newest = _expand(run)
            if found is None or newest.index > found.index:
                found = newest
    return found


def last_of_each(db: sqlite3.Connection, kind: str, *, has_runs: bool) -> dict[str, MetricRow]:
    """Each trial's result of ``kind`` with the highest index, in one pass over both tables."""
    found = {
        r[0]: MetricRow(*r)
        for r in db.execute(
            "SELECT m.trial_id, m.idx, m.kind, m.value, m.value_json, m.reported_at FROM metrics m JOIN"
            " (SELECT trial_id, max(idx) AS idx FROM metrics WHERE kind = ? GROUP BY trial_id) l USING (trial_id, idx)",
            (kind,),
        )
    }
    if has_runs:
        for run in db.execute(
            "SELECT r.* FROM metric_runs r JOIN (SELECT trial_id, max(idx) AS idx FROM metric_runs WHERE kind = ?"
            " GROUP BY trial_id) l USING (trial_id, idx)", (kind,),
        ):
            newest = _newest(run)
            known = found.get(newest.trial_id)
            if known is None or newest.index > known.index:
                found[newest.trial_id] = newest
    return found


def newest_joined(kind: str, *, has_runs: bool) -> tuple[str, str, list[object]]:
    """SQL that reads each trial's result of ``kind`` with the highest index (what :func:`last`
    gives it) in the query of the trials, by their ids: (the columns to select, the joins,
    their arguments). :func:`newest_of` makes the result of the columns."""
    columns = ", newest.idx, newest.value, newest.value_json"
    joins = (
        "LEFT JOIN metrics AS newest ON newest.trial_id = trials.id AND newest.idx ="
        " (SELECT idx FROM metrics WHERE trial_id = trials.id AND kind = ? ORDER BY idx DESC LIMIT 1)"
    )
    if not has_runs:
        return columns + ", NULL, NULL, NULL, NULL", joins, [kind]
    columns += ", newest_run.idx, newest_run.n, newest_run.vals, newest_run.value_json"
    joins += (
        " LEFT JOIN metric_runs AS newest_run ON newest_run.trial_id = trials.id AND newest_run.idx ="
        " (SELECT idx FROM metric_runs WHERE trial_id = trials.id AND kind = ? ORDER BY idx DESC LIMIT 1)"
    )
    return columns, joins, [kind, kind]


#: How many columns :func:`newest_joined` selects.
NEWEST_COLUMNS = 7


def newest_of(columns: Sequence[Any]) -> tuple[float, str] | None:
    """The (value, JSON) of the result :func:`newest_joined` read (its columns), as :func:`last`
    gives them; None when the trial has none. (A run's JSON is "" where it is the value's repr.)"""
    idx, value, value_json, run_idx, n, vals, run_jsons = columns
    if run_idx is not None and (idx is None or run_idx + n - 1 > idx):
        (number,) = _DOUBLE.unpack_from(vals, 8 * (n - 1))
        return number, json.loads(run_jsons)[n - 1] if run_jsons is not None else ""
    if idx is None:
        return None
    return value, value_json


def next_index(db: sqlite3.Connection, trial_id: str, *, has_runs: bool) -> int:
    """The index after the trial's last stored result (0 when it has none)."""
    (n,) = db.execute("SELECT coalesce(max(idx) + 1, 0) FROM metrics WHERE trial_id = ?", (trial_id,)).fetchone()
    if has_runs:
        (m,) = db.execute(
            "SELECT coalesce(max(idx + n), 0) FROM metric_runs WHERE trial_id = ?", (trial_id,)
        ).fetchone()
        n = max(n, m)
    return int(n)


def count(db: sqlite3.Connection, *, has_runs: bool) -> int:
    """How many results are stored, counted (slow on a large store: the store keeps a count)."""
    (n,) = db.execute("SELECT count(*) FROM metrics").fetchone()
    if has_runs:
        (m,) = db.execute("SELECT coalesce(sum(n), 0) FROM metric_runs").fetchone()
        n += m
    return int(n)
