"""Scenarios of the decision core with several platforms at once (NNI's hybrid mode), in
virtual time: each platform starts and replaces its own environments, trials go to the
platforms they prefer, a platform that fails leaves the experiment to the others.
"""

from __future__ import annotations

from typing import Any

from test_engine import Sim, _env_row, _trial_row
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.policy import PlatformPolicy
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus


def hybrid(local: int = 1, remote: int = 1, **policy: Any) -> Sim:
    """A core over a local section and a remote one, `local` and `remote` environments each."""
    platforms = (
        PlatformPolicy(name="local", reuse=True, environment_count=local, trial_slots=1, working_directory="/here"),
        PlatformPolicy(name="remote", reuse=True, environment_count=remote, trial_slots=2, working_directory="/there"),
    )
    return Sim(platforms=platforms, **policy)


def platform_of(sim: Sim, env_id: str | None) -> str:
    assert env_id is not None
    return sim.engine.envs[env_id].platform


def started_by_platform(sim: Sim) -> dict[str, list[str]]:
    """Answer the starts asked for; their ids by platform."""
    found: dict[str, list[str]] = {}
    for env_id in sim.started_envs():
        found.setdefault(platform_of(sim, env_id), []).append(env_id)
    return found


def answer_starts(sim: Sim, *, failing: str, error: str) -> None:
    """For a while, every start asked of platform ``failing`` fails with ``error``; the
    other platforms' environments start and their agents register."""
    for _ in range(10):
        for start in sim.take(ev.StartEnvironment):
            if platform_of(sim, start.env_id) == failing:
                sim.feed(ev.EnvironmentStartFailed(start.env_id, error))
            else:
                sim.feed(ev.EnvironmentStarted(start.env_id, f"pid-{start.env_id}"))
                sim.register(start.env_id)
        sim.feed(ev.Ticked())


def ready(sim: Sim) -> dict[str, list[str]]:
    sim.start()
    envs = started_by_platform(sim)
    for ids in envs.values():
        for env_id in ids:
            sim.register(env_id)
    return envs


def test_each_platform_starts_its_own_count_with_its_own_settings() -> None:
    sim = hybrid(local=2, remote=1, trial_concurrency=4)
    sim.start()
    inserted = {i.env_id: i.platform for i in sim.take(ev.EnvironmentAdded)}
    assert sorted(inserted.values()) == ["local", "local", "remote"]
    envs = started_by_platform(sim)
    assert {e.trial_slots for e in map(sim.engine.envs.get, envs["remote"]) if e} == {2}
    for env_id in [*envs["local"], *envs["remote"]]:
        sim.register(env_id)
    sim.submit("t1")
    sim.submit("t2")
    sim.submit("t3")
    starts = sim.starts()
    # Each trial is told the working directory of its own environment's platform.
    for tid, start in starts.items():
        expected = "/here" if platform_of(sim, sim.engine.trials[tid].env_id) == "local" else "/there"
        assert start.working_directory == expected


def test_a_lost_environment_is_replaced_on_its_own_platform() -> None:
    sim = hybrid(local=1, remote=1, agent_lost_timeout_s=5.0, trial_lost_timeout_s=10.0)
    envs = ready(sim)
    (remote,) = envs["remote"]
    (local,) = envs["local"]
    for _ in range(12):
        sim.advance(1.0)
        sim.feed(ev.HeartbeatReceived(local, sim.links[local], False))
        sim.feed(ev.EnvironmentsPolled({}))
    assert sim.engine.envs[remote].status is EnvStatus.FAILED
    sim.feed(ev.Ticked())
    (replacement,) = [s.env_id for s in sim.take(ev.StartEnvironment)]
    assert platform_of(sim, replacement) == "remote"


def test_trials_go_to_the_preferred_platform_first_and_to_the_next_when_it_is_full() -> None:
    # Remote preferred (listed second in the config): its environment takes two trials.
    sim = hybrid(local=1, remote=1, trial_concurrency=4, trial_platforms=("remote", "local"))
    ready(sim)
    for tid in ("t1", "t2", "t3", "t4"):
        sim.submit(tid)
    where = {tid: platform_of(sim, sim.engine.trials[tid].env_id) for tid in ("t1", "t2", "t3")}
    assert where == {"t1": "remote", "t2": "remote", "t3": "local"}
    assert sim.status("t4") is TrialStatus.WAITING
    assert sim.engine.trials["t4"].env_id is None


def test_without_a_preference_the_order_of_the_sections_is_the_preference() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=4)
    ready(sim)
    sim.submit("t1")
    sim.submit("t2")
    assert [platform_of(sim, sim.engine.trials[t].env_id) for t in ("t1", "t2")] == ["local", "remote"]


