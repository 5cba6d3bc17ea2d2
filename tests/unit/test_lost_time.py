"""A lost attempt's time: it ends when the coordinator last heard of its environment, not
when the loss is noticed (a timeout later). An attempt's end is not the trial's: a trial
retried or paused has no end, in the engine or in the store, until it ends for good."""

from __future__ import annotations

from pathlib import Path

from test_checkpoints_engine import saved
from test_engine import Sim, ready_sim, running
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.store.store import Store


def _silent(sim: Sim, env_id: str, seconds: float) -> None:
    """``seconds`` pass in which only the other environments' agents are heard."""
    others = [e for e in sim.engine.envs if e != env_id and sim.engine.envs[e].status is not EnvStatus.FAILED]
    for _ in range(int(seconds)):
        sim.advance(1.0)
        for other in others:
            sim.feed(ev.HeartbeatReceived(other, sim.links[other], False))
        sim.feed(ev.EnvironmentsPolled({}))


def _beats(sim: Sim, env_id: str, seconds: int) -> None:
    for _ in range(seconds):
        sim.advance(1.0)
        sim.feed(ev.HeartbeatReceived(env_id, sim.links[env_id], False))


def test_a_lost_attempt_ends_at_the_last_heartbeat_retried_or_failed() -> None:
    sim = ready_sim(max_trial_retries=1)
    first = running(sim)
    _beats(sim, first, 5)
    _silent(sim, first, 45)  # unreachable after 10 s, lost after 30 more
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.WAITING and t.ran_s == 5.0, (t.status, t.ran_s)
    assert t.ended_at is None  # waiting again: no end
    changed = [c for c in sim.take(ev.TrialStatusChanged) if c.new is TrialStatus.WAITING]
    assert changed[-1].ran_s == 5.0
    # The second attempt, on the replacement, lost in turn: its end is its last heartbeat too.
    sim.advance(5.0)
    sim.feed(ev.Ticked())
    for env_id in sim.started_envs():
        sim.register(env_id)
    sim.feed(ev.Ticked())
    second = t.env_id
    assert second is not None and second != first
    sim.run(second, "t1")
    _beats(sim, second, 3)
    heard = 1.7e9 + sim.now
    _silent(sim, second, 45)
    assert t.status is TrialStatus.FAILED and "environment lost" in t.reason
    assert (t.ran_s, t.ended_at) == (8.0, heard)


def test_a_trial_lost_at_once_keeps_the_time_it_ran_to_its_loss() -> None:
    sim = ready_sim(max_trial_retries=1)
    env_id = running(sim)
    _beats(sim, env_id, 4)
    sim.end(env_id, "t1", ev.Outcome.LOST)  # its agent said so: it ended then
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.WAITING and t.ran_s == 4.0 and t.ended_at is None


def _kept(sim: Sim, store: Store, trial_id: str) -> tuple[float | None, float]:
    """The store keeps the engine's facts, as the shell does: the trial's stored end and time run."""
    for i in sim.out:
        if isinstance(i, ev.FACTS):
            store.keep(i)
    sim.out.clear()
    row = store.trial(trial_id)
    assert row is not None
    return row["ended_at"], row["ran_s"]


def _placed_again(sim: Sim, trial_id: str) -> str:
    """Where a retried or continued trial is placed, past its backoff."""
    sim.advance(5.0)
    sim.feed(ev.Ticked())
    env_id = sim.engine.trials[trial_id].env_id
    assert env_id is not None
    return env_id


def test_only_a_trials_own_end_is_its_end_not_an_attempts_it_was_retried_or_paused_after(tmp_path: Path) -> None:
    sim = ready_sim(max_trial_retries=3, pause_grace_s=30.0)
    store = Store.in_dir(tmp_path)
    try:
        t = sim.engine.trials
        env_id = running(sim)
        _beats(sim, env_id, 4)
        sim.end(env_id, "t1", ev.Outcome.LOST)  # stopped with its environment, its agent says: a retry
        assert (t["t1"].status, t["t1"].info().ended_at) == (TrialStatus.WAITING, None)
        assert _kept(sim, store, "t1") == (None, 4.0)
        # Placed, and lost before its process started: still no end.
        env_id = _placed_again(sim, "t1")
        sim.end(env_id, "t1", ev.Outcome.LOST)
        assert (t["t1"].status, t["t1"].info().ended_at) == (TrialStatus.WAITING, None)
        assert _kept(sim, store, "t1") == (None, 4.0)
        # Run again, paused at its checkpoint: no end.
        env_id = _placed_again(sim, "t1")
        sim.run(env_id, "t1")
        _beats(sim, env_id, 3)
        sim.report(env_id, saved("t1", 2))
        sim.feed(ck.PauseRequested("t1", "paused by the user"))
        sim.report(env_id, ev.TrialEndReported("t1", ev.Outcome.PAUSED, 0, None, "", "", 0.0))
        assert (t["t1"].status, t["t1"].info().ended_at) == (TrialStatus.PAUSED, None)
        assert _kept(sim, store, "t1") == (None, 7.0)
        # Continued, its agent lost: its attempt ends at the last heartbeat, retried without an end.
        sim.feed(ck.ContinueRequested("t1", None))
        env_id = _placed_again(sim, "t1")
        sim.run(env_id, "t1")
        _beats(sim, env_id, 2)
        _silent(sim, env_id, 45)
        assert (t["t1"].status, t["t1"].info().ended_at) == (TrialStatus.WAITING, None)
        assert _kept(sim, store, "t1") == (None, 9.0)
        # Its last attempt, on the other environment, succeeds: that is its end.
        env_id = _placed_again(sim, "t1")
        sim.run(env_id, "t1")
        _beats(sim, env_id, 1)
        sim.end(env_id, "t1", ev.Outcome.SUCCEEDED)
        assert t["t1"].status is TrialStatus.SUCCEEDED
        assert t["t1"].info().ended_at == 1.7e9 + sim.now
        assert _kept(sim, store, "t1") == (1.7e9 + sim.now, 10.0)
    finally:
        store.close()
