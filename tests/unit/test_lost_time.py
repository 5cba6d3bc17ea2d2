"""A lost attempt's time: it ends when the coordinator last heard of its environment, not
when the loss is noticed (a timeout later)."""

from __future__ import annotations

from test_engine import Sim, ready_sim, running
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus


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
