"""Scenarios of the decision core in virtual time: events in, instructions checked.

No network, no processes, no clock: each scenario runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import pytest
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.engine import Engine
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.rows import MetricRun
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus

I = TypeVar("I")
_PLATFORM_FIELDS = {f.name for f in dataclasses.fields(PlatformPolicy)} - {"name"}


class Sim:
    """An engine, a virtual clock, and the instructions it gave since the last look."""

    def __init__(self, **policy: Any) -> None:
        # One platform, described by the PlatformPolicy fields among ``policy``, unless
        # ``platforms`` gives several.
        section: dict[str, Any] = {"name": "local", "reuse": True, "environment_count": 2, "trial_slots": 1}
        section.update({k: policy.pop(k) for k in list(policy) if k in _PLATFORM_FIELDS})
        if "platform" in policy:
            section["name"] = policy.pop("platform")
        defaults: dict[str, Any] = {
            "experiment_id": "exp", "trial_concurrency": 2, "agent_lost_timeout_s": 10.0, "trial_lost_timeout_s": 30.0,
            "platforms": (PlatformPolicy(**section),),
        }
        defaults.update(policy)
        self.engine = Engine(Policy(**defaults))
        self.now = 1000.0
        self.out: list[ev.Instruction] = []
        self.links: dict[str, int] = {}
        self.seqs: dict[str, int] = {}
        self._next_link = 1

    def feed(self, event: ev.Event) -> list[ev.Instruction]:
        got = self.engine.handle(event, now=self.now, wall=1.7e9 + self.now)
        self.out += got
        return got

    def start(self) -> None:
        self.out += self.engine.start(now=self.now, wall=1.7e9 + self.now)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def take(self, kind: type[I]) -> list[I]:
        found = [i for i in self.out if isinstance(i, kind)]
        self.out = [i for i in self.out if not isinstance(i, kind)]
        return found

    def started_envs(self) -> list[str]:
        """Answer every StartEnvironment asked for: the platform accepted it."""
        ids = [i.env_id for i in self.take(ev.StartEnvironment)]
        for env_id in ids:
            self.feed(ev.EnvironmentStarted(env_id, f"pid-{env_id}"))
        return ids

    def register(self, env_id: str, *, gpus: int = 0, instance: str = "", active: tuple[str, ...] = (),
                 platform: str = "") -> int:
        link = self._next_link
        self._next_link += 1
        self.links[env_id] = link
        self.seqs[env_id] = 0
        infos = tuple(ev.GpuInfo(f"GPU-{env_id}-{i}", i, "Test GPU", 16 << 30) for i in range(gpus))
        self.feed(ev.AgentRegistered(
            env_id=env_id, link=link, instance_id=instance or f"i-{env_id}-{link}", hostname="host", pid=1,
            platform=platform, gpus=infos, gpu_unavailable_reason="", active_trial_ids=frozenset(active), info={},
        ))
        return link

    def report(self, env_id: str, report: ev.Report) -> None:
        self.seqs[env_id] += 1
        self.feed(ev.AgentReported(env_id, self.links[env_id], self.seqs[env_id], report))

    def submit(self, trial_id: str, gpus: int = 0) -> None:
        self.feed(ev.TrialSubmitted(trial_id, {"x": 1}, "python trial.py", gpus, 0))
        self.feed(ev.Ticked())

    def starts(self) -> dict[str, ev.StartTrial]:
        return {s.message.trial_id: s.message for s in self.take(ev.Send) if isinstance(s.message, ev.StartTrial)}

    def status(self, trial_id: str) -> TrialStatus:
        return self.engine.trials[trial_id].status

    def run(self, env_id: str, trial_id: str) -> None:
        self.report(env_id, ev.TrialStartReported(trial_id, 42, 0.0))

    def end(self, env_id: str, trial_id: str, outcome: ev.Outcome, *, gpus_in_use: tuple[str, ...] = ()) -> None:
        code = 0 if outcome is ev.Outcome.SUCCEEDED else 1
        self.report(env_id, ev.TrialEndReported(trial_id, outcome, code, None, "", "", 0.0, gpus_in_use))


def ready_sim(**policy: Any) -> Sim:
    sim = Sim(**policy)
    sim.start()
    for env_id in sim.started_envs():
        sim.register(env_id)
    return sim


def running(sim: Sim, trial_id: str = "t1") -> str:
    """Submit a trial and run it where it is placed: that environment's id."""
    sim.submit(trial_id)
    env_id = sim.engine.trials[trial_id].env_id
    assert env_id is not None
    sim.run(env_id, trial_id)
    return env_id


