"""What the store keeps of each fact the decision core records (``store/facts.py``), through
a real store in a temporary directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.book import TrialBook
from trialkeeper.coordinator.engine.model import RankInfo
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.store.facts import WRITES, writes_of
from trialkeeper.coordinator.store.store import Store

WALL = 1.7e9

# One of each fact, in an order a store can take them in (rows inserted before updated).
SAMPLES: dict[type, ev.Fact] = {f.__class__: f for f in (
    ev.TrialAdded("t1", 0, TrialStatus.WAITING, {"lr": 0.1}, "python train.py", 1, WALL,
                  ("local",)),
    ev.EnvironmentAdded("env-1", "local", EnvStatus.REQUESTED, WALL),
    ev.EnvironmentGrouped("env-1", "env-1", "t1"),
    ev.EnvironmentLaunched("env-1", "pid-1"),
    ev.EnvironmentWaits("env-1", "pending: no free node"),
    ev.EnvironmentStatusChanged("env-1", "REQUESTED", EnvStatus.STARTING, "started (pid-1)"),
    ev.AgentJoined("env-1", "host-a", "i-1", {"gpus": []}),
    ev.AgentConnected("env-1", True),
    ev.AgentMessagesStored("env-1", 3),
    ev.EnvironmentLeft("env-1"),
    ev.WaitingReasonsChanged({"t1": "waiting: no free GPU"}),
    ev.TrialPlaced("t1", "env-1", (0,), ("GPU-a",), 1),
    ev.TrialUnplaced("t1"),
    ev.TrialRan("t1", WALL + 1),
    ev.TrialRanks("t1", (RankInfo(0, "env-1", (0,), "running"), RankInfo(1, "env-2", (), "ended (failed)"))),
    ev.TrialStopping("t1", "by the user"),
    ev.TrialExited("t1", None, 15, "Terminated"),
    ev.FinalResultSet("t1", 0.5, '{"default": 0.5}'),
    ev.TrialStatusChanged("t1", "RUNNING", TrialStatus.USER_CANCELED, "by the user",
                          "by the user", WALL + 2),
    ck.CheckpointRecorded(ck.Checkpoint(
        "t1", 3, 2, 10, "sha256:ab", (ck.CheckpointFile("model.pt", 10, 0o644),), "", WALL + 1, "env-1",
    )),
    ck.CheckpointDigestKnown("t1", 3, "sha256:cd"),
    ck.CheckpointRemoved("t1", 3, WALL + 3),
    ck.MetricsSuperseded("t1", 2, WALL + 3),
    ck.TrialRetried("t1", 1, False),
    ck.TrialParametersChanged("t1", {"lr": 0.2}),
    ck.TrialForked("t1", ("t0", 4)),
)}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.in_dir(tmp_path)
    yield s
    s.close()


def test_every_fact_has_its_writes_and_nothing_else_is_there() -> None:
    assert set(WRITES) == set(ev.FACTS)
    assert set(SAMPLES) == set(ev.FACTS)  # a new fact needs a sample here too
    for fact in SAMPLES.values():
        assert writes_of(fact), type(fact).__name__


def test_every_fact_is_kept_by_a_real_store(store: Store) -> None:
    for fact in SAMPLES.values():
        store.keep(fact)  # an unknown column or table would raise
    trial = store.trial("t1")
    assert trial is not None
    assert (trial["status"], trial["exit_code"], trial["signal"], trial["stopping"]) == (
        "USER_CANCELED", None, 15, 1)
    assert json.loads(trial["forked_from_json"]) == ["t0", 4]
    assert json.loads(trial["ranks_json"]) == [[0, "env-1", [0], "running"], [1, "env-2", [], "ended (failed)"]]
    (env,) = store.envs()
    assert (env["status"], env["platform_id"], env["reason"], env["group_id"], env["group_for"], env["agent_left"]) == (
        "STARTING", "pid-1", "started (pid-1)", "env-1", "t1", 1)


def test_a_trial_added_placed_and_succeeded(store: Store) -> None:
    store.keep(ev.TrialAdded("t1", 0, TrialStatus.WAITING, {"lr": 0.1}, "python train.py", 1,
                             WALL, ("a", "b")))
    store.keep(ev.TrialPlaced("t1", "env-1", (1,), ("GPU-b",), 2))
    store.keep(ev.TrialRan("t1", WALL + 1))
    store.keep(ev.TrialStatusChanged("t1", "RUNNING", TrialStatus.SUCCEEDED, "", "exit 0",
                                     WALL + 9))
    row = store.trial("t1")
    assert row is not None
    assert {k: row[k] for k in (
        "seq", "status", "parameters_json", "command", "gpu_number", "submitted_at",
        "platforms_json", "environment_id", "gpu_indices_json", "gpu_uuids_json", "attempts",
        "started_at", "ended_at", "reason",
    )} == {
        "seq": 0, "status": "SUCCEEDED", "parameters_json": '{"lr": 0.1}',
        "command": "python train.py", "gpu_number": 1, "submitted_at": WALL,
        "platforms_json": '["a", "b"]', "environment_id": "env-1", "gpu_indices_json": "[1]",
        "gpu_uuids_json": '["GPU-b"]', "attempts": 2, "started_at": WALL + 1,
        "ended_at": WALL + 9, "reason": "",
    }
    assert [(e["entity"], e["entity_id"], e["old"], e["new"], e["reason"])
            for e in store.events("t1")] == [("trial", "t1", "RUNNING", "SUCCEEDED", "exit 0")]


def test_a_trial_without_platforms_stores_the_empty_list(store: Store) -> None:
    store.keep(ev.TrialAdded("t1", 0, TrialStatus.WAITING, {}, "true", 0, WALL))
    store.keep(ev.WaitingReasonsChanged({"t1": "waiting: no environment yet"}))
    row = store.trial("t1")
    assert row is not None
    assert (row["platforms_json"], row["waiting_reason"]) == ("[]", "waiting: no environment yet")


def test_an_environment_added_joined_and_numbered(store: Store) -> None:
    store.keep(ev.EnvironmentAdded("env-1", "local", EnvStatus.REQUESTED, WALL))
    info = {"gpus": [{"uuid": "GPU-a", "index": 0}], "version": "1"}
    store.keep(ev.AgentJoined("env-1", "host-a", "i-1", info))
    store.keep(ev.AgentConnected("env-1", True))
    store.keep(ev.AgentMessagesStored("env-1", 7))
    (row,) = store.envs()
    assert {k: row[k] for k in (
        "id", "platform", "status", "created_at", "hostname", "agent_instance_id", "last_seq",
        "connected",
    )} == {
        "id": "env-1", "platform": "local", "status": "REQUESTED", "created_at": WALL,
        "hostname": "host-a", "agent_instance_id": "i-1", "last_seq": 7, "connected": 1,
    }
    assert json.loads(row["info_json"]) == info
    # A new agent instance starts its numbering again.
    store.keep(ev.AgentJoined("env-1", "host-b", "i-2", {}))
    (row,) = store.envs()
    assert (row["agent_instance_id"], row["last_seq"], row["info_json"]) == ("i-2", 0, "{}")


def test_an_environment_status_change_is_kept_with_its_history(store: Store) -> None:
    store.keep(ev.EnvironmentAdded("env-1", "local", EnvStatus.REQUESTED, WALL))
    store.keep(ev.EnvironmentStatusChanged("env-1", "REQUESTED", EnvStatus.FAILED, "no quota",
                                           WALL + 3))
    (row,) = store.envs()
    assert (row["status"], row["reason"], row["ended_at"]) == ("FAILED", "no quota", WALL + 3)
    assert [(e["entity"], e["old"], e["new"], e["reason"]) for e in store.events("env-1")] == [
        ("environment", "REQUESTED", "FAILED", "no quota")]


def test_an_ended_environment_started_again_is_a_fresh_row_and_keeps_its_history(store: Store) -> None:
    store.keep(ev.EnvironmentAdded("box-a", "manual", EnvStatus.STARTING, WALL))
    store.keep(ev.AgentJoined("box-a", "host-a", "i-1", {"version": "1"}))
    store.keep(ev.EnvironmentStatusChanged("box-a", "STARTING", EnvStatus.STOPPED, "left", WALL + 3))
    store.keep(ev.EnvironmentAdded("box-a", "manual", EnvStatus.STARTING, WALL + 9, again=True))
    (row,) = store.envs()
    assert (row["status"], row["reason"], row["ended_at"], row["created_at"], row["agent_instance_id"]) == (
        "STARTING", "", None, WALL + 9, "")
    assert [e["new"] for e in store.events("box-a")] == ["STOPPED"]


def test_a_retried_trial_stored_and_restored_waits_placed_nowhere(store: Store) -> None:
    policy = Policy("exp", 2, (PlatformPolicy("local", True, 1, 1),), max_trial_retries=1,
                    retry_failed_trials=True)
    book = TrialBook(policy)
    book.submit(ev.TrialSubmitted("t1", {}, "python train.py", 0, 0))
    book.queue.remove("t1")  # as a scheduling pass does
    book.placed("t1", "env-1", (), ())
    book.started("env-1", ev.TrialStartReported("t1", 42, WALL))
    book.ended("env-1", ev.TrialEndReported("t1", ev.Outcome.FAILED, 1, None, "", "", WALL),
               platform="local")
    assert book.trials["t1"].env_id is None  # in memory, it waits placed nowhere
    for fact in book.take():
        if isinstance(fact, ev.FACTS):
            store.keep(fact)
    row = store.trial("t1")
    assert row is not None
    assert (row["status"], row["environment_id"]) == ("WAITING", None)
    # After a crash the trial waits again; it is not taken as running on env-1 (where its
    # agent would be sent it again as attempt 1, its metrics indexed from 0 once more).
    restored = TrialBook(policy)
    restored.restore(store.trials())
    assert restored.trials["t1"].env_id is None
