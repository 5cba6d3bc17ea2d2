"""The experiment's SQLite store: the source of truth for everything that happened.

WAL mode with ``synchronous=NORMAL``: a committed transaction survives the process being
killed (not a power cut). The coordinator writes from its event-loop thread only; other
processes (the CLI) read concurrently.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.events import Fact
from ..engine.rows import GpuSampleRow, MetricRow, MetricRun
from . import metrics as metricstore
from .facts import Insert, Transition, Update, WaitingReasons, writes_of

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS experiment (
    id TEXT PRIMARY KEY,
    name TEXT,
    config_json TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    coordinator_address TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    ended_at REAL
);
CREATE TABLE IF NOT EXISTS trials (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL UNIQUE,
    status TEXT NOT NULL,
    parameters_json TEXT NOT NULL,
    command TEXT NOT NULL,
    gpu_number INTEGER NOT NULL,
    environment_id TEXT,
    gpu_indices_json TEXT NOT NULL DEFAULT '[]',
    exit_code INTEGER,
    signal INTEGER,
    reason TEXT NOT NULL DEFAULT '',
    stderr_tail TEXT NOT NULL DEFAULT '',
    final_metric REAL,
    final_metric_json TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL
);
CREATE TABLE IF NOT EXISTS metrics (
    trial_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    kind TEXT NOT NULL,
    value REAL NOT NULL,
    value_json TEXT NOT NULL,
    reported_at REAL NOT NULL,
    PRIMARY KEY (trial_id, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS environments (
    id TEXT PRIMARY KEY,
    platform TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    platform_id TEXT NOT NULL DEFAULT '',
    hostname TEXT NOT NULL DEFAULT '',
    info_json TEXT NOT NULL DEFAULT '{}',
    agent_instance_id TEXT NOT NULL DEFAULT '',
    last_seq INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    ended_at REAL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    entity TEXT NOT NULL,
    entity_id TEXT NOT NULL,
    old TEXT NOT NULL,
    new TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_entity ON events (entity_id);
-- A page of the trials of one status, their counts by status and the best final metric are
-- read from these, not from a scan of every trial (a store may hold a million). Being in
-- this script, a store made before them gets them when it is opened for writing.
CREATE INDEX IF NOT EXISTS trials_status ON trials (status, seq);
CREATE INDEX IF NOT EXISTS trials_final_metric ON trials (final_metric);
-- The charts over time read the ended trials in order from this index alone (no sort).
CREATE INDEX IF NOT EXISTS trials_ended ON trials (ended_at, seq, final_metric);
CREATE TABLE IF NOT EXISTS gpu_samples (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    environment_id TEXT NOT NULL,
    uuid TEXT NOT NULL,
    utilization REAL NOT NULL,
    memory_used_bytes INTEGER NOT NULL,
    memory_total_bytes INTEGER NOT NULL,
    -- JSON list of the trials with processes on the GPU at that moment
    trial_ids_json TEXT NOT NULL
);
"""

TRIAL_COLUMNS = (
    "id", "seq", "status", "parameters_json", "command", "gpu_number", "environment_id",
    "gpu_indices_json", "exit_code", "signal", "reason", "stderr_tail", "final_metric",
    "final_metric_json", "attempts", "submitted_at", "started_at", "ended_at", "gpu_uuids_json",
    "waiting_reason", "stopping", "platforms_json",
)
ENV_COLUMNS = (
    "id", "platform", "status", "reason", "platform_id", "hostname", "info_json",
    "agent_instance_id", "last_seq", "created_at", "ended_at", "connected",
)



__all__ = ["GpuSampleRow", "MetricRow", "Store", "StoreError"]

class StoreError(RuntimeError):
    """The store cannot be opened or is not a trialkeeper store."""


class _Transaction:
    """``Store.transaction()``: a plain context manager rather than a generator one, as it
    is entered several times for every agent message."""

    __slots__ = ("_store",)

    def __init__(self, store: Store) -> None:
        self._store = store

    def __enter__(self) -> None:
        store = self._store
        if store._depth == 0:
            store._db.execute("BEGIN")
        store._depth += 1

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        store = self._store
        store._depth -= 1
        if store._depth == 0:
            store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


# Columns added since a table was first made, with their definitions: a store made before
# them gets them when it is opened for writing (readers see them as absent).
_ADDED_COLUMNS = {
    "trials": {
        "gpu_uuids_json": "TEXT NOT NULL DEFAULT '[]'",
        # Why a waiting trial is not placed yet, as the scheduler last said.
        "waiting_reason": "TEXT NOT NULL DEFAULT ''",
        # 1 once a cancel was sent: its processes are being stopped.
        "stopping": "INTEGER NOT NULL DEFAULT 0",
        # The platforms the trial may use, most preferred first ([]: the experiment's).
        "platforms_json": "TEXT NOT NULL DEFAULT '[]'",
    },
    # 1 while the environment's agent has its stream open.
    "environments": {"connected": "INTEGER NOT NULL DEFAULT 0"},
}