def test_every_report_is_stored_before_it_is_acknowledged() -> None:
    sim = ready_sim()
    sim.submit("t1")
    env_id = sim.starts()["t1"] and sim.engine.trials["t1"].env_id
    assert env_id is not None
    sim.out.clear()
    sim.run(env_id, "t1")
    sim.report(env_id, ev.MetricsReported((MetricRun("t1", "final", 0, [0.5], None, [0.0]),)))
    kinds = [type(i).__name__ for i in sim.out]
    # Each message: its writes, its last_seq, then its ack.
    assert kinds.index("StoreMetrics") < kinds.index("Ack", kinds.index("StoreMetrics"))
    acks = sim.take(ev.Ack)
    assert [a.seq for a in acks] == [1, 2]
    assert sim.engine.trials["t1"].final_metric == 0.5
    # A replay of an acknowledged message is acknowledged again and not applied twice.
    sim.out.clear()
    sim.feed(ev.AgentReported(env_id, sim.links[env_id], 2, ev.MetricsReported(())))
    assert [a.seq for a in sim.take(ev.Ack)] == [2]
    assert not sim.take(ev.StoreMetrics)


def test_agent_lost_with_trials_running_then_its_trials_fail_and_it_is_replaced() -> None:
    sim = ready_sim()
    sim.submit("t1")
    env_id = sim.engine.trials["t1"].env_id
    assert env_id is not None
    sim.run(env_id, "t1")
    other = next(e for e in sim.engine.envs if e != env_id)
    # Silence: the other agent goes on heartbeating, this one does not.
    for _ in range(12):
        sim.advance(1.0)
        sim.feed(ev.HeartbeatReceived(other, sim.links[other], False))
        sim.feed(ev.EnvironmentsPolled({}))
    assert sim.engine.envs[env_id].status is EnvStatus.LOST
    assert sim.status("t1") is TrialStatus.RUNNING  # it may come back
    sim.advance(25.0)
    sim.feed(ev.HeartbeatReceived(other, sim.links[other], False))
    sim.feed(ev.EnvironmentsPolled({}))
    assert sim.engine.envs[env_id].status is EnvStatus.FAILED
    assert sim.status("t1") is TrialStatus.FAILED
    assert "environment lost" in sim.engine.trials["t1"].reason
    assert [s.env_id for s in sim.take(ev.StopEnvironment)] == [env_id]
    sim.feed(ev.Ticked())
    assert len(sim.take(ev.StartEnvironment)) == 1  # replaced


def test_a_lost_trial_is_retried_after_a_backoff_and_then_succeeds() -> None:
    sim = ready_sim(max_trial_retries=2)
    first = running(sim)
    sim.end(first, "t1", ev.Outcome.LOST)
    t = sim.engine.trials["t1"]
    assert t.status is TrialStatus.WAITING and t.env_id is None
    assert "retry 1 of 2" in t.reason
    sim.starts()
    sim.feed(ev.Ticked())
    assert not sim.starts(), "placed before its backoff ran out"
    sim.advance(1.01)
    sim.feed(ev.Ticked())
    start = sim.starts()["t1"]
    assert start.attempt == 2 and start.resumes_metrics
    where = sim.engine.trials["t1"].env_id
    assert where is not None
    sim.run(where, "t1")
    sim.end(where, "t1", ev.Outcome.SUCCEEDED)
    assert sim.status("t1") is TrialStatus.SUCCEEDED


