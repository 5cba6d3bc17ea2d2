"""The read model against real store files: what it shows, the same from a writer's store and
a read-only one, and bad rows shown as unreadable rather than raised."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.read.model import ReadModel, list_experiments, to_json
from trialkeeper.coordinator.store.store import GpuSampleRow, MetricRow, Store

GPU = {
    "index": 0,
    "uuid": "GPU-a",
    "name": "Tesla T4",
    "memory_total_bytes": 16 * 2**30,
    "simulated": False,
    "mig": False,
}


def _experiment(exp_dir: Path, *, mode: str = "maximize") -> Store:
    """A store with: t1 SUCCEEDED (0.5), t2 SUCCEEDED (0.9), t3 RUNNING and being stopped,
    t4 WAITING with a reason; env-1 connected with one sampled GPU, env-2 stopped."""
    store = Store.in_dir(exp_dir)
    config = {"trialCommand": "python t.py", "tuner": {"name": "random", "classArgs": {"optimize_mode": mode}}}
    store.create_experiment("exp1", "demo", config)
    store.set_coordinator_address("127.0.0.1:5000")
    for seq, tid in enumerate(("t1", "t2", "t3", "t4")):
        store.insert_trial({
            "id": tid, "seq": seq, "status": "WAITING", "parameters_json": json.dumps({"x": seq}),
            "command": "python t.py", "gpu_number": 1, "submitted_at": 1000.0 + seq,
        })
    store.insert_env("env-1", "local", "READY")
    store.update_env("env-1", hostname="host-a", info_json=json.dumps({"gpus": [GPU], "gpu_unavailable_reason": ""}))
    store.set_connected("env-1", True)
    store.insert_env("env-2", "local", "STOPPED")
    for tid, value in (("t1", 0.5), ("t2", 0.9)):
        store.update_trial(tid, status="SUCCEEDED", environment_id="env-1", final_metric=value,
                           final_metric_json=json.dumps({"default": value}), started_at=1100.0, ended_at=1200.0)
    store.update_trial(
        "t3",
        status="RUNNING",
        environment_id="env-1",
        gpu_indices_json="[0]",
        reason="canceled by the user",
        stopping=1,
    )
    store.record("trial", "t3", "WAITING", "RUNNING", "running on env-1")
    store.add_metrics(
        [
            MetricRow("t3", 0, "intermediate", 0.25, "0.25", 1300.0),
            MetricRow("t3", 1, "intermediate", 0.5, "0.5", 1301.0),
        ]
    )
    store.set_waiting_reasons({"t4": "waiting: 1 trials are running (trialConcurrency)"})
    store.add_gpu_samples([
        GpuSampleRow(1400.0, "env-1", "GPU-a", 10.0, 2**30, 16 * 2**30, ("t3",)),
        GpuSampleRow(1401.0, "env-1", "GPU-a", 70.0, 3 * 2**30, 16 * 2**30, ("t3",)),
    ])
    return store


def test_snapshots_of_an_experiment(tmp_path: Path) -> None:
    _experiment(tmp_path / "exp").close()
    with ReadModel.open(tmp_path / "exp") as model:
        exp = model.experiment()
        trials = {t.id: t for t in model.trials()}
        envs = {e.id: e for e in model.environments()}
        detail = model.trial_detail("t3")
    assert exp is not None
    assert (exp.id, exp.name, exp.status, exp.coordinator_address) == ("exp1", "demo", "RUNNING", "127.0.0.1:5000")
    assert dict(exp.trials) == {"RUNNING": 1, "SUCCEEDED": 2, "WAITING": 1} and exp.trial_count == 4
    assert exp.best is not None and exp.best.id == "t2" and exp.environments == 2 and exp.metrics == 2
    assert exp.unreadable == ()

    assert trials["t4"].status is TrialStatus.WAITING
    assert trials["t4"].waiting_reason == "waiting: 1 trials are running (trialConcurrency)"
    assert trials["t3"].stopping and trials["t3"].reason == "canceled by the user" and trials["t3"].waiting_reason == ""
    assert trials["t2"].final_metric_value == {"default": 0.9} and trials["t2"].parameters == {"x": 1}

    env = envs["env-1"]
    assert env.connected and env.status is EnvStatus.READY and env.hostname == "host-a"
    assert env.trials == ("t1", "t2", "t3") and env.running_trials == ("t3",) and env.stopping_trials == ("t3",)
    (gpu,) = env.gpus
    # The latest sample, and the trial holding the GPU.
    assert (gpu.utilization_percent, gpu.memory_used_bytes, gpu.sampled_at, gpu.held_by) == (
        70.0,
        3 * 2**30,
        1401.0,
        ("t3",),
    )
    assert not envs["env-2"].connected and envs["env-2"].gpus == ()
    # Without the trials each ran (what the live progress reads): the GPUs and their holders stay.
    with ReadModel.open(tmp_path / "exp") as model:
        bare = {e.id: e for e in model.environments(latest=0)}
    assert bare["env-1"].trials == () and bare["env-1"].gpus == env.gpus
    assert bare["env-1"].running_trials == ("t3",) and bare["env-1"].stopping_trials == ("t3",)

    assert detail is not None and detail.intermediate == (0.25, 0.5)
    assert detail.gpu_usage.samples == 2 and detail.gpu_usage.max_utilization_percent == 70.0
    assert detail.gpu_usage.peak_memory_used_bytes == 3 * 2**30 and detail.gpu_usage.gpus == ("GPU-a",)
    assert [(h.old, h.new) for h in detail.history] == [("WAITING", "RUNNING")]
    json.dumps(to_json(detail))  # plain JSON data


def test_best_trial_follows_the_optimize_mode(tmp_path: Path) -> None:
    _experiment(tmp_path / "exp", mode="minimize").close()
    with ReadModel.open(tmp_path / "exp") as model:
        exp = model.experiment()
    assert exp is not None and exp.optimize_mode == "minimize" and exp.best is not None and exp.best.id == "t1"


def test_the_writers_store_and_a_readonly_one_give_the_same_snapshots(tmp_path: Path) -> None:
    store = _experiment(tmp_path / "exp")
    live = ReadModel(store)
    with ReadModel.open(tmp_path / "exp") as model:
        assert live.experiment() == model.experiment()
        assert live.trials() == model.trials()
        assert live.environments() == model.environments()
        assert live.trial_detail("t3") == model.trial_detail("t3")
    store.close()


def test_waiting_reasons_are_written_only_when_they_change(tmp_path: Path) -> None:
    store = _experiment(tmp_path / "exp")
    db = sqlite3.connect(tmp_path / "exp" / Store.FILENAME, isolation_level=None)
    reason = "waiting: 1 trials are running (trialConcurrency)"
    db.execute("UPDATE trials SET waiting_reason = 'marker' WHERE id = 't4'")
    store.set_waiting_reasons({"t4": reason})  # unchanged: not written again
    assert db.execute("SELECT waiting_reason FROM trials WHERE id = 't4'").fetchone()[0] == "marker"
    store.set_waiting_reasons({"t4": "waiting: no environment is ready yet", "t3": "starting on env-1"})
    rows = dict(db.execute("SELECT id, waiting_reason FROM trials WHERE id IN ('t3', 't4')").fetchall())
    assert rows == {"t4": "waiting: no environment is ready yet", "t3": "starting on env-1"}
    db.close()
    store.close()


def test_a_store_opened_for_writing_has_no_connected_agent(tmp_path: Path) -> None:
    # A crashed coordinator left env-1 connected; the one that resumes has no agent yet.
    _experiment(tmp_path / "exp").close()
    with ReadModel.open(tmp_path / "exp") as model:
        assert model.environments()[0].connected
    Store.in_dir(tmp_path / "exp").close()
    with ReadModel.open(tmp_path / "exp") as model:
        assert not model.environments()[0].connected


def test_a_store_from_before_the_added_columns(tmp_path: Path) -> None:
    """Read-only, an older store lacks the new columns: defaults. Its stopping trials said
    so in their reason. Opened for writing, it gets the columns."""
    _experiment(tmp_path / "exp").close()
    path = tmp_path / "exp" / Store.FILENAME
    with sqlite3.connect(path) as db:
        db.execute("UPDATE trials SET reason = 'stopping: canceled by the user' WHERE id = 't3'")
        for table, column in (("trials", "waiting_reason"), ("trials", "stopping"), ("environments", "connected")):
            db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    with ReadModel.open(tmp_path / "exp") as model:
        trials = {t.id: t for t in model.trials()}
        envs = model.environments()
    assert trials["t4"].waiting_reason == "" and not envs[0].connected
    assert trials["t3"].stopping and trials["t3"].reason == "canceled by the user"
    assert all(t.unreadable == () for t in trials.values())
    store = Store.in_dir(tmp_path / "exp")
    store.set_waiting_reasons({"t4": "waiting: x"})
    store.set_connected("env-1", True)
    store.close()
    with ReadModel.open(tmp_path / "exp") as model:
        assert model.trial("t4").waiting_reason == "waiting: x"  # type: ignore[union-attr]
        assert model.environments()[0].connected


BAD_ROWS = [
    "UPDATE trials SET final_metric_json = '}{' WHERE id = 't1'",
    "UPDATE trials SET parameters_json = 'not json' WHERE id = 't2'",
    "UPDATE trials SET status = 'BOGUS', gpu_indices_json = '{' WHERE id = 't3'",
    "UPDATE trials SET final_metric = 'abc', submitted_at = 'yesterday' WHERE id = 't4'",
    "UPDATE environments SET info_json = 'garbage', status = 'WANDERING' WHERE id = 'env-1'",
    "UPDATE environments SET info_json = '{\"gpus\": [{\"index\": \"zero\", \"uuid\": 7}]}' WHERE id = 'env-2'",
    "UPDATE experiment SET config_json = '[1, 2'",
    "UPDATE events SET at = 'then'",
    "UPDATE gpu_samples SET trial_ids_json = '}'",
    (
        "INSERT INTO gpu_samples (at, environment_id, uuid, utilization, memory_used_bytes, memory_total_bytes,"
        " trial_ids_json) VALUES (1500.0, 'env-1', 'GPU-a', 'busy', 'lots', 0, '[\"t3\"]')"
    ),
]


def corrupt(exp_dir: Path) -> None:
    """Write rows an older version could have stored, straight into the store."""
    with sqlite3.connect(exp_dir / Store.FILENAME) as db:
        for sql in BAD_ROWS:
            db.execute(sql)


def test_bad_rows_are_shown_as_unreadable(tmp_path: Path) -> None:
    _experiment(tmp_path / "exp").close()
    corrupt(tmp_path / "exp")
    with ReadModel.open(tmp_path / "exp") as model:
        exp = model.experiment()
        trials = {t.id: t for t in model.trials()}
        envs = {e.id: e for e in model.environments()}
        details = [model.trial_detail(t) for t in trials]
    assert exp is not None and exp.optimize_mode == "maximize"
    assert exp.unreadable and "config_json: unreadable (not JSON)" in exp.unreadable[0]
    assert dict(exp.trials) == {"SUCCEEDED": 2, "UNREADABLE": 1, "WAITING": 1}

    t1, t2, t3, t4 = (trials[t] for t in ("t1", "t2", "t3", "t4"))
    assert t1.final_metric_value is None and t1.final_metric == 0.5
    assert t1.unreadable == ("final_metric_json: unreadable (not JSON): '}{'",)
    assert t2.parameters is None and "parameters_json: unreadable (not JSON)" in t2.unreadable[0]
    assert t3.status is None and t3.gpu_indices == () and not t3.active
    assert any("status: unreadable" in n and "BOGUS" in n for n in t3.unreadable)
    assert t4.final_metric is None and t4.submitted_at is None and len(t4.unreadable) == 2
    assert exp.best is not None and exp.best.id == "t2"  # t4's metric is unreadable

    assert envs["env-1"].status is None and envs["env-1"].gpus == ()
    assert any("info_json: unreadable (not JSON)" in n for n in envs["env-1"].unreadable)
    (gpu,) = envs["env-2"].gpus
    assert gpu.index is None and gpu.uuid == "" and len(envs["env-2"].unreadable) == 2
    assert all(d is not None and all(h.at is None for h in d.history) for d in details)
    # The samples that lost their trials are no one's; the one with words for figures is left out.
    assert all(d is not None and d.gpu_usage.samples == 0 for d in details)
    json.dumps(to_json([exp, trials, envs, details]))


def test_list_experiments(tmp_path: Path) -> None:
    root = tmp_path / "work"
    _experiment(root / "b").close()
    store = Store.in_dir(root / "a")
    store.create_experiment("exp0", None, {})
    store.close()
    for name, started in (("a", 2000.0), ("b", 1000.0)):
        with sqlite3.connect(root / name / Store.FILENAME) as db:
            db.execute("UPDATE experiment SET created_at = ?", (started,))
    (root / "junk").mkdir()
    (root / "junk" / Store.FILENAME).write_text("not a database\n" * 100)
    (root / "empty").mkdir()
    found = list_experiments(root)
    assert [e.id for e in found] == ["exp1", "exp0", "junk"]  # by start; no start time: last
    assert found[0].best is not None and found[0].trial_count == 4 and found[1].name is None
    junk = next(e for e in found if e.id == "junk")
    assert junk.status == "" and "cannot open the experiment store" in junk.unreadable[0]
    assert list_experiments(tmp_path / "missing") == []


@pytest.mark.parametrize("raw", ["}{", "[1, 2", "", "NaN"])
def test_to_json_of_an_unreadable_or_odd_value_is_plain_json(tmp_path: Path, raw: str) -> None:
    store = _experiment(tmp_path / "exp")
    store.update_trial("t1", final_metric_json=raw)
    trial = ReadModel(store).trial("t1")
    assert trial is not None
    text = json.dumps(to_json(trial), allow_nan=False)
    assert json.loads(text)["id"] == "t1"
    store.close()
