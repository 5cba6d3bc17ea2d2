"""The fleet of environments on its own, in virtual time: calls in, instructions and state
checked. No engine, no book: where a scheduling pass would place a trial, the test does.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pytest
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.environments import hold_restored, last_failure
from trialkeeper.coordinator.engine.fleet import Fleet, Joined, Lost
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.rows import GpuSampleRow
from trialkeeper.coordinator.engine.states import EnvStatus

K = TypeVar("K")
WALL = 1.7e9  # the time of day at virtual time 0
GIB = 1 << 30
READY, BUSY, FAILED, LOST = EnvStatus.READY, EnvStatus.BUSY, EnvStatus.FAILED, EnvStatus.LOST


def fleet(*, reuse: bool = True, **policy: Any) -> Fleet:
    """A fleet of one platform "local" (``gpu_sharing``, ``trial_slots``: its section's), at
    virtual time 1000; lost after 10 s of silence, trials given up after 30 s."""
    section = {k: policy.pop(k) for k in ("gpu_sharing", "trial_slots", "unusable") if k in policy}
    section.setdefault("trial_slots", 1)
    policy = {"experiment_id": "exp", "trial_concurrency": 2, "agent_lost_timeout_s": 10.0,
              "trial_lost_timeout_s": 30.0, **policy,
              "platforms": (PlatformPolicy("local", reuse, 2, **section),)}
    f = Fleet(Policy(**policy))
    at(f, 1000.0)
    return f


def at(f: Fleet, now: float) -> None:
    """Set the fleet's clocks, as the engine does before each call."""
    f.now, f.wall = now, WALL + now


def of(out: list[ev.Instruction], kind: type[K]) -> list[K]:
    return [i for i in out if isinstance(i, kind)]


def statuses(out: list[ev.Instruction]) -> list[tuple[str, str, EnvStatus]]:
    return [(c.env_id, c.old, c.new) for c in of(out, ev.EnvironmentStatusChanged)]


def agent(env_id: str, link: int, instance: str = "", *, gpus: int = 0,
          active: tuple[str, ...] = ()) -> ev.AgentRegistered:
    infos = tuple(ev.GpuInfo(f"GPU-{env_id}-{i}", i, "A100", 40 * GIB) for i in range(gpus))
    return ev.AgentRegistered(
        env_id=env_id, link=link, instance_id=instance or f"i-{env_id}", hostname="host", pid=7,
        platform="", gpus=infos, gpu_unavailable_reason="", active_trial_ids=frozenset(active),
        info={"version": "1"},
    )


def up(f: Fleet, *, gpus: int = 0, sharing: tuple[int, bool] | None = None) -> str:
    """A new environment, started by its platform, its agent registered on link = its
    number; the instructions so far taken."""
    f.request("local")
    env_id = of(f.take(), ev.StartEnvironment)[0].env_id
    f.start_answered(ev.EnvironmentStarted(env_id, f"pid-{env_id}", sharing))
    joined = f.register(agent(env_id, int(env_id.split("-")[1]), gpus=gpus))
    assert joined is not None
    f.take()
    return env_id


def hold(f: Fleet, env_id: str, trial_id: str) -> None:
    """What a scheduling pass does to the fleet: the trial takes a slot and the first GPU."""
    env = f.envs[env_id]
    env.holders.add(trial_id)
    if env.gpus:
        env.gpus[0].take(trial_id)
    f.occupied(env_id, trial_id)


# ---- environments asked for and started --------------------------------------------------------


def test_request_adds_environments_numbered_from_one() -> None:
    f = fleet()
    f.request("local")
    f.request("local")
    assert f.take() == [
        ev.EnvironmentAdded("env-1", "local", EnvStatus.REQUESTED, WALL + 1000),
        ev.StartEnvironment("env-1"),
        ev.EnvironmentAdded("env-2", "local", EnvStatus.REQUESTED, WALL + 1000),
        ev.StartEnvironment("env-2"),
    ]
    assert f.envs["env-2"].requested_at == 1000.0


def test_request_skips_the_ids_an_operators_agents_took() -> None:
    f = fleet()
    assert f.register(agent("env-2", link=1)) is not None
    assert f.register(agent("gpu-box", link=2)) is not None
    f.take()
    f.request("local")
    assert of(f.take(), ev.StartEnvironment) == [ev.StartEnvironment("env-3")]


def test_start_answered_starting_or_failed() -> None:
    f = fleet()
    f.request("local")
    f.request("local")
    f.take()
    f.start_answered(ev.EnvironmentStarted("env-1", "pid-9"))
    assert f.take() == [
        ev.EnvironmentLaunched("env-1", "pid-9"),
        ev.EnvironmentStatusChanged("env-1", "REQUESTED", EnvStatus.STARTING, "started (pid-9)"),
    ]
    assert f.take_start_failures() == []
    f.start_answered(ev.EnvironmentStartFailed("env-2", "no quota"))
    assert f.take() == [
        ev.EnvironmentStatusChanged("env-2", "REQUESTED", FAILED, "no quota", WALL + 1000)
    ]
    assert f.take_start_failures() == ["local"]
    assert f.take_start_failures() == []
    assert last_failure(f.envs.values(), "local") == "no quota"
    # A late or repeated answer is not applied.
    f.start_answered(ev.EnvironmentStartFailed("env-1", "late"))
    f.start_answered(ev.EnvironmentStarted("env-2", "pid-10"))
    assert f.take() == []
    assert f.take_start_failures() == []
    assert f.envs["env-1"].status is EnvStatus.STARTING


# ---- agents registering -------------------------------------------------------------------------


def test_an_agent_registers_and_is_welcomed() -> None:
    f = fleet()
    f.request("local")
    f.start_answered(ev.EnvironmentStarted("env-1", "pid-1"))
    f.take()
    joined = f.register(agent("env-1", link=5))
    assert joined == Joined("env-1", "local", 5, True, (), ())
    assert f.take() == [
        ev.AgentJoined("env-1", "host", "i-env-1", {"version": "1"}),
        ev.AgentConnected("env-1", True),
        ev.EnvironmentStatusChanged("env-1", "STARTING", READY,
                                    "agent registered from host (pid 7)"),
    ]
    f.welcome(joined, ("stale",))
    assert f.take() == [ev.Send(5, ev.Welcome("exp", 0, 1.0, ("stale",), 5.0))]


def refused(f: Fleet, reg: ev.AgentRegistered) -> ev.RefuseAgent:
    assert f.register(reg) is None
    (refusal,) = f.take()
    assert isinstance(refusal, ev.RefuseAgent)
    return refusal


def test_registration_refused_while_stopping() -> None:
    f = fleet()
    env_id = up(f)
    f.stop(5.0)
    f.take()
    assert refused(f, agent(env_id, link=9)) == ev.RefuseAgent(
        env_id, ev.Refusal.NOT_NOW, "the experiment is stopping")


def test_registration_of_an_unknown_environment_refused_without_reuse() -> None:
    f = fleet(reuse=False)
    refusal = refused(f, agent("gpu-box", link=1))
    assert refusal.why is ev.Refusal.UNKNOWN_ENVIRONMENT
    assert "gpu-box" not in f.envs


def test_registration_of_an_ended_environment_refused() -> None:
    f = fleet()
    f.request("local")
    f.start_answered(ev.EnvironmentStartFailed("env-1", "no quota"))
    f.take()
    assert refused(f, agent("env-1", link=1)) == ev.RefuseAgent(
        "env-1", ev.Refusal.NOT_NOW, "environment env-1 was failed: no quota")


def test_a_second_instance_is_refused_while_the_first_is_connected() -> None:
    f = fleet()
    env_id = up(f)
    refusal = refused(f, agent(env_id, link=7, instance="another"))
    assert refusal.why is ev.Refusal.ALREADY_CONNECTED
    assert (f.envs[env_id].link, f.envs[env_id].instance_id) == (1, f"i-{env_id}")


def test_an_agent_started_by_hand_joins_in_reuse_mode() -> None:
    f = fleet()
    joined = f.register(agent("gpu-box", link=3))
    assert joined == Joined("gpu-box", "manual", 3, True, (), ())
    out = f.take()
    assert out[0] == ev.EnvironmentAdded("gpu-box", "manual", EnvStatus.STARTING, WALL + 1000)
    assert statuses(out) == [("gpu-box", "STARTING", READY)]
    env = f.envs["gpu-box"]
    assert (env.status, env.started_here, env.link) == (READY, False, 3)
    assert f.by_hand()


def test_a_new_instance_of_a_known_environment_loses_the_trials_it_held() -> None:
    f = fleet(trial_slots=2)
    env_id = up(f, gpus=1)
    hold(f, env_id, "t1")
    hold(f, env_id, "t2")
    f.disconnected(ev.AgentDisconnected(env_id, 1))
    f.take()
    joined = f.register(agent(env_id, link=4, instance="restarted", gpus=1))
    assert joined is not None
    assert (joined.new_instance, sorted(joined.lost), joined.held) == (True, ["t1", "t2"], ())
    env = f.envs[env_id]
    assert (env.status, env.holders, env.instance_id) == (READY, set(), "restarted")
    assert env.gpus[0].holders == set()
    assert statuses(f.take()) == [(env_id, "BUSY", READY)]


def test_the_same_instance_reconnecting_keeps_its_trials_and_its_old_stream_closes() -> None:
    f = fleet()
    env_id = up(f)
    hold(f, env_id, "t1")
    f.take()
    joined = f.register(agent(env_id, link=8))  # the old stream (link 1) is not seen dead yet
    assert joined == Joined(env_id, "local", 8, False, (), ("t1",))
    out = f.take()
    assert out == [ev.CloseLink(1), ev.AgentConnected(env_id, True)]
    # The old stream's end, reported later, changes nothing.
    f.disconnected(ev.AgentDisconnected(env_id, 1))
    assert f.take() == []
    assert f.envs[env_id].link == 8


def test_gpu_sharing_set_by_the_platform_overrides_the_sections() -> None:
    f = fleet(gpu_sharing=(2, False))
    shared = up(f, gpus=1, sharing=(4, True))
    plain = up(f, gpus=1)
    assert (f.envs[shared].gpus[0].capacity, f.envs[shared].use_active_gpu) == (4, True)
    assert (f.envs[plain].gpus[0].capacity, f.envs[plain].use_active_gpu) == (2, False)


# ---- numbered messages and heartbeats -----------------------------------------------------------


def test_numbered_messages_are_applied_once_and_replays_acknowledged() -> None:
    f = fleet()
    env_id = up(f)
    first = ev.AgentReported(env_id, 1, 1, None)
    assert f.numbered(first)
    f.stored(first)
    assert f.take() == [ev.AgentMessagesStored(env_id, 1), ev.Ack(1, 1)]
    assert f.numbered(ev.AgentReported(env_id, 1, 2, None))
    f.stored(ev.AgentReported(env_id, 1, 2, None))
    f.take()
    # A replay is acknowledged with the last stored, and not applied again.
    assert not f.numbered(first)
    assert f.take() == [ev.Ack(1, 2)]
    # No sequence number: ignored, no ack. A stream that was replaced: ignored.
    assert not f.numbered(ev.AgentReported(env_id, 1, 0, None))
    assert not f.numbered(ev.AgentReported(env_id, 99, 3, None))
    assert f.take() == []
    assert f.envs[env_id].last_seq == 2


def test_a_draining_heartbeat_makes_the_environment_draining() -> None:
    f = fleet()
    env_id = up(f)
    assert f.capacity.views()[env_id].accepting
    changed = f.heartbeat(ev.HeartbeatReceived(env_id, 1, draining=True), watch_memory=False)
    assert not changed  # no GPU changed; the status change is told by its fact
    assert statuses(f.take()) == [(env_id, "READY", EnvStatus.DRAINING)]
    assert not f.capacity.views()[env_id].accepting
    f.heartbeat(ev.HeartbeatReceived(env_id, 1, draining=True), watch_memory=False)
    assert f.take() == []


def test_gpu_samples_are_kept_every_interval_and_when_the_trials_on_them_change() -> None:
    f = fleet()
    env_id = up(f, gpus=1)
    uuid = f"GPU-{env_id}-0"

    def beat(now: float, *, unchanged: bool = False) -> list[GpuSampleRow]:
        at(f, now)
        sample = ev.GpuSample(uuid, 50.0, 2 * GIB)
        f.heartbeat(ev.HeartbeatReceived(env_id, 1, False, (sample,), unchanged),
                    watch_memory=False)
        f.store_gpu_rows()
        return [row for s in of(f.take(), ev.StoreGpuSamples) for row in s.rows]

    assert beat(1000.0) == [GpuSampleRow(WALL + 1000, env_id, uuid, 50.0, 2 * GIB, 40 * GIB)]
    assert beat(1002.0) == []
    assert beat(1004.0, unchanged=True) == []
    assert [r.at for r in beat(1005.0)] == [WALL + 1005]
    hold(f, env_id, "t1")
    assert [r.trial_ids for r in beat(1006.0)] == [("t1",)]


# ---- what the platform observes, and the timers -------------------------------------------------


def test_an_environment_ended_without_its_agent_fails_with_its_trials_lost() -> None:
    f = fleet()
    env_id = up(f)
    hold(f, env_id, "t1")
    f.take()
    f.disconnected(ev.AgentDisconnected(env_id, 1))
    assert f.take() == [ev.AgentConnected(env_id, False), ev.PollSoon()]
    gone = f.polled({env_id: ev.Observation("exited", "killed by OOM")})
    assert gone == [Lost(env_id, ("t1",), "killed by OOM", "local")]
    assert statuses(f.take()) == [(env_id, "BUSY", READY), (env_id, "READY", FAILED)]
    assert f.envs[env_id].reason == "killed by OOM"


def test_an_environment_asked_to_stop_that_ends_is_stopped() -> None:
    f = fleet()
    env_id = up(f)
    f.shutdown(f.envs[env_id], drain=True, reason="not needed")
    assert f.take() == [
        ev.Send(1, ev.Shutdown(True, 5.0, "not needed")),
        ev.EnvironmentStatusChanged(env_id, "READY", EnvStatus.DRAINING, "not needed"),
        ev.PollSoon(),
    ]
    # Its agent still connected: the platform's word waits for the stream's end.
    assert f.polled({env_id: ev.Observation("exited")}) == []
    f.disconnected(ev.AgentDisconnected(env_id, 1))
    assert f.polled({env_id: ev.Observation("exited")}) == [Lost(env_id, (), "", "local")]
    assert statuses(f.take()) == [(env_id, "DRAINING", EnvStatus.STOPPED)]


def test_a_silent_agent_is_lost_then_failed_with_its_trials() -> None:
    f = fleet()
    env_id = up(f)
    hold(f, env_id, "t1")
    f.take()
    at(f, 1010.0)
    assert f.polled({}) == [] and f.take() == []
    at(f, 1011.0)
    assert f.polled({}) == []
    assert f.take() == [ev.EnvironmentStatusChanged(
        env_id, "BUSY", LOST, "agent unreachable: no heartbeat for 11.0 s")]
    assert not f.capacity.views()[env_id].accepting
    at(f, 1031.0)
    gone = f.polled({})
    assert gone == [Lost(env_id, ("t1",), "no heartbeat for 31.0 s", "local", silent_s=31.0)]  # heard of 31 s ago
    out = f.take()
    assert statuses(out) == [(env_id, "LOST", FAILED)]
    assert of(out, ev.CloseLink) == [ev.CloseLink(1)]
    assert of(out, ev.StopEnvironment) == [ev.StopEnvironment(env_id, 0.0)]
    assert f.running() == 0


def test_a_lost_agent_heard_from_again_comes_back() -> None:
    f = fleet()
    env_id = up(f)
    hold(f, env_id, "t1")
    at(f, 1011.0)
    f.polled({})
    f.take()
    f.heartbeat(ev.HeartbeatReceived(env_id, 1, False), watch_memory=False)
    assert statuses(f.take()) == [(env_id, "LOST", BUSY)]
    at(f, 1031.0)
    assert f.polled({}) == []


@pytest.mark.parametrize("how", ["silent then heard", "coordinator restarted"])
def test_a_draining_environment_lost_and_back_is_still_draining(how: str) -> None:
    f = fleet()
    if how == "silent then heard":
        env_id = up(f)
        f.heartbeat(ev.HeartbeatReceived(env_id, 1, draining=True), watch_memory=False)
        at(f, 1011.0)
        f.polled({})
        assert f.envs[env_id].status is LOST
        f.heartbeat(ev.HeartbeatReceived(env_id, 1, draining=True), watch_memory=False)
    else:
        env_id = "env-1"
        f.restore([env_row(env_id, "DRAINING")], {})
        assert f.register(agent(env_id, link=1)) is not None
    assert f.envs[env_id].status is EnvStatus.DRAINING
    f.disconnected(ev.AgentDisconnected(env_id, 1))
    f.polled({env_id: ev.Observation("exited", "drained")})
    assert f.envs[env_id].status is EnvStatus.STOPPED


def test_a_start_times_out_unless_the_platform_still_queues_it() -> None:
    f = fleet()
    f.request("local")
    f.request("local")
    f.start_answered(ev.EnvironmentStarted("env-1", "job-1"))
    f.start_answered(ev.EnvironmentStarted("env-2", "job-2"))
    f.take()
    at(f, 1100.0)
    queued = {"env-1": ev.Observation("starting", "pending: no free node")}
    assert f.polled(queued) == []
    out = f.take()
    # env-1 waits on its platform: its clock starts again. env-2's agent never came.
    assert of(out, ev.EnvironmentWaits) == [ev.EnvironmentWaits("env-1", "pending: no free node")]
    assert statuses(out) == [("env-2", "STARTING", FAILED)]
    assert f.envs["env-2"].reason == "agent did not register within 60 s"
    assert of(out, ev.StopEnvironment) == [ev.StopEnvironment("env-2", 5.0)]
    assert f.take_start_failures() == ["local"]
    at(f, 1150.0)
    f.polled(queued)
    assert f.take() == []  # the same reason is not told again
    at(f, 1211.0)
    f.polled({})
    assert statuses(f.take()) == [("env-1", "STARTING", FAILED)]


def test_an_environment_that_ends_before_its_agent_registers_is_a_failed_start() -> None:
    f = fleet()
    f.request("local")
    f.start_answered(ev.EnvironmentStarted("env-1", "pod-1"))
    f.take()
    f.polled({"env-1": ev.Observation("failed", "ErrImagePull")})
    assert f.envs["env-1"].reason == "agent did not register: ErrImagePull"
    assert f.take_start_failures() == ["local"]
    assert of(f.take(), ev.StopEnvironment) == [ev.StopEnvironment("env-1", 5.0)]


# ---- capacity -----------------------------------------------------------------------------------


def test_occupied_and_release_move_between_ready_and_busy() -> None:
    f = fleet(trial_slots=2)
    env_id = up(f, gpus=1)
    hold(f, env_id, "t1")
    hold(f, env_id, "t2")
    assert statuses(f.take()) == [(env_id, "READY", BUSY)]
    f.release(env_id, "t1")
    assert f.take() == []
    assert f.envs[env_id].holders == {"t2"}
    # Its processes still on the GPU: the GPU stays held, the slot is freed.
    f.release(env_id, "t2", still_in_use=(f"GPU-{env_id}-0",))
    assert statuses(f.take()) == [(env_id, "BUSY", READY)]
    assert f.envs[env_id].gpus[0].holders == {"t2"}
    assert f.running() == 0


def test_without_reuse_an_environment_takes_one_trial_and_goes_after_it() -> None:
    f = fleet(reuse=False)
    env_id = up(f)
    assert f.capacity.views()[env_id].accepting
    hold(f, env_id, "t1")
    assert f.envs[env_id].used
    assert not f.capacity.views()[env_id].accepting
    f.release(env_id, "t1")
    f.take()
    f.trial_done(env_id)
    assert f.take() == [
        ev.Send(1, ev.Shutdown(True, 5.0, "its trial ended (reuse mode is off)")),
        ev.EnvironmentStatusChanged(env_id, "READY", EnvStatus.DRAINING,
                                    "its trial ended (reuse mode is off)"),
        ev.PollSoon(),
    ]


def test_trial_done_leaves_a_reused_environment_up() -> None:
    f = fleet()
    env_id = up(f)
    hold(f, env_id, "t1")
    f.release(env_id, "t1")
    f.take()
    f.trial_done(env_id)
    assert f.take() == []
    assert f.capacity.views()[env_id].accepting


def test_views_accept_only_ready_connected_environments() -> None:
    f = fleet()
    ready = up(f)
    f.request("local")
    f.start_answered(ev.EnvironmentStarted("env-2", "pid-2"))
    views = f.capacity.views()
    assert (views[ready].accepting, views["env-2"].accepting) == (True, False)
    f.disconnected(ev.AgentDisconnected(ready, 1))
    assert not f.capacity.views()[ready].accepting


def test_environments_of_an_unprepared_platform_take_no_trial() -> None:
    f = fleet(unusable="its code could not be packed")
    env_id = up(f)
    assert f.envs[env_id].status is READY
    assert not f.capacity.views()[env_id].accepting


# ---- after a crash ------------------------------------------------------------------------------


def env_row(env_id: str, status: str, **columns: Any) -> dict[str, Any]:
    """An environment's row as the store keeps it."""
    r = {"id": env_id, "status": status, "platform": "local", "platform_id": f"pid-{env_id}",
         "reason": "", "hostname": "host", "agent_instance_id": f"i-{env_id}", "last_seq": 4,
         "info_json": "{}"}
    r.update(columns)
    return r


def test_restore_takes_up_environments_as_unreachable_and_fails_unanswered_ones() -> None:
    f = fleet()
    gpus = '{"gpus": [{"uuid": "GPU-a", "index": 0, "name": "A100", "memory_total_bytes": 8}]}'
    f.restore([
        env_row("env-1", "READY", info_json=gpus),
        env_row("env-2", "DRAINING"),
        env_row("env-3", "REQUESTED", platform_id="", agent_instance_id=""),
        env_row("env-7", "STOPPED"),
    ], {"env-1": (3, True)})
    out = f.take()
    assert out == [
        ev.EnvironmentStatusChanged("env-1", "READY", LOST, "the coordinator restarted"),
        ev.EnvironmentStatusChanged("env-2", "DRAINING", LOST, "the coordinator restarted"),
        ev.EnvironmentStatusChanged(
            "env-3", "REQUESTED", FAILED,
            "the coordinator restarted before the platform accepted it", WALL + 1000),
    ]
    env = f.envs["env-1"]
    assert (env.last_seq, env.last_seen, env.started_here) == (4, 1000.0, True)
    assert ([(g.uuid, g.capacity) for g in env.gpus], env.use_active_gpu) == ([("GPU-a", 3)], True)
    assert f.envs["env-2"].draining
    assert f.envs["env-7"].status is EnvStatus.STOPPED
    f.request("local")
    assert of(f.take(), ev.StartEnvironment) == [ev.StartEnvironment("env-8")]


def test_hold_restored_and_the_agent_coming_back() -> None:
    f = fleet()
    gpus = '{"gpus": [{"uuid": "GPU-a", "index": 0, "name": "A100"}]}'
    f.restore([env_row("env-1", "BUSY", info_json=gpus), env_row("env-2", "STOPPED")], {})
    f.take()
    # A store from before UUIDs were kept gives indices only.
    assert hold_restored(f.envs, "env-1", "t1", (), (0,)) == ("GPU-a",)
    assert hold_restored(f.envs, "env-2", "t2", (), ()) is None
    assert hold_restored(f.envs, None, "t3", (), ()) is None
    assert hold_restored(f.envs, "env-9", "t4", (), ()) is None
    assert f.envs["env-1"].gpus[0].holders == {"t1"}
    # Its agent comes back, the same instance: it goes on with its trial.
    joined = f.register(agent("env-1", link=2))
    assert joined == Joined("env-1", "local", 2, False, (), ("t1",))
    assert statuses(f.take()) == [("env-1", "LOST", READY), ("env-1", "READY", BUSY)]


@pytest.mark.parametrize("raw", ["PAUSED", "?"])
def test_restore_fails_an_environment_whose_status_cannot_be_read(raw: str) -> None:
    f = fleet()
    f.restore([env_row("env-1", raw)], {})
    assert f.envs["env-1"].status is FAILED
    assert hold_restored(f.envs, "env-1", "t1", (), ()) is None


# ---- an agent that leaves of its own accord ------------------------------------------------------


def test_a_hand_started_agent_that_leaves_after_a_drain_stops_its_environment() -> None:
    f = fleet()
    assert f.register(agent("box-a", link=3)) is not None
    hold(f, "box-a", "t1")
    f.heartbeat(ev.HeartbeatReceived("box-a", 3, draining=True), watch_memory=False)
    f.release("box-a", "t1")  # its trial ran to its end
    f.take()
    assert f.left("box-a", drained=True) == []
    why = "its agent drained and left (its operator stopped it)"
    assert statuses(f.take()) == [("box-a", "DRAINING", EnvStatus.STOPPED)]
    assert (f.envs["box-a"].status, f.envs["box-a"].reason) == (EnvStatus.STOPPED, why)
    # Its stream closes; nothing makes it lost later.
    f.disconnected(ev.AgentDisconnected("box-a", 3))
    at(f, 2000.0)
    assert f.polled({}) == [] and f.envs["box-a"].status is EnvStatus.STOPPED


def test_an_agent_that_leaves_holding_a_trial_loses_it_and_one_the_coordinator_started_waits_for_its_platform(
) -> None:
    f = fleet()
    assert f.register(agent("box-a", link=3)) is not None
    hold(f, "box-a", "t1")
    f.take()
    why = "its agent left, its trials stopped (its operator stopped it twice)"
    assert f.left("box-a", drained=False) == [Lost("box-a", ("t1",), why, "manual")]
    assert f.envs["box-a"].status is EnvStatus.STOPPED and not f.envs["box-a"].holders
    env_id = up(f)
    assert f.left(env_id, drained=True) == [] and f.take() == []
    assert f.envs[env_id].status is READY  # its platform says when its process is gone


def test_an_ended_environment_of_a_hand_agent_takes_its_agent_started_again_as_a_fresh_start() -> None:
    f = fleet()
    assert f.register(agent("box-a", link=3, instance="first")) is not None
    f.left("box-a", drained=True)
    f.disconnected(ev.AgentDisconnected("box-a", 3))
    f.take()
    # The agent that left, were it to dial in again (its Leaving's ack lost), is told it had left;
    # a new one is welcome.
    assert refused(f, agent("box-a", link=4, instance="first")) == ev.RefuseAgent("box-a", ev.Refusal.LEFT, (
        "environment box-a was stopped: its agent drained and left (its operator stopped it); this agent had left it"))
    joined = f.register(agent("box-a", link=5, instance="second"))
    assert joined == Joined("box-a", "manual", 5, True, (), ())
    out = f.take()
    assert out[0] == ev.EnvironmentAdded("box-a", "manual", EnvStatus.STARTING, WALL + 1000, again=True)
    assert statuses(out) == [("box-a", "STARTING", READY)]
    env = f.envs["box-a"]
    assert (env.status, env.instance_id, env.link, env.started_here, env.shutdown_sent) == (
        READY, "second", 5, False, False)


def test_an_agent_that_left_is_told_so_by_a_restarted_coordinator_too() -> None:
    f = fleet()
    assert f.register(agent("box-a", link=3, instance="first")) is not None
    f.left("box-a", drained=True)
    assert of(f.take(), ev.EnvironmentLeft) == [ev.EnvironmentLeft("box-a")]  # kept by the store
    why = "its agent drained and left (its operator stopped it)"
    stored = env_row("box-a", "STOPPED", platform="manual", platform_id="", reason=why, agent_instance_id="first")
    # The coordinator restarts: the fleet as the store kept it. Its agent dials again, its ack lost.
    again = fleet()
    again.restore([{**stored, "agent_left": 1}], {})
    assert refused(again, agent("box-a", link=4, instance="first")) == ev.RefuseAgent("box-a", ev.Refusal.LEFT, (
        f"environment box-a was stopped: {why}; this agent had left it"))
    # A store from before the column: the agent is refused as any of an ended environment.
    older = fleet()
    older.restore([stored], {})
    assert refused(older, agent("box-a", link=4, instance="first")).why is ev.Refusal.NOT_NOW


def test_an_ended_environment_the_coordinator_started_refuses_every_agent() -> None:
    f = fleet()
    env_id = up(f)
    f.stop_completed()
    f.take()
    assert refused(f, agent(env_id, link=9, instance="new")) == ev.RefuseAgent(
        env_id, ev.Refusal.NOT_NOW, f"environment {env_id} was stopped: the experiment stopped")