def test_a_retried_trials_duration_counts_every_attempt() -> None:
    sim = ready_sim(max_trial_retries=2)
    first = running(sim)
    sim.advance(3.0)
    sim.end(first, "t1", ev.Outcome.LOST)
    t = sim.engine.trials["t1"]
    assert t.ran_s == pytest.approx(3.0) and t.info().duration(1.7e9 + sim.now + 50) == pytest.approx(3.0)
    sim.advance(1.01)  # waiting for its retry: no time runs
    sim.feed(ev.Ticked())
    where = t.env_id
    assert where is not None
    sim.run(where, "t1")
    sim.advance(2.0)
    assert t.info().duration(1.7e9 + sim.now) == pytest.approx(5.0)  # the running attempt so far too
    sim.end(where, "t1", ev.Outcome.SUCCEEDED)
    assert t.status is TrialStatus.SUCCEEDED and t.ran_s == pytest.approx(5.0)
    assert t.ended_at is not None and t.started_at is not None and t.ended_at - t.started_at == pytest.approx(2.0)
    changed = [c for c in sim.take(ev.TrialStatusChanged) if c.trial_id == "t1"]
    assert changed[-1].ran_s == pytest.approx(5.0)  # as the store keeps it


def test_retries_exhausted_fail_the_trial() -> None:
    sim = ready_sim(max_trial_retries=1, retry_failed_trials=True)
    sim.submit("t1")
    for attempt in (1, 2):
        sim.advance(10.0)
        sim.feed(ev.Ticked())
        env_id = sim.engine.trials["t1"].env_id
        assert env_id is not None, f"attempt {attempt} was not placed"
        sim.run(env_id, "t1")
        sim.end(env_id, "t1", ev.Outcome.FAILED)
    assert sim.status("t1") is TrialStatus.FAILED
    assert sim.engine.trials["t1"].attempts == 2


def test_environments_that_fail_to_start_are_given_up_and_waiting_trials_fail() -> None:
    sim = Sim(trial_concurrency=1, environment_count=1)
    sim.start()
    sim.submit("t1")
    for _ in range(3):
        starts = sim.take(ev.StartEnvironment)
        assert len(starts) == 1
        sim.feed(ev.EnvironmentStartFailed(starts[0].env_id, "no such partition"))
    assert "3 environments in a row failed to start" in sim.engine.env_error
    assert sim.status("t1") is TrialStatus.FAILED
    assert "no such partition" in sim.engine.trials["t1"].reason


def test_an_agent_that_never_registers_fails_its_environment_after_the_start_timeout() -> None:
    sim = Sim(trial_concurrency=1, environment_count=1, agent_start_timeout_s=60.0)
    sim.start()
    (env_id,) = sim.started_envs()
    sim.advance(30)
    sim.feed(ev.EnvironmentsPolled({env_id: ev.Observation("starting", "queued")}))  # queue time is not counted
    sim.advance(50)
    sim.feed(ev.EnvironmentsPolled({env_id: ev.Observation("running")}))
    assert sim.engine.envs[env_id].status is EnvStatus.STARTING
    sim.advance(11)
    sim.feed(ev.EnvironmentsPolled({env_id: ev.Observation("running")}))
    assert sim.engine.envs[env_id].status is EnvStatus.FAILED
    assert [s.env_id for s in sim.take(ev.StopEnvironment)] == [env_id]


