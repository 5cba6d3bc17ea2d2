"""Answers kept until the trials change, read from a real store by a read-only model as the
dashboard reads it: two changes that leave every count as it was still change the answer (the
store's change counter moved), an unchanged store answers with one lookup, and a store made
before the counter is kept by SQLite's count of commits."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from trialkeeper.coordinator.read.kept import Kept
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.store.store import GpuSampleRow, Store
from trialkeeper.coordinator.ui import plots

WRITER_TIMEOUT_S = 120  # a second Python process on a loaded machine


def _trial(store: Store, seq: int, status: str, **extra: Any) -> None:
    store.insert_trial({"id": f"t{seq}", "seq": seq, "status": status, "parameters_json": json.dumps({"x": seq}),
                        "command": "c", "gpu_number": 0, "submitted_at": float(seq), **extra})


def _statuses(answer: dict[str, Any]) -> dict[str, str]:
    return {t["id"]: t["status"] for t in answer["trials"]}


def _experiment(exp: Path) -> Store:
    """t0 running, t1 paused, t2 waiting, t3 succeeded."""
    store = Store.in_dir(exp)
    store.create_experiment("e1", "kept", {"tuner": {"name": "random", "classArgs": {"optimize_mode": "maximize"}}})
    for seq, status in enumerate(("RUNNING", "PAUSED", "WAITING")):
        _trial(store, seq, status)
    _trial(store, 3, "SUCCEEDED", final_metric=0.5, final_metric_json="0.5")
    return store


# Changes that leave the counts by status and the count of metrics as they were.
SWAPS = {
    "one trial paused as another continues": (
        ("t0", {"status": "PAUSED"}), ("t1", {"status": "RUNNING"}),
    ),
    "one trial waits again (its environment was lost) as a waiting one starts": (
        ("t0", {"status": "WAITING", "environment_id": None}), ("t2", {"status": "RUNNING", "environment_id": "env-0"}),
    ),
}


def _write(store: Store, swap: tuple[tuple[str, dict[str, Any]], ...]) -> None:
    with store.transaction():
        for trial_id, fields in swap:
            store.update_trial(trial_id, **fields)


@pytest.mark.parametrize("swap", list(SWAPS), ids=list(SWAPS))
def test_changes_that_leave_every_count_as_it_was_still_change_the_kept_comparison(tmp_path: Path, swap: str) -> None:
    store = _experiment(tmp_path)
    with ReadModel.open(tmp_path) as model:
        before = plots.compare(model, {})
        counts, metrics = model.trial_counts(), model.experiment().metrics  # type: ignore[union-attr]
        _write(store, SWAPS[swap])
        assert (model.trial_counts(), model.experiment().metrics) == (counts, metrics)  # type: ignore[union-attr]
        after = plots.compare(model, {})
        assert after is not before
        expected = {trial_id: fields["status"] for trial_id, fields in SWAPS[swap]}
        assert {k: _statuses(after)[k] for k in expected} == expected
        assert plots.compare(model, {}) is after  # and kept again
    store.close()


def test_changes_another_process_writes_reach_a_kept_answer_read_only(tmp_path: Path) -> None:
    store = _experiment(tmp_path)
    store.close()
    kept: Kept[dict[str, str]] = Kept()
    with ReadModel.open(tmp_path) as model:
        def statuses() -> dict[str, str]:
            return kept.get(model, "statuses", lambda: {t.id: t.status.value for t in model.trials()})

        assert statuses()["t0"] == "RUNNING"
        writer = textwrap.dedent(f"""
            from pathlib import Path
            from trialkeeper.coordinator.store.store import Store
            store = Store.in_dir(Path({str(tmp_path)!r}))
            with store.transaction():
                store.update_trial("t0", status="PAUSED")
                store.update_trial("t1", status="RUNNING")
            store.close()
        """)
        subprocess.run([sys.executable, "-c", writer], check=True, timeout=WRITER_TIMEOUT_S)
        assert (statuses()["t0"], statuses()["t1"]) == ("PAUSED", "RUNNING")


def test_an_unchanged_store_answers_from_the_kept_answer_with_one_lookup(tmp_path: Path) -> None:
    store = _experiment(tmp_path)
    store.insert_env("env-0", "local", "BUSY")
    computed: list[int] = []
    kept: Kept[int] = Kept()
    with ReadModel.open(tmp_path) as model:
        def answer() -> int:
            return kept.get(model, "n", lambda: computed.append(1) or len(computed))

        assert answer() == 1
        statements: list[str] = []
        model.store._db.set_trace_callback(statements.append)
        assert answer() == answer() == 1
        assert len(statements) == 2 and all("FROM meta" in s for s in statements), statements
        # Writes other than the trials' and results' keep it: a sample, an event, an agent's sequence.
        store.add_gpu_samples([GpuSampleRow(1.0, "env-0", "G", 5.0, 1, 2, ())])
        store.record("trial", "t0", "WAITING", "RUNNING", "")
        store.update_env("env-0", last_seq=9)
        assert answer() == 1 and computed == [1]
        store.update_trial("t0", waiting_reason="")  # any write of a trial row
        assert answer() == 2
    store.close()


def test_a_store_made_before_the_counter_is_kept_until_anything_is_committed(tmp_path: Path) -> None:
    _experiment(tmp_path).close()
    db = sqlite3.connect(tmp_path / Store.FILENAME, isolation_level=None)
    db.execute("DELETE FROM meta WHERE key = 'changes'")  # as an earlier version left it
    computed: list[str] = []
    kept: Kept[str] = Kept()
    with ReadModel.open(tmp_path) as model:
        def status() -> str:
            return kept.get(model, "t0", lambda: computed.append("") or str(model.trial("t0").status.value))  # type: ignore[union-attr]

        assert status() == status() == "RUNNING" and len(computed) == 1  # nothing committed: kept
        db.execute("UPDATE trials SET status = 'PAUSED' WHERE id = 't0'")  # an earlier version's writer
        assert status() == "PAUSED" and len(computed) == 2
        assert status() == "PAUSED" and len(computed) == 2
    db.close()