def _add_missing_columns(db: sqlite3.Connection) -> None:
    for table, columns in _ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, definition in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
    # The metrics stored, kept by add_metrics: counting ten million rows takes seconds.
    db.execute(
        "INSERT OR IGNORE INTO meta SELECT 'metric_count',"
        " (SELECT count(*) FROM metrics) + (SELECT coalesce(sum(n), 0) FROM metric_runs)"
    )
    # Opened for writing by a coordinator that starts (or resumes): no agent is connected to
    # it yet, whatever a crashed predecessor last stored.
    db.execute("UPDATE environments SET connected = 0 WHERE connected != 0")


class Store:
    """Reads and writes one experiment's database file."""

    FILENAME = "trialkeeper.db"

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        try:
            if readonly:
                if not path.exists():
                    raise StoreError(f"no experiment store at {path}")
                # as_uri() escapes what a URI would misread in a path ('?', '#', '%').
                uri = f"{path.absolute().as_uri()}?mode=ro"
                self._db = sqlite3.connect(uri, uri=True, timeout=10.0, check_same_thread=False)
                # Connecting reads nothing: check now that this is a store, so that a
                # wrong file fails here with a StoreError rather than at the first query.
                found = self._db.execute(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
                ).fetchone()[0]
                if not found:
                    self._db.close()
                    raise StoreError(f"{path} is not a trialkeeper store (it has no meta table)")
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.executescript(_SCHEMA + metricstore.SCHEMA)
                self._db.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
                _add_missing_columns(self._db)
        except sqlite3.DatabaseError as e:
            with contextlib.suppress(AttributeError):
                self._db.close()
            raise StoreError(f"cannot open the experiment store {path}: {e}") from e
        self._db.row_factory = sqlite3.Row
        # A store written before metrics were kept in runs has none to read.
        self._has_runs = bool(
            self._db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'metric_runs'").fetchone()[0]
        )
        self._depth = 0
        self._metric_ends: dict[str, int] = {}  # see metricstore.insert
        self._transaction = _Transaction(self)
        self._gpu_rows = self.MAX_GPU_SAMPLES  # unknown: the first insert counts
        self._waiting_reasons: dict[str, str] = {}  # as last written, to write only changes

    @classmethod
    def in_dir(cls, experiment_dir: Path, *, readonly: bool = False) -> Store:
        return cls(experiment_dir / cls.FILENAME, readonly=readonly)

    def close(self) -> None:
        self._db.close()

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        """Group writes into one commit; nests (only the outermost commits)."""
        return self._transaction

    def _write(self, sql: str, args: Sequence[Any] = ()) -> None:
        # Outside a transaction one statement commits by itself (autocommit): one call to
        # SQLite instead of three (BEGIN, the statement, COMMIT).
        self._db.execute(sql, args)

    # ---- experiment --------------------------------------------------------------------

    def create_experiment(self, exp_id: str, name: str | None, config: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO experiment (id, name, config_json, status, created_at) VALUES (?, ?, ?, 'RUNNING', ?)",
            (exp_id, name, json.dumps(config), time.time()),
        )

    def experiment(self) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM experiment LIMIT 1").fetchone()
        return dict(row) if row else None

    def set_experiment_status(self, status: str, reason: str = "", *, ended: bool = False) -> None:
        self._write(
            "UPDATE experiment SET status = ?, reason = ?, ended_at = ?",
            (status, reason, time.time() if ended else None),
        )

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_coordinator_address(self, address: str) -> None:
        self._write("UPDATE experiment SET coordinator_address = ?", (address,))

    # ---- trials ------------------------------------------------------------------------

    def insert_trial(self, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        self._write(f"INSERT INTO trials ({cols}) VALUES ({marks})", tuple(row.values()))

    def keep(self, fact: Fact) -> None:
        """Write what a fact of the decision core becomes (``facts.py`` says which rows)."""
        for w in writes_of(fact):
            match w:
                case Insert():
                    cols = ", ".join(w.row)
                    marks = ", ".join("?" for _ in w.row)
                    self._write(f"INSERT INTO {w.table} ({cols}) VALUES ({marks})", tuple(w.row.values()))
                case Update():
                    columns = TRIAL_COLUMNS if w.table == "trials" else ENV_COLUMNS
                    self._update(w.table, w.table.rstrip("s"), columns, w.row_id, dict(w.fields))
                case Transition():
                    self.record(w.entity, w.entity_id, w.old, w.new, w.reason)
                case WaitingReasons():
                    self.set_waiting_reasons(w.reasons)

    def update_trial(self, trial_id: str, **fields: Any) -> None:
        self._update("trials", "trial", TRIAL_COLUMNS, trial_id, fields)

    def _update(self, table: str, what: str, columns: Sequence[str], row_id: str, fields: dict[str, Any]) -> None:
        bad = set(fields) - set(columns)
        if bad:
            raise ValueError(f"unknown {what} columns {sorted(bad)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._write(f"UPDATE {table} SET {sets} WHERE id = ?", (*fields.values(), row_id))

    def set_waiting_reasons(self, reasons: Mapping[str, str]) -> None:
        """Store why each of these waiting trials is not placed yet; only the reasons that
        changed since the last call are written, in one transaction."""
        changed = [(r, tid) for tid, r in reasons.items() if self._waiting_reasons.get(tid) != r]
        if not changed:
            return
        with self.transaction():
            self._db.executemany("UPDATE trials SET waiting_reason = ? WHERE id = ?", changed)
        self._waiting_reasons.update((tid, r) for r, tid in changed)

    def trials(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM trials ORDER BY seq")]

    def trial(self, trial_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT * FROM trials WHERE id = ?", (trial_id,)).fetchone()
        return dict(row) if row else None

    def trial_places(self) -> list[tuple[Any, Any, Any]]:
        """(id, environment id, status) of every trial, in submission order."""
        return [tuple(r) for r in self._db.execute("SELECT id, environment_id, status FROM trials ORDER BY seq")]

    def active_trials(self) -> list[dict[str, Any]]:
        """The trials waiting or running, in submission order."""
        return [dict(r) for r in self._db.execute("SELECT * FROM trials WHERE status IN ('WAITING', 'RUNNING') ORDER BY seq")]

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
        self, *, where: str, args: Sequence[Any], key: str, key_args: Sequence[Any], descending: bool, offset: int, limit: int
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

    def trials_every(self, step: int, limit: int) -> list[dict[str, Any]]:
        """Every ``step``-th trial in submission order, ``limit`` at most."""
        return [dict(r) for r in self._db.execute(
            "SELECT * FROM trials WHERE seq % ? = 0 ORDER BY seq LIMIT ?", (max(1, step), limit)
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
                best_so_far = best_here if best_so_far is None else best_so_far if best_here is None else pick(best_so_far, best_here)
                series.append((at, ended, best_so_far))
        return series

    def parameter_names(self, sample: int) -> list[str]:
        """The parameter names of the last ``sample`` trials submitted."""
        return [str(r[0]) for r in self._db.execute(
            "SELECT DISTINCT j.key FROM (SELECT parameters_json FROM trials ORDER BY seq DESC LIMIT ?) t,"
            " json_each(CASE WHEN json_valid(t.parameters_json) AND json_type(t.parameters_json) = 'object'"
            " THEN t.parameters_json ELSE '{}' END) j ORDER BY j.key",
            (sample,),
        )]

    def next_trial_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM trials").fetchone()
        return int(row[0])

    # ---- metrics -----------------------------------------------------------------------

    def add_metrics(self, rows: Iterable[MetricRow]) -> None:
        """Store metrics given one by one (as runs of consecutive ones)."""
        self.add_runs(MetricRun.of_rows(rows))

    def add_runs(self, runs: Sequence[MetricRun]) -> None:
        """Store runs of metrics, one row each; a replayed one is stored once."""
        if not runs:
            return
        with self.transaction():
            added = metricstore.insert(self._db, runs, self._metric_ends)
            if added > 0:
                self._db.execute("UPDATE meta SET value = value + ? WHERE key = 'metric_count'", (added,))

    def metrics(self, trial_id: str | None = None) -> list[MetricRow]:
        if trial_id is None:
            return metricstore.read(self._db, "", (), has_runs=self._has_runs)
        return metricstore.read(self._db, "WHERE trial_id = ?", (trial_id,), has_runs=self._has_runs)

    def metrics_of(self, trial_ids: Sequence[str]) -> list[MetricRow]:
        """The metrics of these trials, by trial and index."""
        marks = ",".join("?" * len(trial_ids))
        return metricstore.read(self._db, f"WHERE trial_id IN ({marks})", list(trial_ids), has_runs=self._has_runs)

    def next_metric_index(self, trial_id: str) -> int:
        """The index after the trial's last stored metric (0 when it has none)."""
        return metricstore.next_index(self._db, trial_id, has_runs=self._has_runs)

    def metric_count(self) -> int:
        """How many metrics are stored: the count add_runs keeps, or, in a store no
        version that keeps it has written, a count of the rows."""
        kept = self.meta("metric_count")
        if kept is not None and kept.isdigit():
            return int(kept)
        return metricstore.count(self._db, has_runs=self._has_runs)

    # ---- environments ------------------------------------------------------------------

    def insert_env(self, env_id: str, platform: str, status: str) -> None:
        self._write(
            "INSERT INTO environments (id, platform, status, created_at) VALUES (?, ?, ?, ?)",
            (env_id, platform, status, time.time()),
        )

    def update_env(self, env_id: str, **fields: Any) -> None:
        self._update("environments", "environment", ENV_COLUMNS, env_id, fields)

    def set_connected(self, env_id: str, connected: bool) -> None:
        """Store whether the environment's agent has its stream open."""
        self._write("UPDATE environments SET connected = ? WHERE id = ?", (int(connected), env_id))

    def envs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._db.execute("SELECT * FROM environments ORDER BY created_at, id")]

    # ---- events ------------------------------------------------------------------------

    def record(self, entity: str, entity_id: str, old: str, new: str, reason: str) -> None:
        self._write(
            "INSERT INTO events (at, entity, entity_id, old, new, reason) VALUES (?, ?, ?, ?, ?, ?)",
            (time.time(), entity, entity_id, old, new, reason),
        )

    def events(self, entity_id: str | None = None) -> list[dict[str, Any]]:
        if entity_id is None:
            cur = self._db.execute("SELECT * FROM events ORDER BY id")
        else:
            cur = self._db.execute("SELECT * FROM events WHERE entity_id = ? ORDER BY id", (entity_id,))
        return [dict(r) for r in cur]

    # ---- GPU samples -------------------------------------------------------------------

    #: The most GPU samples kept; past it the older half is thinned to every other sample.
    MAX_GPU_SAMPLES = 200_000

    def add_gpu_samples(self, rows: Sequence[GpuSampleRow]) -> None:
        with self.transaction():
            self._db.executemany(
                "INSERT INTO gpu_samples (at, environment_id, uuid, utilization, memory_used_bytes,"
                " memory_total_bytes, trial_ids_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (r.at, r.environment_id, r.uuid, r.utilization, r.memory_used_bytes, r.memory_total_bytes,
                     json.dumps(list(r.trial_ids)) if r.trial_ids else "[]")
                    for r in rows
                ],
            )
            self._gpu_rows += len(rows)
            if self._gpu_rows > self.MAX_GPU_SAMPLES:
                self._thin_gpu_samples()

    def _thin_gpu_samples(self) -> None:
        (count,) = self._db.execute("SELECT count(*) FROM gpu_samples").fetchone()
        if count > self.MAX_GPU_SAMPLES:
            (middle,) = self._db.execute(
                "SELECT id FROM gpu_samples ORDER BY id LIMIT 1 OFFSET ?", (count // 2,)
            ).fetchone()
            self._db.execute("DELETE FROM gpu_samples WHERE id < ? AND id % 2 = 1", (middle,))
            (count,) = self._db.execute("SELECT count(*) FROM gpu_samples").fetchone()
        self._gpu_rows = count

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

    def latest_gpu_samples(self) -> dict[str, dict[str, GpuSampleRow]]:
        """The newest stored sample of each GPU, by environment and uuid: one query for every
        environment (the table has no index by environment, and need not)."""
        rows = self._db.execute(
            "SELECT * FROM gpu_samples WHERE id IN"
            " (SELECT max(id) FROM gpu_samples GROUP BY environment_id, uuid)"
        ).fetchall()
        latest: dict[str, dict[str, GpuSampleRow]] = {}
        for r in rows:
            latest.setdefault(r["environment_id"], {})[r["uuid"]] = _gpu_row(r)
        return latest

    def integrity_check(self) -> str:
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])


def _gpu_row(r: sqlite3.Row) -> GpuSampleRow:
    try:
        trial_ids = json.loads(r["trial_ids_json"])
    except (TypeError, ValueError):
        trial_ids = []  # a row no reader can attribute: still a sample of its GPU
    return GpuSampleRow(
        r["at"], r["environment_id"], r["uuid"], r["utilization"], r["memory_used_bytes"],
        r["memory_total_bytes"], tuple(t for t in trial_ids if isinstance(t, str)) if isinstance(trial_ids, list) else (),
    )