def test_coordinator_restarted_while_trials_run_and_agents_reconnect() -> None:
    sim = ready_sim()
    sim.submit("t1")
    sim.submit("t2")
    placed = {t: sim.engine.trials[t].env_id for t in ("t1", "t2")}
    sim.run(placed["t1"] or "", "t1")  # t2 placed, never confirmed
    trial_rows = [_trial_row(t) for t in sim.engine.trials.values()]
    env_rows = [_env_row(e) for e in sim.engine.envs.values()]

    # A fresh core from what the store kept.
    after = Sim()
    written = after.engine.restore(trial_rows, env_rows, {}, now=after.now, wall=after.now)
    assert {e.status for e in after.engine.envs.values()} == {EnvStatus.LOST}
    assert sum(isinstance(w, ev.EnvironmentStatusChanged) for w in written) == 2
    after.engine.started = True
    # t1's agent comes back with the same instance and says it still runs t1.
    env1 = placed["t1"] or ""
    after.register(env1, instance=sim.engine.envs[env1].instance_id, active=("t1",))
    welcome = next(s.message for s in after.take(ev.Send) if isinstance(s.message, ev.Welcome))
    assert welcome.cancel_trial_ids == ()
    assert after.engine.envs[env1].status is EnvStatus.BUSY
    after.seqs[env1] = sim.seqs[env1]
    after.end(env1, "t1", ev.Outcome.SUCCEEDED)
    assert after.status("t1") is TrialStatus.SUCCEEDED
    # t2's agent comes back too, without t2: the StartTrial was lost, so it is sent again.
    env2 = placed["t2"] or ""
    after.register(env2, instance=sim.engine.envs[env2].instance_id)
    assert "t2" in after.starts()
    # New environment ids go on after the stored ones.
    after.engine.envs[env2].status = EnvStatus.FAILED
    after.feed(ev.Ticked())
    assert [s.env_id for s in after.take(ev.StartEnvironment)] == ["env-3"]


def test_a_trial_that_can_never_fit_is_refused_once_every_agent_registered() -> None:
    sim = Sim(trial_concurrency=1, environment_count=1)
    sim.start()
    sim.submit("big", gpus=4)
    (env_id,) = sim.started_envs()
    assert sim.status("big") is TrialStatus.WAITING  # the agent may still have the GPUs
    sim.register(env_id, gpus=2)
    assert sim.status("big") is TrialStatus.FAILED
    assert "asks for 4 GPUs" in sim.engine.trials["big"].reason
    assert "no environment offers more than 2" in sim.engine.fleet.never_fits(3)


def test_a_trial_too_large_fails_alike_however_registrations_and_submissions_interleave() -> None:
    sim = Sim(trial_concurrency=2, environment_count=2)
    sim.start()
    first, second = sim.started_envs()
    sim.register(first, gpus=1)
    # The second agent, yet to register, may have more GPUs: nothing is refused yet.
    assert sim.engine.fleet.never_fits(2) == ""
    sim.submit("early", gpus=2)
    assert sim.status("early") is TrialStatus.WAITING
    sim.register(second, gpus=1)
    why = ("refused: trial asks for 2 GPUs but no environment offers more than 1; lower trialGpuNumber or add GPUs "
           "(gpuIndices/simulatedGpus)")
    assert (sim.status("early"), sim.engine.trials["early"].reason) == (TrialStatus.FAILED, why)
    # Submitted once every agent registered: failed at once, with the same reason; others run.
    sim.submit("late", gpus=2)
    assert (sim.status("late"), sim.engine.trials["late"].reason) == (TrialStatus.FAILED, why)
    sim.submit("fits", gpus=1)
    assert set(sim.starts()) == {"fits"}


def test_a_trial_too_large_for_what_every_platform_declares_fails_before_any_agent_registers() -> None:
    sim = Sim(trial_concurrency=1, environment_count=1, simulated_gpus=1)
    sim.start()
    assert sim.started_envs()
    sim.submit("big", gpus=2)
    assert sim.status("big") is TrialStatus.FAILED
    assert "trial asks for 2 GPUs but no environment offers more than 1" in sim.engine.trials["big"].reason


