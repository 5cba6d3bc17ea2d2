"""The store's change counter: it moves once for each committed write of trial rows or results,
with the write; other writes, and a write rolled back, leave it; a store made before it gets
it when opened for writing."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine.rows import GpuSampleRow, MetricRow
from trialkeeper.coordinator.store.reads import StoreReader
from trialkeeper.coordinator.store.store import Store


def _trial(store: Store, trial_id: str, seq: int) -> None:
    store.insert_trial({"id": trial_id, "seq": seq, "status": "WAITING", "parameters_json": json.dumps({"x": seq}),
                        "command": "c", "gpu_number": 0, "submitted_at": 1000.0 + seq})


def test_each_write_of_trials_or_results_moves_the_counter_and_no_other_write_does(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "changes", {})
    reader = StoreReader.in_dir(tmp_path)  # read-only, as a dashboard of another process reads it
    seen = [reader.changes()]
    assert isinstance(seen[0], int)

    def moved() -> bool:
        seen.append(reader.changes())
        return seen[-1] != seen[-2]

    store.insert_env("env-0", "local", "BUSY")
    store.update_env("env-0", hostname="h", last_seq=7)
    store.set_connected("env-0", True)
    store.record("environment", "env-0", "STARTING", "BUSY", "")
    store.add_gpu_samples([GpuSampleRow(1.0, "env-0", "G", 5.0, 1, 2, ())])
    store.set_meta("bound_address", "127.0.0.1:1")
    assert not moved()  # an environment, an event, a sample, meta: the trials are as they were
    _trial(store, "t0", 0)
    assert moved()
    _trial(store, "t1", 1)
    assert moved()
    store.update_trial("t0", status="RUNNING")
    assert moved()
    store.set_waiting_reasons({"t1": "no free GPU"})
    assert moved()
    store.set_waiting_reasons({"t1": "no free GPU"})  # unchanged: nothing written
    assert not moved()
    store.add_metrics([MetricRow("t0", 0, "intermediate", 0.5, "0.5", 1.0)])
    assert moved()
    store.add_metrics([MetricRow("t0", 0, "intermediate", 0.5, "0.5", 1.0)])  # a replay: stored once before
    assert not moved()
    store.keep(ck.CheckpointRecorded(ck.Checkpoint("t0", 1, 1, 10, "d", (), "", 2.0)))
    assert moved()
    store.keep(ck.MetricsSuperseded("t0", 0, 3.0))
    assert moved() and store.metric_count() == 0
    # Many writes in one transaction: one move, at its commit, none before.
    with store.transaction():
        store.update_trial("t0", status="PAUSED")
        store.update_trial("t1", status="RUNNING")
        store.add_metrics([MetricRow("t1", 0, "intermediate", 0.1, "0.1", 4.0)])
        assert not moved()
    assert moved() and seen[-1] == seen[-2] + 1
    # A transaction rolled back writes nothing, the counter included.
    with pytest.raises(RuntimeError, match="abandoned"), store.transaction():
        store.update_trial("t0", status="RUNNING")
        raise RuntimeError("abandoned")
    assert not moved() and reader.trial("t0")["status"] == "PAUSED"  # type: ignore[index]
    reader.close()
    store.close()


def test_a_store_made_before_the_counter_gets_it_when_opened_for_writing(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path)
    store.create_experiment("e1", "old", {})
    _trial(store, "t0", 0)
    store.close()
    db = sqlite3.connect(tmp_path / Store.FILENAME)
    with db:
        db.execute("DELETE FROM meta WHERE key = 'changes'")  # as an earlier version left it
    db.close()
    reader = StoreReader.in_dir(tmp_path)
    assert reader.changes() is None  # read-only, it is not migrated
    store = Store.in_dir(tmp_path)
    first = reader.changes()
    assert isinstance(first, int)
    store.update_trial("t0", status="RUNNING")
    assert reader.changes() == first + 1
    store.close()
    reader.close()
    # A store made anew in the same directory does not start where the other one did.
    made = []
    for n in range(3):
        (tmp_path / f"new{n}").mkdir()
        fresh = Store.in_dir(tmp_path / f"new{n}")
        made.append(fresh.changes())
        fresh.close()
    assert len(set(made)) == 3, made
