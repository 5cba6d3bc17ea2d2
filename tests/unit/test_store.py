"""The experiment store: metrics stored once, history kept, everything survives a reopen."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from trialkeeper.coordinator.store.store import SCHEMA_VERSION, MetricRow, Store, StoreError


def _store(tmp_path: Path) -> Store:
    store = Store.in_dir(tmp_path / "exp")
    store.create_experiment("exp1", "demo", {"trialCommand": "python trial.py", "trialConcurrency": 2})
    return store


def _trial(store: Store, trial_id: str, seq: int, **extra: object) -> None:
    store.insert_trial(
        {
            "id": trial_id, "seq": seq, "status": "WAITING", "parameters_json": json.dumps({"x": seq}),
            "command": "python trial.py", "gpu_number": 0, "submitted_at": 1000.0 + seq, **extra,
        }
    )


def _metric(trial_id: str, index: int, value: float, kind: str = "intermediate") -> MetricRow:
    raw = json.dumps({"default": value}) if kind == "final" else json.dumps(value)
    return MetricRow(trial_id, index, kind, value, raw, 2000.0 + index)


def _fill(store: Store) -> None:
    """A small but complete experiment: two trials, their metrics, an environment, history."""
    _trial(store, "t1", 0)
    _trial(store, "t2", 1)
    store.insert_env("env-1", "local", "REQUESTED")
    store.update_env("env-1", status="READY", hostname="host-a", info_json=json.dumps({"pid": 42}))
    store.record("environment", "env-1", "REQUESTED", "READY", "agent registered")
    store.update_trial("t1", status="RUNNING", environment_id="env-1", started_at=1500.0)
    store.record("trial", "t1", "WAITING", "RUNNING", "running on env-1")
    store.add_metrics([_metric("t1", 0, 0.5), _metric("t1", 1, 0.25)])
    store.add_metrics([_metric("t1", 2, 0.125, "final")])
    store.update_trial(
        "t1", status="SUCCEEDED", final_metric=0.125, final_metric_json='{"default": 0.125}', ended_at=1600.0
    )
    store.record("trial", "t1", "RUNNING", "SUCCEEDED", "")


def test_a_replayed_metric_is_stored_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _trial(store, "t1", 0)
    first = [_metric("t1", i, float(i)) for i in range(5)]
    store.add_metrics(first)
    # The same batch again (an agent replaying after a reconnect), then an overlapping one
    # whose already-stored rows carry other values: the first write of (trial, idx) wins.
    store.add_metrics(first)
    store.add_metrics([_metric("t1", 3, 99.0), _metric("t1", 4, 99.0), _metric("t1", 5, 5.0)])
    rows = store.metrics("t1")
    assert [(r.index, r.value) for r in rows] == [(i, float(i)) for i in range(6)]
    assert store.metric_count() == 6


def test_duplicates_inside_one_batch_are_stored_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.add_metrics([_metric("t1", 0, 1.0), _metric("t1", 0, 1.0), _metric("t1", 1, 2.0)])
    assert [(r.index, r.value) for r in store.metrics("t1")] == [(0, 1.0), (1, 2.0)]


def test_the_same_index_of_another_trial_is_a_different_metric(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.add_metrics([_metric("b", 0, 1.0), _metric("a", 0, 2.0), _metric("a", 1, 3.0, "final")])
    assert store.metric_count() == 3
    assert [(r.trial_id, r.index) for r in store.metrics()] == [("a", 0), ("a", 1), ("b", 0)]
    final = store.metrics("a")[-1]
    assert final == MetricRow("a", 1, "final", 3.0, json.dumps({"default": 3.0}), 2001.0)


def test_status_history_is_kept_in_order_per_entity(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _fill(store)
    history = [(e["old"], e["new"], e["reason"]) for e in store.events("t1")]
    assert history == [("WAITING", "RUNNING", "running on env-1"), ("RUNNING", "SUCCEEDED", "")]
    assert [e["entity"] for e in store.events()] == ["environment", "trial", "trial"]
    assert [e["entity_id"] for e in store.events()] == ["env-1", "t1", "t1"]
    times = [e["at"] for e in store.events()]
    assert times == sorted(times)
    assert store.events("no-such-entity") == []


def test_trial_rows(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _fill(store)
    assert [t["id"] for t in store.trials()] == ["t1", "t2"]
    t1 = store.trial("t1")
    assert t1 is not None
    assert (t1["status"], t1["environment_id"], t1["final_metric"]) == ("SUCCEEDED", "env-1", 0.125)
    assert json.loads(t1["parameters_json"]) == {"x": 0}
    assert store.trial("t3") is None
    assert store.next_trial_seq() == 2
    with pytest.raises(ValueError, match="unknown trial columns"):
        store.update_trial("t1", colour="red")
    with pytest.raises(sqlite3.IntegrityError):
        _trial(store, "t3", 1)  # sequence numbers are unique


def test_environment_rows(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _fill(store)
    store.insert_env("env-2", "local", "REQUESTED")
    store.update_env("env-2", status="FAILED", reason="agent exited with status 2", ended_at=1700.0)
    envs = store.envs()
    assert [e["id"] for e in envs] == ["env-1", "env-2"]
    env1, env2 = envs
    assert (env1["platform"], env1["status"], env1["hostname"]) == ("local", "READY", "host-a")
    assert json.loads(env1["info_json"]) == {"pid": 42}
    assert env1["ended_at"] is None and env1["last_seq"] == 0
    assert (env2["status"], env2["reason"], env2["ended_at"]) == ("FAILED", "agent exited with status 2", 1700.0)
    assert env2["info_json"] == "{}"
    with pytest.raises(ValueError, match="unknown environment columns"):
        store.update_env("env-1", colour="red")


def test_experiment_row(tmp_path: Path) -> None:
    store = _store(tmp_path)
    exp = store.experiment()
    assert exp is not None
    assert (exp["id"], exp["name"], exp["status"], exp["ended_at"]) == ("exp1", "demo", "RUNNING", None)
    assert json.loads(exp["config_json"])["trialConcurrency"] == 2
    store.set_coordinator_address("127.0.0.1:5000")
    store.set_experiment_status("DONE", "all trials ended", ended=True)
    exp = store.experiment()
    assert exp is not None
    assert (exp["status"], exp["reason"], exp["coordinator_address"]) == ("DONE", "all trials ended", "127.0.0.1:5000")
    assert exp["ended_at"] is not None


def test_reopening_after_close_keeps_everything(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _fill(store)
    before = (store.experiment(), store.trials(), store.metrics(), store.envs(), store.events())
    store.close()

    again = Store.in_dir(tmp_path / "exp")
    try:
        assert (again.experiment(), again.trials(), again.metrics(), again.envs(), again.events()) == before
        assert again.next_trial_seq() == 2
        # Reopening for writing does not reset anything, and writing goes on from there.
        again.add_metrics([_metric("t2", 0, 7.0)])
        assert again.metric_count() == 4
        assert again.integrity_check() == "ok"
    finally:
        again.close()

    reader = Store.in_dir(tmp_path / "exp", readonly=True)
    try:
        assert reader.trials() == before[1]
        assert [(r.trial_id, r.index) for r in reader.metrics()] == [("t1", 0), ("t1", 1), ("t1", 2), ("t2", 0)]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.add_metrics([_metric("t2", 1, 8.0)])
    finally:
        reader.close()
    with sqlite3.connect(tmp_path / "exp" / Store.FILENAME) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)


def test_wal_mode_lets_a_reader_see_only_committed_writes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    path = tmp_path / "exp" / Store.FILENAME
    try:
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert path.with_name(path.name + "-wal").exists()
        _trial(store, "t1", 0)
        reader = Store.in_dir(tmp_path / "exp", readonly=True)
        try:
            with store.transaction():
                store.add_metrics([_metric("t1", 0, 1.0)])
                # In WAL mode a reader is not blocked by the open write transaction, and
                # does not see its uncommitted rows.
                assert reader.metric_count() == 0
            assert reader.metric_count() == 1
        finally:
            reader.close()
    finally:
        store.close()


def test_a_failed_transaction_writes_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _trial(store, "t1", 0)
    with pytest.raises(RuntimeError, match="boom"), store.transaction():
        store.update_trial("t1", status="RUNNING")
        with store.transaction():  # nested: only the outermost commits or rolls back
            store.add_metrics([_metric("t1", 0, 1.0)])
            store.record("trial", "t1", "WAITING", "RUNNING", "")
        raise RuntimeError("boom")
    row = store.trial("t1")
    assert row is not None and row["status"] == "WAITING"
    assert store.metric_count() == 0 and store.events() == []
    # The store is usable after the rollback.
    store.add_metrics([_metric("t1", 0, 1.0)])
    assert store.metric_count() == 1


def test_opening_what_is_not_a_store_raises_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no experiment store"):
        Store.in_dir(tmp_path / "missing", readonly=True)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / Store.FILENAME).write_bytes(b"this is not an SQLite database, just some bytes" * 100)
    with pytest.raises(StoreError, match="cannot open"):
        Store.in_dir(junk)
    with pytest.raises(StoreError):
        Store.in_dir(junk, readonly=True)
    other = tmp_path / "other"
    other.mkdir()
    with sqlite3.connect(other / Store.FILENAME) as db:
        db.execute("CREATE TABLE unrelated (x INTEGER)")
    with pytest.raises(StoreError, match="not a trialkeeper store"):
        Store.in_dir(other, readonly=True)


def test_a_store_in_a_directory_with_uri_characters_opens_read_only(tmp_path: Path) -> None:
    odd = tmp_path / "exp #1?mode=rw&x=%20"
    store = Store.in_dir(odd)
    store.create_experiment("exp1", None, {})
    store.close()
    reader = Store.in_dir(odd, readonly=True)
    try:
        exp = reader.experiment()
        assert exp is not None and exp["id"] == "exp1"
    finally:
        reader.close()


def test_a_store_made_before_a_column_was_added_gets_it_when_opened_for_writing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _trial(store, "t1", 1, gpu_indices_json="[1]")
    store.close()
    # Take the column away, as in a store an earlier version made.
    db = sqlite3.connect(tmp_path / "exp" / Store.FILENAME)
    db.execute("ALTER TABLE trials DROP COLUMN gpu_uuids_json")
    db.commit()
    db.close()
    old = Store.in_dir(tmp_path / "exp", readonly=True)
    assert "gpu_uuids_json" not in old.trials()[0]  # readers see what there is
    old.close()

    store = Store.in_dir(tmp_path / "exp")
    row = store.trials()[0]
    assert (row["gpu_indices_json"], row["gpu_uuids_json"]) == ("[1]", "[]")  # kept, and the new one's default
    store.update_trial("t1", gpu_uuids_json='["MIG-1"]')
    assert store.trials()[0]["gpu_uuids_json"] == '["MIG-1"]'
    store.close()
    Store.in_dir(tmp_path / "exp").close()  # opening again adds nothing twice


def test_a_store_made_before_attempts_were_timed_counts_its_ended_trials_last_attempt(tmp_path: Path) -> None:
    from trialkeeper.coordinator.read.census import trial_durations
    from trialkeeper.coordinator.read.model import ReadModel
    from trialkeeper.coordinator.read.pages import every_trial_values, trial_page
    from trialkeeper.coordinator.read.rows import trial_snapshot

    store = _store(tmp_path)
    _trial(store, "t1", 0, status="SUCCEEDED", started_at=2000.0, ended_at=2012.5)
    _trial(store, "t2", 1, status="RUNNING", started_at=2000.0)
    store.close()
    db = sqlite3.connect(tmp_path / "exp" / Store.FILENAME)
    db.execute("ALTER TABLE trials DROP COLUMN ran_s")
    db.commit()
    db.close()
    old = Store.in_dir(tmp_path / "exp", readonly=True)  # read as it is: the last attempt
    assert [trial_snapshot(r).ran_s for r in old.trials()] == [12.5, 0.0]
    old.close()
    with ReadModel.open(tmp_path / "exp") as model:  # sorted and counted as it is, too
        assert [t.id for t in trial_page(model, sort="duration", descending=True).trials] == ["t1", "t2"]
        assert trial_durations(model, (60.0,)).total_s == 12.5
        chunks = list(every_trial_values(model, ("id", "ran_s"), 10))  # read as NULL where it is not
        assert [row for chunk in chunks for row in chunk] == [("t1", None), ("t2", None)]
    store = Store.in_dir(tmp_path / "exp")
    assert [r["ran_s"] for r in store.trials()] == [12.5, 0.0]  # and kept so once opened for writing
    store.close()


def test_an_end_an_older_version_kept_for_a_trial_that_has_not_ended_goes_when_opened_for_writing(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    # That version kept the end of the attempt a trial was retried or paused after as its own.
    _trial(store, "t1", 0, status="WAITING", started_at=2000.0, ended_at=2010.0, ran_s=10.0)
    _trial(store, "t2", 1, status="PAUSED", started_at=2000.0, ended_at=2005.0, ran_s=5.0)
    _trial(store, "t3", 2, status="SUCCEEDED", started_at=2000.0, ended_at=2012.5, ran_s=12.5)
    store.close()
    store = Store.in_dir(tmp_path / "exp")
    assert [(r["id"], r["ended_at"], r["ran_s"]) for r in store.trials()] == [
        ("t1", None, 10.0), ("t2", None, 5.0), ("t3", 2012.5, 12.5)]
    store.close()


def test_the_metric_count_is_kept_as_metrics_are_stored_and_replays_count_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.add_metrics([_metric("t1", 0, 0.1), _metric("t1", 1, 0.2)])
    store.add_metrics([_metric("t1", 1, 0.2), _metric("t2", 0, 0.5)])  # one replayed
    store.add_metrics([])
    assert store.metric_count() == 3 == len(store.metrics())
    assert store.meta("metric_count") == "3"  # kept, not counted
    store.close()
    reader = Store.in_dir(tmp_path / "exp", readonly=True)
    assert reader.metric_count() == 3
    reader.close()


def test_a_store_made_before_the_metric_count_and_indexes_gets_them_when_opened_for_writing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _trial(store, "t1", 0)
    store.add_metrics([_metric("t1", i, i / 10) for i in range(5)])
    store.close()
    # Take them away, as in a store an earlier version made.
    db = sqlite3.connect(tmp_path / "exp" / Store.FILENAME)
    db.execute("DELETE FROM meta WHERE key = 'metric_count'")
    db.execute("DROP INDEX trials_status")
    db.execute("DROP INDEX trials_final_metric")
    db.execute("DROP INDEX trials_ended")
    db.commit()
    db.close()
    old = Store.in_dir(tmp_path / "exp", readonly=True)
    assert old.meta("metric_count") is None and old.metric_count() == 5  # counted instead
    old.close()

    store = Store.in_dir(tmp_path / "exp")
    assert store.meta("metric_count") == "5"
    store.add_metrics([_metric("t1", 5, 0.5)])
    assert store.metric_count() == 6
    indexes = {r[0] for r in store._db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"trials_status", "trials_final_metric", "trials_ended"} <= indexes
    store.close()


def test_counts_by_status_and_the_best_trial_are_read_from_indexes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _trial(store, "t1", 0)
    # The statements Store runs, as SQLite would plan them: each names the index it reads.
    plans = {
        "SELECT status, count(*) FROM trials GROUP BY status": "INDEX trials_status",
        "SELECT count(*) FROM trials WHERE status = 'FAILED'": "INDEX trials_status",
        "SELECT * FROM trials WHERE final_metric BETWEEN -1e999 AND 1e999 ORDER BY final_metric DESC, seq LIMIT 1":
            "INDEX trials_final_metric",
        "SELECT ended_at, row_number() OVER w FROM trials WHERE ended_at BETWEEN -1e999 AND 1e999"
        " WINDOW w AS (ORDER BY ended_at, seq ROWS UNBOUNDED PRECEDING)": "COVERING INDEX trials_ended",
    }
    for sql, index in plans.items():
        plan = " ".join(str(r[-1]) for r in store._db.execute("EXPLAIN QUERY PLAN " + sql))
        assert index in plan, (sql, plan)
    store.close()


def test_the_best_trial_is_the_best_number_whatever_else_final_metric_holds(tmp_path: Path) -> None:
    store = _store(tmp_path)
    values: list[object] = [0.5, "not a number", None, float("inf"), -3, float("-inf"), 0.5, b"\x00", "9e9e9"]
    for seq, value in enumerate(values):
        _trial(store, f"t{seq}", seq, final_metric=value)
    assert store.best_trial(descending=True)["id"] == "t3"  # +inf; text and blobs are no numbers
    assert store.best_trial(descending=False)["id"] == "t5"  # -inf
    store.update_trial("t3", final_metric=0.5)
    store.update_trial("t5", final_metric=0.5)
    store.update_trial("t4", final_metric=0.1)
    assert store.best_trial(descending=True)["id"] == "t0"  # the first submitted of the equals
    assert store.best_trial(descending=False)["id"] == "t4"
    store.close()


def test_the_ended_series_counts_only_trials_with_a_numeric_end(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ends: list[object] = [5.0, None, "soon", 1.0, 3, float("inf")]
    for seq, end in enumerate(ends):
        _trial(store, f"t{seq}", seq, ended_at=end, final_metric=float(seq))
    assert store.ended_series(maximize=True, points=10) == [
        (1.0, 1, 3.0),
        (3.0, 2, 4.0),
        (5.0, 3, 4.0),
        (float("inf"), 4, 5.0),
    ]
    # Thinned: slices of the finite span (1 to 5) and the infinite end after them.
    assert store.ended_series(maximize=False, points=2) == [(3.0, 2, 3.0), (5.0, 3, 0.0), (float("inf"), 4, 0.0)]
    store.close()


def test_a_store_written_before_metric_runs_is_read_and_written_with_both_shapes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _trial(store, "t1", 0)
    store.close()
    # As an earlier version left it: one row per metric in `metrics`, no `metric_runs`.
    db = sqlite3.connect(tmp_path / "exp" / Store.FILENAME)
    db.execute("DROP TABLE metric_runs")
    db.executemany(
        "INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?)",
        [("t1", i, "intermediate", i / 4, json.dumps(i / 4), 100.0 + i) for i in range(3)]
        + [("t1", 3, "final", 2.0, '{"default":2.0,"loss":0.5}', 110.0)],
    )
    db.execute("DELETE FROM meta WHERE key = 'metric_count'")
    db.commit()
    db.close()
    old = [MetricRow("t1", i, "intermediate", i / 4, json.dumps(i / 4), 100.0 + i) for i in range(3)]
    old.append(MetricRow("t1", 3, "final", 2.0, '{"default":2.0,"loss":0.5}', 110.0))

    reader = Store.in_dir(tmp_path / "exp", readonly=True)
    assert reader.metrics("t1") == old == reader.metrics() == reader.metrics_of(["t1", "t2"])
    assert reader.metric_count() == 4 and reader.next_metric_index("t1") == 4
    reader.close()

    # Resumed by this version: new metrics go in runs, the old ones are still read.
    store = Store.in_dir(tmp_path / "exp")
    assert store.meta("metric_count") == "4"
    store.add_metrics(
        [MetricRow("t1", 4, "intermediate", 5.0, "5.0", 120.0), MetricRow("t1", 5, "intermediate", 6.0, "6", 121.0)]
    )
    store.add_metrics([MetricRow("t1", 3, "final", 9.0, "9.0", 130.0)])  # a replay of one in the old table
    rows = store.metrics("t1")
    assert rows == [
        *old,
        MetricRow("t1", 4, "intermediate", 5.0, "5.0", 120.0),
        MetricRow("t1", 5, "intermediate", 6.0, "6", 121.0),
    ]
    assert store.next_metric_index("t1") == 6
    # The replayed one is read once (the first write wins) but counted as added: a write does
    # not look in the old table, which only a store resumed by this version has.
    assert store.metric_count() == 7
    store.close()


def test_a_run_is_one_row_and_reads_back_as_its_metrics(tmp_path: Path) -> None:
    from trialkeeper.coordinator.engine.rows import MetricRun

    store = _store(tmp_path)
    store.add_runs([
        MetricRun("t1", "intermediate", 0, [0.5 * i for i in range(1000)], None, [1.0] * 1000),
        MetricRun("t1", "intermediate", 1000, [1.0, 2.0], ['{"default":1.0}', ""], [2.0, 3.0]),
        MetricRun("t2", "final", 7, [1e308], None, [4.0]),
    ])
    assert store._db.execute("SELECT count(*) FROM metric_runs").fetchone()[0] == 3
    rows = store.metrics("t1")
    assert [r.index for r in rows] == list(range(1002))
    assert rows[3] == MetricRow("t1", 3, "intermediate", 1.5, "1.5", 1.0)
    assert rows[-2:] == [
        MetricRow("t1", 1000, "intermediate", 1.0, '{"default":1.0}', 2.0),
        MetricRow("t1", 1001, "intermediate", 2.0, "2.0", 3.0),
    ]
    assert store.metrics("t2") == [MetricRow("t2", 7, "final", 1e308, "1e+308", 4.0)]
    assert store.next_metric_index("t1") == 1002 and store.next_metric_index("t2") == 8
    # A replay split otherwise: only what was not stored is added, the first write wins.
    store.add_runs([MetricRun("t1", "intermediate", 998, [9.0] * 6, None, [5.0] * 6)])
    rows = store.metrics("t1")
    assert [r.index for r in rows] == list(range(1004))
    assert [r.value for r in rows[996:]] == [498.0, 498.5, 499.0, 499.5, 1.0, 2.0, 9.0, 9.0]
    assert store.metric_count() == 1003 + 2