def test_gpus_are_released_on_trial_exit_once_its_processes_left_them() -> None:
    sim = Sim(trial_concurrency=2, environment_count=1, trial_slots=2)
    sim.start()
    (env_id,) = sim.started_envs()
    sim.register(env_id, gpus=1)
    sim.submit("a", gpus=1)
    sim.submit("b", gpus=1)
    assert set(sim.starts()) == {"a"}
    assert sim.engine.trials["b"].waiting_reason
    gpu = sim.engine.envs[env_id].gpus[0].uuid
    sim.run(env_id, "a")
    # The agent saw a's processes still on the GPU as it ended: the GPU stays held.
    sim.end(env_id, "a", ev.Outcome.SUCCEEDED, gpus_in_use=(gpu,))
    sim.feed(ev.Ticked())
    assert not sim.starts()
    sample = ev.GpuSample(gpu, 0.0, 1 << 20)
    sim.feed(ev.HeartbeatReceived(env_id, sim.links[env_id], False, (sample,)))
    assert set(sim.starts()) == {"b"}
    sim.feed(ev.Ticked())
    rows = sim.take(ev.StoreGpuSamples)
    assert rows and rows[0].rows[0].uuid == gpu


def test_drain_places_nothing_new_and_the_environment_stops_when_its_agent_exits() -> None:
    sim = ready_sim(trial_concurrency=2)
    sim.submit("t1")
    env_id = sim.engine.trials["t1"].env_id
    assert env_id is not None
    sim.run(env_id, "t1")
    sim.feed(ev.HeartbeatReceived(env_id, sim.links[env_id], True))
    assert sim.engine.envs[env_id].status is EnvStatus.DRAINING
    sim.submit("t2")
    assert sim.engine.trials["t2"].env_id != env_id
    sim.end(env_id, "t1", ev.Outcome.SUCCEEDED)
    sim.feed(ev.AgentDisconnected(env_id, sim.links[env_id]))
    assert sim.take(ev.PollSoon)
    sim.feed(ev.EnvironmentsPolled({env_id: ev.Observation("exited", "drained")}))
    assert sim.engine.envs[env_id].status is EnvStatus.STOPPED


def test_an_agent_started_by_hand_under_a_started_id_never_collides() -> None:
    sim = ready_sim(trial_concurrency=2, environment_count=2)
    assert set(sim.engine.envs) == {"env-1", "env-2"}
    sim.register("env-3")  # an operator's agent, named like ours
    for env_id in ("env-1", "env-2"):
        sim.engine.envs[env_id].status = EnvStatus.FAILED  # both of ours died
    sim.feed(ev.Ticked())
    new = [s.env_id for s in sim.take(ev.StartEnvironment)]
    assert len(new) == 1 and new[0] not in ("env-1", "env-2", "env-3")
    inserted = [i.env_id for i in sim.take(ev.EnvironmentAdded)]
    assert len(inserted) == len(set(inserted))


def test_stop_cancels_every_trial_and_shuts_every_environment_down() -> None:
    sim = ready_sim()
    sim.submit("t1")
    sim.submit("t2")
    sim.submit("t3")  # waits: two environments, one slot each
    env_id = sim.engine.trials["t1"].env_id
    assert env_id is not None
    sim.run(env_id, "t1")
    sim.out.clear()
    sim.feed(ev.StopRequested(5.0))
    assert sim.status("t3") is TrialStatus.SYS_CANCELED
    sent = [s.message for s in sim.take(ev.Send)]
    assert {m.trial_id for m in sent if isinstance(m, ev.CancelTrial)} == {"t1", "t2"}
    assert sum(isinstance(m, ev.Shutdown) for m in sent) == 2
    sim.feed(ev.Ticked())
    assert not sim.take(ev.StartEnvironment)
    sim.feed(ev.StopCompleted())
    assert {sim.status(t) for t in ("t1", "t2")} == {TrialStatus.SYS_CANCELED}
    assert {e.status for e in sim.engine.envs.values()} == {EnvStatus.STOPPED}


def test_a_second_agent_for_a_connected_environment_is_refused() -> None:
    sim = ready_sim()
    sim.register("env-1", instance="someone-else")
    refusals = sim.take(ev.RefuseAgent)
    assert refusals and refusals[0].why is ev.Refusal.ALREADY_CONNECTED