def test_a_trial_allowed_on_one_platform_waits_for_it_even_when_another_has_room() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=4)
    sim.start()
    envs = started_by_platform(sim)
    (local,) = envs["local"]
    sim.register(local)
    sim.feed(ev.TrialSubmitted("only-remote", {}, "python trial.py", 0, 0, platforms=("remote",)))
    sim.feed(ev.Ticked())
    t = sim.engine.trials["only-remote"]
    assert t.env_id is None and "remote" in t.waiting_reason
    (remote,) = envs["remote"]
    sim.register(remote)
    assert platform_of(sim, sim.engine.trials["only-remote"].env_id) == "remote"


def test_a_platform_whose_environments_fail_to_start_is_given_up_and_the_other_carries_on() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=1)
    sim.start()
    sim.feed(ev.TrialSubmitted("remote-only", {}, "python trial.py", 0, 0, platforms=("remote",)))
    sim.submit("anywhere")
    answer_starts(sim, failing="remote", error="ssh: connection refused")
    assert "connection refused" in sim.engine.platform_errors["remote"]
    assert "local" not in sim.engine.platform_errors and not sim.engine.env_error
    # It starts no more: 3 tries (the limit for a concurrency of 1), then nothing.
    tries = [e for e in sim.engine.envs.values() if e.platform == "remote"]
    assert len(tries) == 3 and all(e.status is EnvStatus.FAILED for e in tries)
    # A trial that may run only there fails; the others run on local.
    assert sim.status("remote-only") is TrialStatus.FAILED
    assert "connection refused" in sim.engine.trials["remote-only"].reason
    assert platform_of(sim, sim.engine.trials["anywhere"].env_id) == "local"


def test_when_every_platform_is_given_up_the_experiment_has_no_environment_left() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=1)
    sim.start()
    sim.submit("t1")
    for _ in range(10):
        for start in sim.take(ev.StartEnvironment):
            sim.feed(ev.EnvironmentStartFailed(start.env_id, f"broken {platform_of(sim, start.env_id)}"))
        sim.feed(ev.Ticked())
    assert set(sim.engine.platform_errors) == {"local", "remote"}
    assert "every platform failed" in sim.engine.env_error
    assert sim.status("t1") is TrialStatus.FAILED


def test_a_trial_lost_with_its_environment_is_retried_on_another_platform() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=2, max_trial_retries=1)
    envs = ready(sim)
    (local,) = envs["local"]
    (remote,) = envs["remote"]
    sim.submit("t1")
    assert sim.engine.trials["t1"].env_id == local  # local first
    sim.run(local, "t1")
    # The local agent's process exits with the trial on it.
    sim.feed(ev.AgentDisconnected(local, sim.links[local]))
    sim.feed(ev.EnvironmentsPolled({local: ev.Observation("exited", "killed")}))
    assert sim.status("t1") is TrialStatus.WAITING
    # Its platform replaces the environment, and the replacement is up before the retry's
    # backoff ends: still, the retry prefers the platform that did not lose it.
    sim.feed(ev.Ticked())
    (replacement,) = [s.env_id for s in sim.take(ev.StartEnvironment)]
    assert platform_of(sim, replacement) == "local"
    sim.feed(ev.EnvironmentStarted(replacement, "pid-2"))
    sim.register(replacement)
    assert sim.engine.trials["t1"].env_id is None
    sim.advance(2.0)  # past the backoff
    sim.feed(ev.Ticked())
    assert sim.engine.trials["t1"].env_id == remote
    assert sim.engine.trials["t1"].attempts == 2


def test_without_reuse_new_environments_go_to_the_preferred_platform_until_it_is_given_up() -> None:
    platforms = (
        PlatformPolicy(name="slurm", reuse=False, environment_count=2, trial_slots=1),
        PlatformPolicy(name="local", reuse=False, environment_count=2, trial_slots=1),
    )
    sim = Sim(platforms=platforms, trial_concurrency=2, trial_platforms=("local", "slurm"))
    sim.start()
    sim.submit("t1")
    sim.submit("t2")
    asked = [i for i in sim.out if isinstance(i, ev.StartEnvironment)]
    assert sorted(platform_of(sim, s.env_id) for s in asked) == ["local", "local"]
    # Local cannot start its agents: after 4 failures in a row (2 x trialConcurrency) it is
    # given up, and the trials' environments come from Slurm.
    answer_starts(sim, failing="local", error="no python")
    assert "local" in sim.engine.platform_errors and not sim.engine.env_error
    tried = [e for e in sim.engine.envs.values() if e.platform == "local"]
    # The fourth failure may come back while a fifth start is out; none is asked for after.
    assert len(tried) in (4, 5) and all(e.status is EnvStatus.FAILED for e in tried)
    assert {platform_of(sim, sim.engine.trials[t].env_id) for t in ("t1", "t2")} == {"slurm"}


