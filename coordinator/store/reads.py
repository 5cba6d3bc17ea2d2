"""Reading an experiment's store: every query the read side and the coordinator make.

:class:`StoreReader` opens the file read-only (``?mode=ro``): the CLI, the dashboard and the
read model read through it while a coordinator writes, and can write nothing. The writer,
:class:`~.store.Store`, is a reader that also writes.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..engine.rows import GpuSampleRow, MetricRow
from . import changes, checkpointrows
from . import metrics as metricstore

#: The store's file in an experiment's directory.
FILENAME = "trialkeeper.db"
# Columns of the trials table a store written before them lacks, read there as NULL.
LATER_COLUMNS = frozenset({"ran_s"})


class StoreError(RuntimeError):
    """The store cannot be opened or is not a trialkeeper store."""


def holds_experiment(directory: Path) -> bool:
    """Whether ``directory`` is an experiment's (holds a store)."""
    return (directory / FILENAME).is_file()


class StoreReader:
    """Reads one experiment's database file."""

    FILENAME = FILENAME

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.exists():
            raise StoreError(f"no experiment store at {path}")
        try:
            # as_uri() escapes what a URI would misread in a path ('?', '#', '%').
            uri = f"{path.absolute().as_uri()}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, timeout=10.0, check_same_thread=False)
            # Connecting reads nothing: check now that this is a store, so that a wrong file
            # fails here with a StoreError rather than at the first query.
            found = self._db.execute(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
            ).fetchone()[0]
            if not found:
                self._db.close()
                raise StoreError(f"{path} is not a trialkeeper store (it has no meta table)")
        except sqlite3.DatabaseError as e:
            with contextlib.suppress(AttributeError):
                self._db.close()
            raise StoreError(f"cannot open the experiment store {path}: {e}") from e
        self._opened()

    def _opened(self) -> None:
        self._db.row_factory = sqlite3.Row
        # A store written before metrics were kept in runs has none to read.
        self._has_runs = bool(self._db.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'metric_runs'"
        ).fetchone()[0])

    @property
    def trial_columns(self) -> frozenset[str]:
        """The trials table's columns: a store an earlier version wrote, read as it is, may lack
        some added since (``LATER_COLUMNS``)."""
        return frozenset(r[1] for r in self._db.execute("PRAGMA table_info(trials)"))

    @classmethod
    def in_dir(cls, experiment_dir: Path) -> StoreReader:
        return cls(experiment_dir / FILENAME)

    def close(self) -> None:
        self._db.close()

    def experiment(self) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM experiment LIMIT 1").fetchone()
        return dict(row) if row else None

    def meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def trials(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM trials ORDER BY seq")]

    def trial(self, trial_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM trials WHERE id = ?", (trial_id,)).fetchone()
        return dict(row) if row else None

    def trial_places(self) -> list[tuple[Any, Any, Any]]:
        """(id, environment id, status) of every trial, in submission order."""
        return [tuple(r) for r in self._db.execute("SELECT id, environment_id, status FROM trials ORDER BY seq")]

    def latest_trial_places(self, n: int, env_ids: Sequence[str] | None = None) -> list[tuple[Any, Any]]:
        """(id, environment id) of each environment's latest ``n`` trials (of those of
        ``env_ids`` when given, read from the index by environment), in submission order."""
        if env_ids is not None and self._has_index("trials", "trials_environment"):
            # A few entries of the index for each environment, rather than all of theirs.
            found = [tuple(r) for e in env_ids for r in self._db.execute(
                "SELECT seq, id, environment_id FROM trials WHERE environment_id = ? ORDER BY seq DESC LIMIT ?", (e, n)
            )]
            return [(tid, env) for _, tid, env in sorted(found, key=lambda r: r[0])]
        where, args = _among("environment_id", env_ids)
        return [tuple(r) for r in self._db.execute(
            "SELECT id, environment_id FROM (SELECT id, environment_id, seq, row_number() OVER "
            f"(PARTITION BY environment_id ORDER BY seq DESC) AS back FROM trials WHERE {where}) WHERE back <= ? "
            "ORDER BY seq", (*args, n),
        )]

    def _has_index(self, table: str, index: str) -> bool:
        """Whether the store has ``index`` (a store an earlier version made, opened read-only, may not)."""
        return any(r[1] == index for r in self._db.execute(f"PRAGMA index_list({table})"))

    def trials_per_environment(self, env_ids: Sequence[str] | None = None) -> dict[Any, int]:
        """How many trials were placed on each environment (of ``env_ids`` when given; None:
        on none yet)."""
        where, args = _among("environment_id", env_ids)
        return dict(self._db.execute(
            f"SELECT environment_id, count(*) FROM trials WHERE {where} GROUP BY environment_id", args
        ).fetchall())

    def checkpoints(self, trial_id: str | None = None, *, kept: bool = True) -> list[dict[str, Any]]:
        """Checkpoints as stored, oldest first (``kept``: those whose files are still there)."""
        return checkpointrows.rows(self._db, trial_id, kept=kept)

    def metric_history(self, trial_id: str) -> list[dict[str, Any]]:
        """Results of the trial that a run continued from a checkpoint replaced."""
        return checkpointrows.history(self._db, trial_id)

    def active_trials(self) -> list[dict[str, Any]]:
        """The trials waiting or running, in submission order."""
        return [
            dict(r)
            for r in self._db.execute("SELECT * FROM trials WHERE status IN ('WAITING', 'RUNNING') ORDER BY seq")
        ]

    def trial_counts(self) -> dict[str, int]:
        """How many trials hold each stored status."""
        return {str(s): int(n) for s, n in self._db.execute("SELECT status, count(*) FROM trials GROUP BY status")}

    def best_trial(self, descending: bool) -> dict[str, Any] | None:
        """The trial with the highest (or lowest) numeric final metric; the first submitted
        among equals."""
        # The range holds every number, infinities too, and neither NULL nor text (which SQLite
        # orders after numbers): the same rows as typeof() in ('real', 'integer'), read from the
        # index on final_metric rather than from every trial.
        row = self._db.execute(
            "SELECT * FROM trials WHERE final_metric BETWEEN -1e999 AND 1e999"
            f" ORDER BY final_metric {'DESC' if descending else 'ASC'}, seq LIMIT 1"
        ).fetchone()
        return dict(row) if row else None

    def trials_page(
        self,
        *,
        where: str,
        args: Sequence[Any],
        key: str,
        key_args: Sequence[Any],
        descending: bool,
        offset: int,
        limit: int,
    ) -> tuple[int, list[dict[str, Any]]]:
        """One page of trials sorted by ``key`` (rows without a value last) and how many match.
        ``where`` and ``key`` are SQL fragments the read model builds from a fixed set
        (values travel as arguments)."""
        (total,) = self._db.execute(f"SELECT count(*) FROM trials WHERE {where}", args).fetchone()
        direction = "DESC" if descending else "ASC"
        order = f"ORDER BY sort_key IS NULL, sort_key {direction}, seq {direction}"
        # The key is computed once a row (as sort_key), not once for each use in ORDER BY; and
        # only the key and the row's id are sorted, the page's whole rows read after (a parameter
        # sort over 100,000 trials takes a quarter of the time it took sorting whole rows).
        rows = self._db.execute(
            f"SELECT trials.*, page.sort_key FROM (SELECT rowid AS rid, {key} AS sort_key, seq FROM trials"
            f" WHERE {where} {order} LIMIT ? OFFSET ?) AS page JOIN trials ON trials.rowid = page.rid {order}",
            [*key_args, *args, limit, offset],
        ).fetchall()
        return int(total), [dict(r) for r in rows]

    def trial_order(
        self, *, where: str, args: Sequence[Any], key: str, key_args: Sequence[Any], descending: bool
    ) -> list[int]:
        """The row ids of every trial ``where`` selects, sorted as :meth:`trials_page` sorts."""
        direction = "DESC" if descending else "ASC"
        return [r[0] for r in self._db.execute(
            f"SELECT rowid, {key} AS sort_key FROM trials WHERE {where}"
            f" ORDER BY sort_key IS NULL, sort_key {direction}, seq {direction}",
            [*key_args, *args],
        )]

    def trials_by_rowid(self, rowids: Sequence[int]) -> list[dict[str, Any]]:
        """The trials of these row ids, in their order (one that is gone is left out)."""
        rows = {r["rowid"]: dict(r) for r in self._db.execute(
            "SELECT rowid, * FROM trials WHERE rowid IN (SELECT value FROM json_each(?))", (json.dumps(list(rowids)),)
        )}
        return [rows[i] for i in rowids if i in rows]

    def trials_sorted(
        self, *, where: str, args: Sequence[Any], key: str, key_args: Sequence[Any], descending: bool
    ) -> Iterator[dict[str, Any]]:
        """Every trial ``where`` selects, sorted as :meth:`trials_page` sorts, read as iterated."""
        direction = "DESC" if descending else "ASC"
        cursor = self._db.execute(
            f"SELECT trials.*, {key} AS sort_key FROM trials WHERE {where}"
            f" ORDER BY sort_key IS NULL, sort_key {direction}, seq {direction}",
            [*key_args, *args],
        )
        return (dict(r) for r in cursor)

    def trial_values_sorted(
        self, columns: Sequence[str], *, where: str, args: Sequence[Any], key: str, key_args: Sequence[Any],
        descending: bool, newest: str | None = None,
    ) -> sqlite3.Cursor:
        """The stored ``columns`` (names of the trials table) of every trial ``where`` selects,
        as tuples, sorted as :meth:`trials_page` sorts, read as iterated: what an export of a
        hundred thousand trials reads, without a whole row or a dict a trial. ``newest``: a kind
        of result, each trial's newest of which is read with it, in the
        :data:`~.metrics.NEWEST_COLUMNS` after ``columns`` (:func:`~.metrics.newest_of` reads them)."""
        known = self.trial_columns
        unknown = [c for c in columns if c not in known and c not in LATER_COLUMNS]
        if unknown:
            raise ValueError(f"columns: {', '.join(unknown)} are not columns of the trials table")
        direction = "DESC" if descending else "ASC"
        joined, joins, join_args = "", "", []
        if newest is not None:
            joined, joins, join_args = metricstore.newest_joined(newest, has_runs=self._has_runs)
        # In submission order (seq is never NULL, and unique), the rows come from seq's index as
        # they are read: the first before the last is read, with no sort of them all.
        order = f"seq {direction}" if key == "seq" else f"sort_key IS NULL, sort_key {direction}, seq {direction}"
        cursor = self._db.cursor()
        cursor.row_factory = None  # plain tuples
        return cursor.execute(
            f"SELECT {', '.join('trials.' + c if c in known else 'NULL' for c in columns)}{joined}, {key} AS sort_key"
            f" FROM trials {joins}"
            f" WHERE {where} ORDER BY {order}",
            [*key_args, *join_args, *args],
        )

    def trials_every(self, step: int, limit: int) -> list[dict[str, Any]]:
        """Every ``step``-th trial in submission order, ``limit`` at most: the trials whose
        sequence numbers are multiples of ``step``, each looked up by its index (no scan)."""
        (last,) = self._db.execute("SELECT coalesce(max(seq), 0) FROM trials").fetchone()
        seqs = list(range(0, int(last) + 1, max(1, step)))
        return [dict(r) for r in self._db.execute(
            "SELECT * FROM trials WHERE seq IN (SELECT value FROM json_each(?)) ORDER BY seq LIMIT ?",
            (json.dumps(seqs), limit),
        )]

    def ended_series(self, maximize: bool, points: int) -> list[tuple[Any, Any, Any]]:
        """(ended at, trials ended so far, best numeric final metric so far) as trials ended:
        every trial's end when there are ``points`` or fewer, else about ``points`` of them
        spread evenly over the time trials ended in, each exact at its moment (the last end
        always kept)."""
        best = "max" if maximize else "min"
        # A range that holds every number and neither NULL nor text (as typeof() in ('real',
        # 'integer') would), so that the ended trials are read in order from trials_ended.
        numeric = "BETWEEN -1e999 AND 1e999"
        metric = f"{best}(CASE WHEN final_metric {numeric} THEN final_metric END)"
        (total,) = self._db.execute(f"SELECT count(*) FROM trials WHERE ended_at {numeric}").fetchone()
        if total <= max(1, points):
            return [tuple(r) for r in self._db.execute(
                f"SELECT ended_at, row_number() OVER w, {metric} OVER w FROM trials WHERE ended_at {numeric}"
                " WINDOW w AS (ORDER BY ended_at, seq ROWS UNBOUNDED PRECEDING) ORDER BY ended_at, seq"
            )]
        # One aggregate a slice of time, each reading its slice of the index: a million ended
        # trials in 0.2 s, where a window over every one of them took 0.6 s.
        (hi,) = self._db.execute(f"SELECT max(ended_at) FROM trials WHERE ended_at {numeric}").fetchone()
        finite_lo, finite_hi = self._db.execute(
            "SELECT min(ended_at), max(ended_at) FROM trials WHERE ended_at > -1e999 AND ended_at < 1e999"
        ).fetchone()
        edges = [hi]
        if finite_lo is not None and finite_hi > finite_lo:
            span = finite_hi - finite_lo
            edges = [finite_lo + span * k / points for k in range(1, points)] + [finite_hi, hi]
        series: list[tuple[Any, Any, Any]] = []
        ended, best_so_far, after = 0, None, None
        pick = max if maximize else min
        for edge in edges:
            lower = "ended_at >= -1e999" if after is None else "ended_at > ?"
            n, at, best_here = self._db.execute(
                f"SELECT count(*), max(ended_at), {metric} FROM trials WHERE {lower} AND ended_at <= ?",
                (edge,) if after is None else (after, edge),
            ).fetchone()
            after = edge
            if n:
                ended += n
                best_so_far = (
                    best_here
                    if best_so_far is None
                    else best_so_far
                    if best_here is None
                    else pick(best_so_far, best_here)
                )
                series.append((at, ended, best_so_far))
        return series

    def parameter_names(self, sample: int) -> list[str]:
        """The parameter names of the last ``sample`` trials submitted."""
        return self._object_keys("parameters_json", sample)

    def result_keys(self, sample: int) -> list[str]:
        """The keys of the dict final results of the last ``sample`` trials submitted."""
        return self._object_keys("final_metric_json", sample)

    def _object_keys(self, column: str, sample: int) -> list[str]:
        """The keys of the JSON objects in ``column`` (a fixed name) of the last ``sample`` trials."""
        return [str(r[0]) for r in self._db.execute(
            f"SELECT DISTINCT j.key FROM (SELECT {column} AS v FROM trials ORDER BY seq DESC LIMIT ?) t,"
            " json_each(CASE WHEN json_valid(t.v) AND json_type(t.v) = 'object' THEN t.v ELSE '{}' END) j"
            " ORDER BY j.key",
            (sample,),
        )]

    def final_metric_ranks(self, points: int) -> tuple[int, list[tuple[float, int]]]:
        """How many trials have a numeric final metric, and about ``points`` of those metrics
        spread evenly in rank order, each with its rank (1 for the lowest; the lowest and
        highest always kept), read in order from the index on final_metric."""
        values = [r[0] for r in self._db.execute(
            "SELECT final_metric FROM trials WHERE final_metric BETWEEN -1e999 AND 1e999 ORDER BY final_metric"
        )]  # (a window function's row_number() over them takes twice as long)
        n = len(values)
        step = max(1, -(-n // max(1, points)))
        ranks = sorted({1, n, *range(step, n + 1, step)}) if n else []
        return n, [(float(values[r - 1]), r) for r in ranks]

    def next_trial_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM trials").fetchone()
        return int(row[0])

    def metrics(self, trial_id: str | None = None) -> list[MetricRow]:
        if trial_id is None:
            return metricstore.read(self._db, "", (), has_runs=self._has_runs)
        return metricstore.read(self._db, "WHERE trial_id = ?", (trial_id,), has_runs=self._has_runs)

    def metrics_of(self, trial_ids: Sequence[str]) -> list[MetricRow]:
        """The metrics of these trials, by trial and index."""
        marks = ",".join("?" * len(trial_ids))
        return metricstore.read(self._db, f"WHERE trial_id IN ({marks})", list(trial_ids), has_runs=self._has_runs)

    def last_metric(self, trial_id: str, kind: str) -> MetricRow | None:
        """The trial's last stored result of ``kind`` (None when it has none)."""
        return metricstore.last(self._db, trial_id, kind, has_runs=self._has_runs)

    def last_metrics(self, kind: str) -> dict[str, MetricRow]:
        """Every trial's last stored result of ``kind``, by trial id."""
        return metricstore.last_of_each(self._db, kind, has_runs=self._has_runs)

    def next_metric_index(self, trial_id: str) -> int:
        """The index after the trial's last stored metric (0 when it has none)."""
        return metricstore.next_index(self._db, trial_id, has_runs=self._has_runs)

    def data_version(self) -> int:
        """A number that changes when another connection commits to the store (SQLite's
        ``PRAGMA data_version``): whether anything changed, without reading anything."""
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    def changes(self) -> int | None:
        """The store's change counter (``changes``), which moves whenever a trial row or a result
        is written: one lookup. None in a store no version that keeps it has opened for writing."""
        return changes.read(self._db)

    def metric_count(self) -> int:
        """How many metrics are stored: the count add_runs keeps, or, in a store no
        version that keeps it has written, a count of the rows."""
        kept = self.meta("metric_count")
        if kept is not None and kept.isdigit():
            return int(kept)
        return metricstore.count(self._db, has_runs=self._has_runs)

    def envs(self, offset: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """The environments in the order they were made; ``limit`` of them from ``offset``."""
        return [dict(r) for r in self._db.execute(
            "SELECT * FROM environments ORDER BY created_at, id LIMIT ? OFFSET ?",
            (-1 if limit is None else limit, offset),
        )]

    def env_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM environments").fetchone()[0])

    def events(self, entity_id: str | None = None) -> list[dict[str, Any]]:
        if entity_id is None:
            cur = self._db.execute("SELECT * FROM events ORDER BY id")
        else:
            cur = self._db.execute("SELECT * FROM events WHERE entity_id = ? ORDER BY id", (entity_id,))
        return [dict(r) for r in cur]

    def gpu_samples(self, *, trial_id: str | None = None, environment_id: str | None = None) -> list[GpuSampleRow]:
        sql, args = "SELECT * FROM gpu_samples WHERE 1=1", []
        if environment_id is not None:
            sql += " AND environment_id = ?"
            args.append(environment_id)
        if trial_id is not None:
            sql += " AND instr(trial_ids_json, ?) > 0"
            args.append(json.dumps(trial_id))
        rows = self._db.execute(sql + " ORDER BY id", args).fetchall()
        found = [_gpu_row(r) for r in rows]
        return [r for r in found if trial_id is None or trial_id in r.trial_ids]

    def latest_gpu_samples(self, env_ids: Sequence[str] | None = None) -> dict[str, dict[str, GpuSampleRow]]:
        """The newest stored sample of each GPU (of the environments ``env_ids`` when given), by
        environment and uuid: one query, read from the index by GPU."""
        where, args = _among("environment_id", env_ids)
        rows = self._db.execute(
            "SELECT * FROM gpu_samples WHERE id IN"
            f" (SELECT max(id) FROM gpu_samples WHERE {where} GROUP BY environment_id, uuid)", args
        ).fetchall()
        latest: dict[str, dict[str, GpuSampleRow]] = {}
        for r in rows:
            latest.setdefault(r["environment_id"], {})[r["uuid"]] = _gpu_row(r)
        return latest

    def integrity_check(self) -> str:
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])


def _among(column: str, values: Sequence[Any] | None) -> tuple[str, list[Any]]:
    """SQL that keeps the rows whose ``column`` is one of ``values`` (every row when None)."""
    if values is None:
        return "1=1", []
    return f"{column} IN ({','.join('?' * len(values))})", list(values)


def _gpu_row(r: sqlite3.Row) -> GpuSampleRow:
    try:
        trial_ids = json.loads(r["trial_ids_json"])
    except (TypeError, ValueError):
        trial_ids = []  # a row no reader can attribute: still a sample of its GPU
    return GpuSampleRow(
        r["at"],
        r["environment_id"],
        r["uuid"],
        r["utilization"],
        r["memory_used_bytes"],
        r["memory_total_bytes"],
        tuple(t for t in trial_ids if isinstance(t, str)) if isinstance(trial_ids, list) else (),
    )