@pytest.mark.parametrize("reuse", [True, False])
def test_an_unknown_agent_joins_only_in_reuse_mode(reuse: bool) -> None:
    sim = Sim(reuse=reuse)
    sim.start()
    sim.register("by-hand")
    refused = sim.take(ev.RefuseAgent)
    assert bool(refused) is not reuse
    assert ("by-hand" in sim.engine.envs) is reuse


def _trial_row(t: Any) -> dict[str, Any]:
    import json

    return {
        "id": t.id, "seq": t.seq, "status": t.status.value, "parameters_json": json.dumps(t.parameters),
        "command": t.command, "gpu_number": t.gpu_number, "environment_id": t.env_id,
        "gpu_indices_json": json.dumps(list(t.gpu_indices)), "gpu_uuids_json": json.dumps(list(t.gpu_uuids)),
        "exit_code": t.exit_code, "signal": t.signal, "reason": t.reason, "stderr_tail": t.stderr_tail,
        "final_metric": t.final_metric, "final_metric_json": t.final_metric_json, "attempts": t.attempts,
        "submitted_at": t.submitted_at, "started_at": t.started_at, "ended_at": t.ended_at,
        "platforms_json": json.dumps(list(t.platforms)),
    }


def _env_row(e: Any) -> dict[str, Any]:
    return {
        "id": e.id,
        "platform": e.platform or "local",
        "status": e.status.value,
        "platform_id": e.platform_id,
        "reason": e.reason,
        "hostname": e.hostname,
        "agent_instance_id": e.instance_id,
        "last_seq": e.last_seq,
        "info_json": "{}",
    }


def test_a_trial_whose_stored_row_cannot_be_read_is_failed_on_resume_not_run() -> None:
    sim = ready_sim()
    sim.submit("good")
    sim.submit("bad-params")
    sim.submit("bad-status")
    rows = [_trial_row(t) for t in sim.engine.trials.values()]
    rows[1]["parameters_json"] = "}{"
    rows[2]["status"] = "BOGUS"
    after = Sim()
    written = after.engine.restore(
        rows, [_env_row(e) for e in sim.engine.envs.values()], {}, now=after.now, wall=after.now
    )
    assert after.status("good") is not TrialStatus.FAILED
    for tid, what in (("bad-params", "parameters"), ("bad-status", "status")):
        t = after.engine.trials[tid]
        assert t.status is TrialStatus.FAILED and what in t.reason and tid not in after.engine.queue
        assert any(isinstance(w, ev.TrialStatusChanged) and w.trial_id == tid for w in written)


def test_an_environment_still_requested_when_the_coordinator_died_is_failed_and_replaced() -> None:
    sim = Sim(trial_concurrency=1, environment_count=1)
    sim.start()
    (requested,) = [s.env_id for s in sim.take(ev.StartEnvironment)]  # never answered: a crash
    rows = [_env_row(e) for e in sim.engine.envs.values()]
    after = Sim(trial_concurrency=1, environment_count=1)
    after.engine.restore([], rows, {}, now=after.now, wall=after.now)
    assert after.engine.envs[requested].status is EnvStatus.FAILED
    after.start()
    assert [s.env_id for s in after.take(ev.StartEnvironment)] == ["env-2"]


def test_on_resume_only_environments_with_a_platform_id_count_as_started_here() -> None:
    sim = ready_sim()
    sim.register("by-hand")
    rows = [_env_row(e) for e in sim.engine.envs.values()]
    after = Sim(shares_filesystem=True)
    after.engine.restore([], rows, {}, now=after.now, wall=after.now)
    assert {e.id: e.started_here for e in after.engine.envs.values()} == {
        "env-1": True,
        "env-2": True,
        "by-hand": False,
    }


def test_a_message_that_cannot_be_applied_still_tells_the_status_changes_it_made() -> None:
    sim = ready_sim()
    sim.submit("t1")
    env_id = sim.engine.trials["t1"].env_id
    assert env_id is not None
    real = sim.engine.book._to

    def then_a_bug(*args: Any) -> None:
        real(*args)
        raise RuntimeError("a bug after the status changed")

    sim.engine.book._to = then_a_bug  # type: ignore[method-assign]
    sim.out.clear()
    sim.run(env_id, "t1")
    published = [p.event for p in sim.take(ev.Publish)]
    assert [e.trial.status for e in published if hasattr(e, "trial")] == [TrialStatus.RUNNING]
    assert not sim.take(ev.TrialRan) and not sim.take(ev.TrialStatusChanged)  # its writes dropped
    assert [a.seq for a in sim.take(ev.Ack)] == [1]  # skipped, loudly, not replayed forever