def test_on_resume_each_environment_keeps_its_platform_and_that_platform_s_settings() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=2)
    envs = ready(sim)
    sim.submit("t1")
    sim.submit("t2")
    sim.feed(ev.TrialSubmitted("only-local", {}, "python trial.py", 0, 0, platforms=("local",)))
    trial_rows = [_trial_row(t) for t in sim.engine.trials.values()]
    env_rows = [_env_row(e) for e in sim.engine.envs.values()]
    after = hybrid(local=1, remote=1, trial_concurrency=2)
    after.engine.restore(trial_rows, env_rows, {}, now=after.now, wall=after.now)
    (remote,) = envs["remote"]
    assert after.engine.envs[remote].platform == "remote" and after.engine.envs[remote].trial_slots == 2
    after.engine.started = True
    after.feed(ev.Ticked())
    # Both platforms have their environment back: nothing new is started.
    assert after.take(ev.StartEnvironment) == []
    # A trial allowed on one platform only is still so.
    assert after.engine.trials["only-local"].platforms == ("local",)
    after.register(remote, instance=sim.engine.envs[remote].instance_id, active=("t2",))
    after.feed(ev.Ticked())
    assert after.engine.trials["only-local"].env_id is None  # remote has a free slot: not for it
    (local,) = envs["local"]
    after.register(local, instance=sim.engine.envs[local].instance_id, active=("t1",))
    after.seqs[local] = sim.seqs[local]
    after.end(local, "t1", ev.Outcome.SUCCEEDED)
    after.feed(ev.Ticked())
    assert platform_of(after, after.engine.trials["only-local"].env_id) == "local"


def test_a_trial_goes_to_the_platform_with_the_gpus_it_needs_whatever_the_preference() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=4)
    sim.start()
    envs = started_by_platform(sim)
    (local,) = envs["local"]
    (remote,) = envs["remote"]
    sim.register(local, gpus=1)
    sim.register(remote, gpus=4)
    sim.submit("big", gpus=2)
    sim.submit("small", gpus=1)
    starts = sim.starts()
    assert platform_of(sim, sim.engine.trials["big"].env_id) == "remote" and len(starts["big"].gpu_uuids) == 2
    assert platform_of(sim, sim.engine.trials["small"].env_id) == "local"
    # Refused only when no platform has enough.
    assert sim.engine.fleet.never_fits(4) == ""
    assert "no environment offers more than 4" in sim.engine.fleet.never_fits(5)


def test_a_trial_submitted_only_for_a_platform_given_up_fails_at_once() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=1)
    sim.start()
    answer_starts(sim, failing="remote", error="ssh: connection refused")
    assert "remote" in sim.engine.platform_errors
    sim.feed(ev.TrialSubmitted("late", {}, "python trial.py", 0, 0, platforms=("remote",)))
    assert sim.status("late") is TrialStatus.FAILED
    assert "connection refused" in sim.engine.trials["late"].reason


def test_a_platform_that_could_not_be_prepared_on_resume_keeps_its_trials_but_takes_no_new_one() -> None:
    sim = hybrid(local=1, remote=1, trial_concurrency=2)
    envs = ready(sim)
    sim.submit("t1")
    sim.submit("t2")
    (remote,) = envs["remote"]
    on_remote = next(t.id for t in sim.engine.trials.values() if t.env_id == remote)
    trial_rows = [_trial_row(t) for t in sim.engine.trials.values()]
    env_rows = [_env_row(e) for e in sim.engine.envs.values()]
    # Resumed with the remote platform unusable (say its code directory is over its limit now).
    platforms = (
        PlatformPolicy(name="local", reuse=True, environment_count=1, trial_slots=1, working_directory="/here"),
        PlatformPolicy(
            name="remote", reuse=True, environment_count=1, trial_slots=2, unusable="code directory too large"
        ),
    )
    after = Sim(platforms=platforms, trial_concurrency=3)
    after.engine.restore(trial_rows, env_rows, {}, now=after.now, wall=after.now)
    after.engine.started = True
    after.feed(ev.Ticked())
    assert after.take(ev.StartEnvironment) == []  # it starts nothing
    assert "code directory too large" in after.engine.platform_errors["remote"]
    after.register(remote, instance=sim.engine.envs[remote].instance_id, active=(on_remote,))
    after.submit("t3")
    after.feed(ev.Ticked())
    # The trial running there at the crash goes on; a new one waits for local, with room there.
    assert after.engine.trials[on_remote].env_id == remote and not after.status(on_remote).terminal
    assert after.engine.trials["t3"].env_id is None and after.status("t3") is TrialStatus.WAITING
    after.feed(ev.TrialSubmitted("remote-only", {}, "python trial.py", 0, 0, platforms=("remote",)))
    assert after.status("remote-only") is TrialStatus.FAILED
    assert "code directory too large" in after.engine.trials["remote-only"].reason
