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
from ..engine.states import TrialStatus
from . import changes, checkpointrows
from . import metrics as metricstore
from .facts import (
    CheckpointDigest,
    CheckpointGone,
    CheckpointKept,
    Insert,
    Superseded,
    Transition,
    Update,
    WaitingReasons,
    writes_of,
)
from .reads import FILENAME, StoreError, StoreReader

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
-- A page of environments reads its trials (the latest, how many) and its GPUs' latest
-- samples from these, not from every trial and every sample.
CREATE INDEX IF NOT EXISTS trials_environment ON trials (environment_id, seq);
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
CREATE INDEX IF NOT EXISTS gpu_samples_gpu ON gpu_samples (environment_id, uuid, id);
"""

TRIAL_COLUMNS = (
    "id", "seq", "status", "parameters_json", "command", "gpu_number", "environment_id",
    "gpu_indices_json", "exit_code", "signal", "reason", "stderr_tail", "final_metric",
    "final_metric_json", "attempts", "submitted_at", "started_at", "ended_at", "gpu_uuids_json",
    "waiting_reason", "stopping", "platforms_json", "nodes", "ranks_json", "max_duration", "ran_s",
    "last_environment_id", *checkpointrows.TRIAL_COLUMNS,
)
ENV_COLUMNS = (
    "id", "platform", "status", "reason", "platform_id", "hostname", "info_json",
    "agent_instance_id", "last_seq", "created_at", "ended_at", "connected", "group_id", "group_for", "agent_left",
)



__all__ = ["GpuSampleRow", "MetricRow", "Store", "StoreError"]

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
            changed, store._changed = store._changed, False
            if exc_type is not None:
                store._db.execute("ROLLBACK")
                return
            try:
                if changed:  # trials or results were written: the counter moves with them
                    store._db.execute(changes.MOVE)
                store._db.execute("COMMIT")
            except BaseException:
                if store._db.in_transaction:
                    store._db.execute("ROLLBACK")
                raise


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
        # A multi-node trial's environments at once, and its ranks as [rank, env, GPUs, state].
        "nodes": "INTEGER NOT NULL DEFAULT 1",
        "ranks_json": "TEXT NOT NULL DEFAULT '[]'",
        # A trial's own time limit in seconds (0: maxTrialDuration's).
        "max_duration": "REAL NOT NULL DEFAULT 0",
        # Seconds it ran in its attempts ended so far (started_at: its latest attempt's start).
        "ran_s": "REAL NOT NULL DEFAULT 0",
        # The environment it was last placed on, kept once it leaves it (paused, retried).
        "last_environment_id": "TEXT",
        **checkpointrows.TRIAL_COLUMNS,
    },
    # 1 while the environment's agent has its stream open.
    "environments": {
        "connected": "INTEGER NOT NULL DEFAULT 0",
        # A member of a group of environments started for a trial (jobPerTrial): the group's
        # id (its first member's) and the trial's; '' for an environment of its own.
        "group_id": "TEXT NOT NULL DEFAULT ''",
        "group_for": "TEXT NOT NULL DEFAULT ''",
        # 1 once it ended stopped as its agent left it (Leaving): that agent is told so if it dials again.
        "agent_left": "INTEGER NOT NULL DEFAULT 0",
    },
}


def _add_missing_columns(db: sqlite3.Connection) -> None:
    for table, columns in _ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, definition in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
                if (table, name) == ("trials", "ran_s"):  # a store from before: its ended trials' last attempt
                    db.execute("UPDATE trials SET ran_s = max(0, ended_at - started_at)"
                               " WHERE ended_at IS NOT NULL AND started_at IS NOT NULL")
    # The metrics stored, kept by add_metrics: counting ten million rows takes seconds.
    db.execute(
        "INSERT OR IGNORE INTO meta SELECT 'metric_count',"
        " (SELECT count(*) FROM metrics) + (SELECT coalesce(sum(n), 0) FROM metric_runs)"
    )
    # Opened for writing by a coordinator that starts (or resumes): no agent is connected to
    # it yet, whatever a crashed predecessor last stored.
    db.execute("UPDATE environments SET connected = 0 WHERE connected != 0")
    # An older version kept the end of an attempt a trial was retried or paused after as the
    # trial's own: a trial that has not ended has no end.
    not_ended = [s.value for s in TrialStatus if not s.terminal]
    db.execute(f"UPDATE trials SET ended_at = NULL WHERE status IN ({', '.join('?' * len(not_ended))})"
               " AND ended_at IS NOT NULL", not_ended)


class Store(StoreReader):
    """Reads and writes one experiment's database file (``readonly``: reads only, as a
    :class:`StoreReader`)."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        if readonly:
            super().__init__(path)
        else:
            self.path = path
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.executescript(_SCHEMA + metricstore.SCHEMA + checkpointrows.SCHEMA)
                self._db.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
                _add_missing_columns(self._db)
                changes.install(self._db)
            except sqlite3.DatabaseError as e:
                with contextlib.suppress(AttributeError):
                    self._db.close()
                raise StoreError(f"cannot open the experiment store {path}: {e}") from e
            self._opened()
        self._depth = 0
        self._changed = False  # whether the open transaction wrote trials or results
        self._metric_ends: dict[str, int] = {}  # see metricstore.insert
        self._transaction = _Transaction(self)
        self._gpu_rows = self.MAX_GPU_SAMPLES  # unknown: the first insert counts
        self._waiting_reasons: dict[str, str] = {}  # as last written, to write only changes

    @classmethod
    def in_dir(cls, experiment_dir: Path, *, readonly: bool = False) -> Store:
        return cls(experiment_dir / FILENAME, readonly=readonly)

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        """Group writes into one commit; nests (only the outermost commits)."""
        return self._transaction

    def _changing(self) -> contextlib.AbstractContextManager[None]:
        """The transaction of a write of trial rows or results: its commit moves the store's
        change counter (``changes``)."""
        self._changed = True
        return self._transaction

    def _write(self, sql: str, args: Sequence[Any] = (), *, trials: bool = False) -> None:
        # Outside a transaction one statement commits by itself (autocommit): one call to
        # SQLite instead of three (BEGIN, the statement, COMMIT). A write of trial rows
        # (``trials``) is in a transaction, which moves the change counter as it commits.
        if trials:
            with self._changing():
                self._db.execute(sql, args)
        else:
            self._db.execute(sql, args)

    # ---- experiment --------------------------------------------------------------------

    def create_experiment(self, exp_id: str, name: str | None, config: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO experiment (id, name, config_json, status, created_at) VALUES (?, ?, ?, 'RUNNING', ?)",
            (exp_id, name, json.dumps(config), time.time()),
        )

    def set_experiment_status(self, status: str, reason: str = "", *, ended: bool = False) -> None:
        self._write(
            "UPDATE experiment SET status = ?, reason = ?, ended_at = ?",
            (status, reason, time.time() if ended else None),
        )

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def set_coordinator_address(self, address: str) -> None:
        self._write("UPDATE experiment SET coordinator_address = ?", (address,))

    # ---- trials ------------------------------------------------------------------------

    def insert_trial(self, row: dict[str, Any]) -> None:
        self._insert("trials", row)

    def _insert(self, table: str, row: Mapping[str, Any], *, replace: bool = False) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        self._write(f"{verb} INTO {table} ({cols}) VALUES ({marks})", tuple(row.values()), trials=table == "trials")

    def keep(self, fact: Fact) -> None:
        """Write what a fact of the decision core becomes (``facts.py`` says which rows)."""
        for w in writes_of(fact):
            match w:
                case Insert():
                    self._insert(w.table, w.row, replace=w.replace)
                case Update(table="trials"):
                    self.update_trial(w.row_id, **w.fields)
                case Update():
                    self.update_env(w.row_id, **w.fields)
                case Transition():
                    self.record(w.entity, w.entity_id, w.old, w.new, w.reason)
                case WaitingReasons():
                    self.set_waiting_reasons(w.reasons)
                case CheckpointKept():
                    with self._changing():  # the trial's checkpoint step
                        checkpointrows.record(self._db, w.checkpoint)
                case CheckpointGone():
                    checkpointrows.removed(self._db, w.trial_id, w.step, w.at)
                case CheckpointDigest():
                    checkpointrows.set_digest(self._db, w.trial_id, w.step, w.digest)
                case Superseded():
                    self._metric_ends.pop(w.trial_id, None)  # its results end before from_index now
                    with self._changing():
                        checkpointrows.supersede(self._db, w.trial_id, w.from_index, w.at, has_runs=True)

    def update_trial(self, trial_id: str, **fields: Any) -> None:
        self._update("trials", "trial", TRIAL_COLUMNS, trial_id, fields)

    def _update(self, table: str, what: str, columns: Sequence[str], row_id: str, fields: dict[str, Any]) -> None:
        bad = set(fields) - set(columns)
        if bad:
            raise ValueError(f"unknown {what} columns {sorted(bad)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._write(f"UPDATE {table} SET {sets} WHERE id = ?", (*fields.values(), row_id), trials=table == "trials")

    def set_waiting_reasons(self, reasons: Mapping[str, str]) -> None:
        """Store why each of these waiting trials is not placed yet; only the reasons that
        changed since the last call are written, in one transaction."""
        changed = [(r, tid) for tid, r in reasons.items() if self._waiting_reasons.get(tid) != r]
        if not changed:
            return
        with self._changing():
            self._db.executemany("UPDATE trials SET waiting_reason = ? WHERE id = ?", changed)
        self._waiting_reasons.update((tid, r) for r, tid in changed)

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
                self._changed = True

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

    # ---- events ------------------------------------------------------------------------

    def record(self, entity: str, entity_id: str, old: str, new: str, reason: str) -> None:
        self._write(
            "INSERT INTO events (at, entity, entity_id, old, new, reason) VALUES (?, ?, ?, ?, ?, ?)",
            (time.time(), entity, entity_id, old, new, reason),
        )

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