def test_a_pass_is_wanted_only_when_something_changed() -> None:
    sim = ready_sim(trial_concurrency=10)
    for i in range(5):
        sim.submit(f"t{i}")
    placed = [t for t in sim.starts()]
    assert placed == ["t0", "t1"]  # two environments, one slot each
    env_id = sim.engine.trials["t0"].env_id
    assert env_id is not None
    sim.run(env_id, "t0")
    sim.feed(ev.Ticked())
    assert not sim.engine.wants_pass()
    # A metric, a log line, a heartbeat without GPUs: nothing a pass could act on.
    sim.report(env_id, ev.MetricsReported((MetricRun("t0", "intermediate", 0, [0.5], None, [0.0]),)))
    sim.report(env_id, ev.LogReported("t0", "stdout", 0, b"hello\n"))
    sim.feed(ev.HeartbeatReceived(env_id, sim.links[env_id], False))
    assert not sim.engine.wants_pass()
    sim.out.clear()
    sim.feed(ev.Ticked())
    assert not sim.take(ev.WaitingReasonsChanged) and not sim.starts()
    # Its trial ends: the slot it frees is worth a pass, which places the next in line.
    sim.end(env_id, "t0", ev.Outcome.SUCCEEDED)
    assert sim.engine.wants_pass()
    sim.feed(ev.Ticked())
    assert list(sim.starts()) == ["t2"]
    assert [t for t in sim.engine.queue] == ["t3", "t4"]


def test_gpu_memory_freed_by_another_program_places_a_trial_that_asks_for_it() -> None:
    sim = Sim(environment_count=1, trial_slots=2)
    sim.start()
    (env_id,) = sim.started_envs()
    sim.register(env_id, gpus=1)  # 16 GiB
    uuid = f"GPU-{env_id}-0"
    link = sim.links[env_id]
    # Another program (useActiveGpu is on for this one: its memory is what counts) holds 12 GiB.
    sim.engine.envs[env_id].use_active_gpu = True
    sim.engine.fleet.capacity.changed(env_id)
    busy = ev.GpuSample(uuid, 50.0, 12 << 30, (ev.GpuProcess("", 12 << 30),))
    sim.feed(ev.HeartbeatReceived(env_id, link, False, (busy,)))
    sim.feed(ev.TrialSubmitted("big", {}, "python trial.py", 1, 8 << 30))
    sim.feed(ev.Ticked())
    assert not sim.starts()
    assert "8.0 GiB free memory" in sim.engine.trials["big"].waiting_reason
    # The same sample again changes nothing: no pass is wanted.
    sim.feed(ev.HeartbeatReceived(env_id, link, False, (busy,)))
    assert not sim.engine.wants_pass()
    # The program lets go of most of its memory (it still runs there): that heartbeat alone
    # places the trial.
    sim.feed(
        ev.HeartbeatReceived(env_id, link, False, (ev.GpuSample(uuid, 10.0, 2 << 30, (ev.GpuProcess("", 2 << 30),)),))
    )
    assert list(sim.starts()) == ["big"]


