"""How the store keeps checkpoints and the results a continued trial replaced.

``checkpoints``: one row per checkpoint a trial saved (trial, step, size, where, digest, its
files), ``removed_at`` set once its files were removed. ``metric_history``: the results a run
reported after the checkpoint its trial continued from, and then lost; the continued run's
results take their indexes in ``metrics`` / ``metric_runs``, so a trial's curve is one curve,
and what was replaced is still there to read.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ..engine.checkpoints import Checkpoint
from . import metrics as metricstore

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    trial_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    metric_index INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    digest TEXT NOT NULL,
    location TEXT NOT NULL,   -- '' the experiment's checkpoint directory; else a URL
    files_json TEXT NOT NULL, -- [[path, size, mode], ...]
    saved_at REAL NOT NULL,
    env_id TEXT NOT NULL DEFAULT '',
    removed_at REAL,
    PRIMARY KEY (trial_id, step)
);
CREATE TABLE IF NOT EXISTS metric_history (
    trial_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    kind TEXT NOT NULL,
    value REAL NOT NULL,
    value_json TEXT NOT NULL,
    reported_at REAL NOT NULL,
    superseded_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS metric_history_trial ON metric_history (trial_id, idx);
"""

# Columns the trials table gained with checkpoints.
TRIAL_COLUMNS = {
    # The step of its newest checkpoint.
    "checkpoint_step": "INTEGER",
    # Retries used against maxTrialRetries (NULL: a store from before they were counted apart).
    "retries": "INTEGER",
    # 1 when it saved a checkpoint since its last loss.
    "progressed": "INTEGER NOT NULL DEFAULT 0",
    # [trial, step]: the checkpoint it was forked from.
    "forked_from_json": "TEXT",
}


def record(db: sqlite3.Connection, c: Checkpoint) -> None:
    files = json.dumps([[f.path, f.size, f.mode] for f in c.files], separators=(",", ":"))
    db.execute(
        "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
        (c.trial_id, c.step, c.metric_index, c.size_bytes, c.digest, c.location, files, c.saved_at, c.env_id),
    )
    db.execute("UPDATE trials SET checkpoint_step = ?, progressed = 1 WHERE id = ?", (c.step, c.trial_id))


def set_digest(db: sqlite3.Connection, trial_id: str, step: int, digest: str) -> None:
    db.execute("UPDATE checkpoints SET digest = ? WHERE trial_id = ? AND step = ?", (digest, trial_id, step))


def removed(db: sqlite3.Connection, trial_id: str, step: int, at: float) -> None:
    db.execute("UPDATE checkpoints SET removed_at = ? WHERE trial_id = ? AND step = ?", (at, trial_id, step))


def supersede(db: sqlite3.Connection, trial_id: str, from_index: int, at: float, *, has_runs: bool) -> int:
    """Move the trial's results from ``from_index`` on into its history; returns how many."""
    rows = [r for r in metricstore.read(db, "WHERE trial_id = ?", (trial_id,), has_runs=has_runs)
            if r.index >= from_index]
    if not rows:
        return 0
    db.executemany(
        "INSERT INTO metric_history VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(r.trial_id, r.index, r.kind, r.value, r.value_json, r.reported_at, at) for r in rows],
    )
    db.execute("DELETE FROM metrics WHERE trial_id = ? AND idx >= ?", (trial_id, from_index))
    if has_runs:
        # A run that starts before from_index keeps its part before it.
        for idx, vals, value_json, reported_at in db.execute(
            "SELECT idx, vals, value_json, reported_at FROM metric_runs"
            " WHERE trial_id = ? AND idx < ? AND idx + n > ?", (trial_id, from_index, from_index),
        ).fetchall():
            keep = from_index - idx
            jsons = json.loads(value_json) if value_json is not None else None
            db.execute(
                "UPDATE metric_runs SET n = ?, vals = ?, value_json = ?, reported_at = ?"
                " WHERE trial_id = ? AND idx = ?",
                (keep, vals[: 8 * keep], json.dumps(jsons[:keep]) if jsons is not None else None,
                 reported_at[: 8 * keep], trial_id, idx),
            )
        db.execute("DELETE FROM metric_runs WHERE trial_id = ? AND idx >= ?", (trial_id, from_index))
    db.execute("UPDATE meta SET value = value - ? WHERE key = 'metric_count'", (len(rows),))
    return len(rows)


def rows(db: sqlite3.Connection, trial_id: str | None = None, *, kept: bool = True) -> list[dict[str, Any]]:
    """Checkpoints as stored (``kept``: only those whose files are still there), oldest first;
    none from a store made before checkpoints."""
    if not _has(db, "checkpoints"):
        return []
    where = ["removed_at IS NULL"] if kept else []
    args: list[Any] = []
    if trial_id is not None:
        where.append("trial_id = ?")
        args.append(trial_id)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    return [dict(r) for r in db.execute(f"SELECT * FROM checkpoints {clause} ORDER BY saved_at, step", args)]


def history(db: sqlite3.Connection, trial_id: str) -> list[dict[str, Any]]:
    """The results of a trial that continued runs replaced, in the order they were reported."""
    if not _has(db, "metric_history"):
        return []
    return [dict(r) for r in db.execute(
        "SELECT * FROM metric_history WHERE trial_id = ? ORDER BY superseded_at, idx", (trial_id,)
    )]


def _has(db: sqlite3.Connection, table: str) -> bool:
    found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
    return found is not None