def test_a_heartbeat_with_unchanged_gpus_keeps_the_agent_alive_and_holds_what_the_last_samples_showed() -> None:
    sim = Sim(trial_concurrency=2, environment_count=1, trial_slots=2, agent_lost_timeout_s=3.0)
    sim.start()
    (env_id,) = sim.started_envs()
    link = sim.register(env_id, gpus=1)
    welcome = next(s.message for s in sim.take(ev.Send) if isinstance(s.message, ev.Welcome))
    assert welcome.gpu_sample_interval_s == 5.0  # the agent may leave unchanged samples out
    gpu = sim.engine.envs[env_id].gpus[0].uuid
    sim.submit("a", gpus=1)
    sim.submit("b", gpus=1)
    assert set(sim.starts()) == {"a"}
    sim.run(env_id, "a")
    # The agent saw a's process on the GPU (its last samples): the GPU stays held after a ends.
    sim.feed(
        ev.HeartbeatReceived(env_id, link, False, (ev.GpuSample(gpu, 90.0, 4 << 30, (ev.GpuProcess("a", 4 << 30),)),))
    )
    sim.end(env_id, "a", ev.Outcome.SUCCEEDED, gpus_in_use=(gpu,))
    # Heartbeats without samples ("as before") for longer than agentLostTimeout: the agent is
    # alive, and nothing is released or placed on their word.
    for _ in range(5):
        sim.advance(1.0)
        sim.feed(ev.HeartbeatReceived(env_id, link, False, (), gpus_unchanged=True))
        sim.feed(ev.EnvironmentsPolled({}))
        sim.feed(ev.Ticked())
    assert sim.engine.envs[env_id].status is EnvStatus.READY  # a's slot is free, its GPU is not
    assert not sim.starts()
    assert sim.engine.envs[env_id].gpu_usage[gpu][0] == 90.0
    # Samples that show the process gone free the GPU at once.
    sim.feed(ev.HeartbeatReceived(env_id, link, False, (ev.GpuSample(gpu, 0.0, 0),)))
    assert set(sim.starts()) == {"b"}
    # And silence is still silence: no heartbeat of any kind for agentLostTimeout, lost.
    sim.advance(3.5)
    sim.feed(ev.EnvironmentsPolled({}))
    assert sim.engine.envs[env_id].status is EnvStatus.LOST


def test_a_fleet_told_to_heartbeat_less_often_is_told_to_sample_its_gpus_less_often_too() -> None:
    sim = Sim(environment_count=4, heartbeat_interval_s=1.0, max_heartbeats_per_second=2.0)
    sim.start()
    envs = sim.started_envs()
    for env_id in envs[:2]:
        sim.register(env_id)
    assert not [s for s in sim.take(ev.Send) if isinstance(s.message, ev.Settings)]
    sim.register(envs[2])  # 3 agents at 1 s would send 3 a second: stretched to 1.5 × 1.25
    told = [s.message for s in sim.take(ev.Send) if isinstance(s.message, ev.Settings)]
    assert len(told) == 3
    assert told[0].heartbeat_interval_s == pytest.approx(1.875)
    assert told[0].gpu_sample_interval_s == pytest.approx(5.0 * 1.875)
    sim.register(envs[3])
    welcome = next(s.message for s in sim.take(ev.Send) if isinstance(s.message, ev.Welcome))
    assert welcome.gpu_sample_interval_s == pytest.approx(5.0 * 1.875)


def test_an_agent_joining_is_given_waiting_trials_by_its_registration_alone() -> None:
    # The shell runs no scheduling pass for a join (one per join made a storm of joins
    # quadratic): the registration itself must place what the new agent can take.
    sim = Sim(environment_count=1, trial_slots=2, trial_concurrency=4)
    sim.start()
    (env_id,) = sim.started_envs()
    sim.submit("a")
    sim.submit("b")
    sim.submit("c")
    assert not sim.starts()
    got = sim.feed(ev.AgentRegistered(
        env_id=env_id, link=7, instance_id="i-1", hostname="host", pid=1, platform="", gpus=(),
        gpu_unavailable_reason="", active_trial_ids=frozenset(), info={},
    ))
    started = [i.message.trial_id for i in got if isinstance(i, ev.Send) and isinstance(i.message, ev.StartTrial)]
    assert started == ["a", "b"]  # in queue order, as many as it has slots
    kinds = [type(i.message).__name__ for i in got if isinstance(i, ev.Send)]
    assert kinds[0] == "Welcome"  # the Welcome goes first on the stream
