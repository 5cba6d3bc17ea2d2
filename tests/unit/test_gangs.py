"""Multi-node trials in the decision core, in virtual time: gangs placed whole or not at all,
the rendezvous handed from rank 0 to the others, the ranks' ends making the trial's one end,
reservations that keep a stream of small trials from starving a gang, and a randomized
scenario that checks no deadlock and no wait past the bound."""

from __future__ import annotations

import random

import pytest
from test_engine import Sim, _env_row, _trial_row
from trialkeeper.coordinator.engine import checkpoints as ck
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.gangs import place_gangs
from trialkeeper.coordinator.engine.policy import PlatformPolicy, gang_bound
from trialkeeper.coordinator.engine.scheduler import EnvCapacity
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.engine.submits import never_gangs
from trialkeeper.coordinator.engine.waiting import Demand


def gang_sim(envs: int, **policy: object) -> Sim:
    policy.setdefault("trial_concurrency", envs)
    sim = Sim(environment_count=envs, **policy)
    sim.start()
    for env_id in sim.started_envs():
        sim.register(env_id)
    return sim


def submit(sim: Sim, trial_id: str, nodes: int) -> None:
    sim.feed(ev.TrialSubmitted(trial_id, {"x": 1}, "python trial.py", 0, 0, nodes=nodes))
    sim.feed(ev.Ticked())


def start_gang(sim: Sim, trial_id: str) -> list[str]:
    """Rank 0 starts, reporting its rendezvous; the others are started with it. Returns the
    ranks' environments in rank order."""
    first = sim.starts()[trial_id]
    assert (first.node_rank, first.master_addr, first.master_port) == (0, "", 0)
    rank0 = sim.engine.trials[trial_id].env_id
    assert rank0 is not None
    sim.report(rank0, ev.TrialStartReported(trial_id, 7, 0.0, "10.0.0.5", 29500))
    others = [s for s in sim.take(ev.Send) if isinstance(s.message, ev.StartTrial)]
    by_link = {link: env for env, link in sim.links.items()}
    envs = [rank0] + [by_link[s.link] for s in sorted(others, key=lambda s: s.message.node_rank)]
    for s in others:
        m = s.message
        assert (m.nodes, m.master_addr, m.master_port) == (first.nodes, "10.0.0.5", 29500)
        sim.run(by_link[s.link], trial_id)
    assert len(set(envs)) == first.nodes
    return envs


def cancels(sim: Sim) -> dict[str, str]:
    by_link = {link: env for env, link in sim.links.items()}
    return {by_link[s.link]: s.message.trial_id for s in sim.take(ev.Send) if isinstance(s.message, ev.CancelTrial)}


def test_a_gang_starts_whole_and_succeeds_when_every_rank_exits_0() -> None:
    sim = gang_sim(3)
    submit(sim, "g", 3)
    envs = start_gang(sim, "g")
    assert sim.status("g") is TrialStatus.RUNNING
    assert [(r.environment_id, r.state) for r in sim.engine.trial_info("g").ranks] == [(e, "running") for e in envs]
    assert sim.take(ev.TrialRanks)[-1].ranks == sim.engine.trial_info("g").ranks  # stored as it changes
    sim.end(envs[0], "g", ev.Outcome.SUCCEEDED)
    sim.end(envs[2], "g", ev.Outcome.SUCCEEDED)
    assert sim.status("g") is TrialStatus.RUNNING  # rank 1 still runs
    sim.end(envs[1], "g", ev.Outcome.SUCCEEDED)
    assert sim.status("g") is TrialStatus.SUCCEEDED
    assert all(not sim.engine.envs[e].holders for e in envs)


def test_one_rank_failing_stops_the_others_and_fails_the_trial_as_a_whole() -> None:
    sim = gang_sim(2)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.end(envs[1], "g", ev.Outcome.FAILED)
    assert cancels(sim) == {envs[0]: "g"}
    assert sim.status("g") is TrialStatus.RUNNING  # until rank 0's processes are gone
    sim.end(envs[0], "g", ev.Outcome.CANCELED)
    assert sim.status("g") is TrialStatus.FAILED
    assert sim.engine.trials["g"].reason.startswith("rank 1")


def test_a_rank_lost_with_its_environment_has_the_whole_trial_retried() -> None:
    sim = gang_sim(3, max_trial_retries=1)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    for _ in range(12):  # rank 1's agent falls silent; the others go on
        sim.advance(1.0)
        for e in sim.engine.envs:
            if e != envs[1] and e in sim.links:
                sim.feed(ev.HeartbeatReceived(e, sim.links[e], False))
        sim.feed(ev.EnvironmentsPolled({}))
    sim.advance(25.0)
    sim.feed(ev.HeartbeatReceived(envs[0], sim.links[envs[0]], False))
    sim.feed(ev.EnvironmentsPolled({}))
    assert cancels(sim).get(envs[0]) == "g"
    sim.end(envs[0], "g", ev.Outcome.CANCELED)
    assert sim.status("g") is TrialStatus.WAITING
    assert "retry 1 of 1" in sim.engine.trials["g"].waiting_reason


def test_a_rank_failing_because_another_was_lost_has_the_trial_retried_as_lost() -> None:
    sim = gang_sim(3, max_trial_retries=1)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.end(envs[0], "g", ev.Outcome.FAILED)  # its collective lost the peer first
    sim.report(envs[1], ev.TrialEndReported("g", ev.Outcome.LOST, None, 9, "environment stopped", "", 0.0))
    assert sim.status("g") is TrialStatus.WAITING
    assert "rank 1: environment stopped" in sim.engine.trials["g"].waiting_reason


def test_a_running_gang_is_lost_with_a_restarted_coordinator_and_retried_whole() -> None:
    sim = gang_sim(2, max_trial_retries=1)
    submit(sim, "g", 2)
    start_gang(sim, "g")
    trial_rows = [{**_trial_row(t), "nodes": t.nodes} for t in sim.engine.trials.values()]
    env_rows = [_env_row(e) for e in sim.engine.envs.values()]
    after = Sim(environment_count=2, trial_concurrency=2, max_trial_retries=1)
    after.engine.restore(trial_rows, env_rows, {}, now=after.now, wall=after.now)
    t = after.engine.trials["g"]
    assert (t.nodes, t.status, t.env_id) == (2, TrialStatus.WAITING, None)
    assert "the coordinator restarted" in t.waiting_reason
    assert all(not e.holders for e in after.engine.envs.values())


def _saved(trial_id: str, step: int) -> ck.CheckpointSavedReported:
    return ck.CheckpointSavedReported(trial_id, step, 0, 10, f"sha256:{step}", (ck.CheckpointFile("m.pt", 10),), "",
                                      0.0)


def test_rank_0s_checkpoint_is_the_trials_and_every_rank_continues_from_it() -> None:
    sim = gang_sim(3, max_trial_retries=1)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.report(envs[1], _saved("g", 1))
    refused = [s.message for s in sim.take(ev.Send) if isinstance(s.message, ck.CheckpointRefused)]
    assert "rank 1 of a multi-node trial" in refused[0].reason
    sim.report(envs[0], _saved("g", 2))
    assert sim.engine.trials["g"].checkpoint is not None
    sim.end(envs[1], "g", ev.Outcome.LOST)
    sim.end(envs[0], "g", ev.Outcome.CANCELED)
    sim.advance(5)
    sim.feed(ev.Ticked())
    envs = start_gang(sim, "g")
    for env_id in envs:  # each rank's agent fetches rank 0's checkpoint
        sim.feed(ck.CheckpointFetchRequested(env_id, sim.links[env_id], "g", 2, "m.pt", 0))
    assert [s.checkpoint.step for s in sim.take(ck.SendCheckpoint)] == [2, 2]


def test_a_pause_has_rank_0_save_and_end_then_the_others_stopped() -> None:
    sim = gang_sim(2)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.report(envs[0], _saved("g", 1))
    sim.feed(ck.PauseRequested("g", "make room"))
    by_link = {link: env for env, link in sim.links.items()}
    asked = [by_link[s.link] for s in sim.take(ev.Send) if isinstance(s.message, ck.PauseTrial)]
    assert asked == [envs[0]]
    sim.end(envs[0], "g", ev.Outcome.PAUSED)
    assert cancels(sim) == {envs[1]: "g"}
    sim.end(envs[1], "g", ev.Outcome.CANCELED)
    assert sim.status("g") is TrialStatus.PAUSED


def test_a_rank_whose_start_was_lost_with_the_stream_is_sent_again_when_its_agent_rejoins() -> None:
    sim = gang_sim(2)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.register(envs[1], instance=sim.engine.envs[envs[1]].instance_id, active=())
    again = [s.message for s in sim.take(ev.Send) if isinstance(s.message, ev.StartTrial)]
    assert [(m.trial_id, m.node_rank, m.master_port) for m in again] == [("g", 1, 29500)]
    # Once the gang is being stopped, a rank its agent never ran counts as ended.
    sim.end(envs[0], "g", ev.Outcome.FAILED)
    sim.register(envs[1], instance=sim.engine.envs[envs[1]].instance_id, active=())
    assert sim.status("g") is TrialStatus.FAILED


def test_cancel_acts_on_every_rank() -> None:
    sim = gang_sim(2)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.feed(ev.CancelRequested("g", "enough", TrialStatus.USER_CANCELED))
    assert set(cancels(sim)) == set(envs)
    sim.end(envs[0], "g", ev.Outcome.CANCELED)
    sim.end(envs[1], "g", ev.Outcome.CANCELED)
    assert sim.status("g") is TrialStatus.USER_CANCELED


def test_another_ranks_log_goes_to_its_own_file() -> None:
    sim = gang_sim(2)
    submit(sim, "g", 2)
    envs = start_gang(sim, "g")
    sim.out.clear()
    sim.report(envs[1], ev.LogReported("g", "stdout", 0, b"hello\n"))
    writes = sim.take(ev.WriteLog)
    assert [(w.trial_id, w.stream) for w in writes] == [("g", "rank1/stdout")]


def test_two_gangs_competing_for_too_few_environments_both_finish() -> None:
    sim = gang_sim(3)
    submit(sim, "a", 2)
    submit(sim, "b", 2)
    a = start_gang(sim, "a")
    assert sim.status("b") is TrialStatus.WAITING
    assert "waiting for 2 environments at once" in sim.engine.trials["b"].waiting_reason
    assert sim.engine.trials["b"].env_id is None  # it holds nothing while it waits
    for e in a:
        sim.end(e, "a", ev.Outcome.SUCCEEDED)
    sim.feed(ev.Ticked())
    b = start_gang(sim, "b")
    for e in b:
        sim.end(e, "b", ev.Outcome.SUCCEEDED)
    assert sim.status("a") is sim.status("b") is TrialStatus.SUCCEEDED


def test_a_waiting_gang_reserves_environments_against_a_stream_of_small_trials() -> None:
    sim = gang_sim(3)
    submit(sim, "s0", 1)
    sim.run(sim.engine.trials["s0"].env_id or "", "s0")
    submit(sim, "g", 3)
    assert "reserved for it until their trials end" in sim.engine.trials["g"].waiting_reason
    for i in range(1, 6):  # small trials keep coming: none takes the reserved environments
        submit(sim, f"s{i}", 1)
        assert sim.engine.trials[f"s{i}"].env_id is None
    sim.end(sim.engine.trials["s0"].env_id or "", "s0", ev.Outcome.SUCCEEDED)
    sim.feed(ev.Ticked())
    envs = start_gang(sim, "g")
    assert len(envs) == 3


def test_a_small_trial_bound_to_end_before_the_gang_could_start_backfills_its_reserved_environments() -> None:
    sim = gang_sim(3, max_trial_duration_s=100.0)
    submit(sim, "s0", 1)
    busy = sim.engine.trials["s0"].env_id or ""
    sim.run(busy, "s0")  # bound to end 100 s from now: the gang could start then
    submit(sim, "g", 3)
    sim.advance(1.0)
    submit(sim, "long", 1)  # the experiment's limit: it would end after that
    assert sim.engine.trials["long"].env_id is None
    sim.feed(ev.TrialSubmitted("short", {}, "python trial.py", 0, 0, max_duration=30.0))
    sim.feed(ev.Ticked())
    short = sim.engine.trials["short"]
    assert short.env_id not in (None, busy) and "backfill" in short.waiting_reason
    assert sim.starts()["short"].max_duration_s == 30.0
    sim.end(busy, "s0", ev.Outcome.SUCCEEDED)
    sim.end(short.env_id or "", "short", ev.Outcome.SUCCEEDED)
    sim.feed(ev.Ticked())
    assert len(start_gang(sim, "g")) == 3  # then the gang, before the long trial
    assert sim.engine.trials["long"].env_id is None


def test_a_gang_that_can_never_fit_is_refused_with_the_reason() -> None:
    policy = Sim(environment_count=2).engine.policy
    assert "needs 3 environments at once" in never_gangs(policy, 3, ())
    assert never_gangs(policy, 2, ()) == ""


def test_one_bound_on_a_gangs_environments_for_the_config_and_submit() -> None:
    assert gang_bound(3, [2], across=False) == 2
    assert (gang_bound(3, [2, 2], across=False), gang_bound(3, [2, 2], across=True)) == (2, None)
    assert gang_bound(3, [2, 0], across=False) is None  # agents started by hand set no bound
    assert (gang_bound(1, [], across=False), gang_bound(2, [], across=False)) == (None, 0)


def test_a_gang_waits_for_agents_started_by_hand_where_they_alone_make_the_experiment() -> None:
    # environmentCount 0 in reuse mode: the config bounds no number of environments.
    sim = Sim(environment_count=0, trial_concurrency=1)
    assert never_gangs(sim.engine.policy, 2, ()) == ""
    assert never_gangs(sim.engine.policy, 2, ("local",)) == ""
    assert "needs 2 environments at once" in never_gangs(Sim(environment_count=1).engine.policy, 2, ())
    sim.start()
    assert sim.started_envs() == []
    sim.register("box-a")  # agents started by hand: of no configured platform
    submit(sim, "g", 2)
    g = sim.engine.trials["g"]
    assert (g.env_id, g.waiting_reason) == (
        None, "waiting for 2 environments at once of one platform: only 1 are ready")
    sim.register("box-b")
    sim.feed(ev.Ticked())
    envs = start_gang(sim, "g")
    assert sorted(envs) == ["box-a", "box-b"]
    for e in envs:
        sim.end(e, "g", ev.Outcome.SUCCEEDED)
    assert sim.status("g") is TrialStatus.SUCCEEDED


def test_agents_started_by_hand_that_report_another_platform_count_as_the_first_platforms() -> None:
    # Agents of --platform gpu-farm in an experiment of local only: a trial that may use only
    # local runs on them (it waited for ever), as the supply counts them as local's too.
    sim = Sim(environment_count=0, trial_concurrency=1)
    sim.start()
    for env_id in ("box-a", "box-b"):
        sim.register(env_id, platform="gpu-farm")
    sim.feed(ev.TrialSubmitted("g", {}, "python trial.py", 0, 0, platforms=("local",), nodes=2))
    sim.feed(ev.Ticked())
    envs = start_gang(sim, "g")
    assert sorted(envs) == ["box-a", "box-b"]
    assert {sim.engine.envs[e].platform for e in envs} == {"gpu-farm"}  # still shown as they report
    for e in envs:
        sim.end(e, "g", ev.Outcome.SUCCEEDED)
    assert sim.status("g") is TrialStatus.SUCCEEDED


def test_agents_started_by_hand_are_not_the_other_platforms_of_a_hybrid_experiment() -> None:
    # They count as local's (the first platform), never as remote's.
    platforms = (PlatformPolicy("local", True, 0, 1), PlatformPolicy("remote", True, 1, 1))
    sim = Sim(trial_concurrency=1, platforms=platforms)
    sim.start()
    sim.register("box-a", platform="gpu-farm")
    sim.feed(ev.TrialSubmitted("r", {}, "python trial.py", 0, 0, platforms=("remote",)))
    sim.feed(ev.TrialSubmitted("l", {}, "python trial.py", 0, 0, platforms=("remote", "local")))
    sim.feed(ev.Ticked())
    assert (sim.engine.trials["r"].env_id, sim.engine.trials["l"].env_id) == (None, "box-a")
    assert sim.engine.trials["r"].waiting_reason == "waiting: no environment of remote is ready yet"


def test_each_rank_gets_its_own_environments_gpus() -> None:
    sim = Sim(environment_count=3, trial_concurrency=3)
    sim.start()
    for env_id in sim.started_envs():
        sim.register(env_id, gpus=2)
    sim.feed(ev.TrialSubmitted("g", {}, "python trial.py", 2, 0, nodes=2))
    sim.feed(ev.Ticked())
    envs = start_gang(sim, "g")
    ranks = sim.engine.trial_info("g").ranks
    assert [(r.environment_id, r.gpu_indices) for r in ranks] == [(e, (0, 1)) for e in envs]
    for e in envs:
        assert all("g" in gpu.holders for gpu in sim.engine.envs[e].gpus)


def test_gangs_stay_within_one_platform_unless_the_config_says_otherwise() -> None:
    envs = {f"{p}{i}": EnvCapacity(f"{p}{i}", 1, platform=p) for p in ("a", "b") for i in range(2)}
    d = Demand("g", nodes=3, platforms=("a", "b"))
    assert place_gangs([(0, d)], envs).placements == []
    across = place_gangs([(0, d)], envs, across_platforms=True).placements
    assert len(across[0].ranks) == 3


@pytest.mark.parametrize("limits", [False, True], ids=["no-limits", "time-limits"])
def test_random_gangs_and_small_trials_never_deadlock_nor_wait_past_the_bound(limits: bool) -> None:
    """Virtual time: trials of 1 to 4 nodes arrive at random on 5 environments and run for
    up to D seconds. Every trial ends, and a gang that became the oldest waiting one starts
    within D (and a tick) of that. With time limits (maxTrialDuration D, and one-node trials
    with shorter limits of their own, which they keep to) small trials also backfill the
    reserved environments; the bound still holds."""
    D = 20.0
    for seed in range(12):
        rng = random.Random(seed)
        sim = gang_sim(5, max_trial_duration_s=D if limits else 0.0)
        limit: dict[str, float] = {}
        ends: list[tuple[float, str, str, ev.Outcome]] = []  # (when, env, trial)
        nodes: dict[str, int] = {}
        oldest_since: dict[str, float] = {}
        started: dict[str, float] = {}
        by_link = {link: env for env, link in sim.links.items()}
        n = 0
        for step in range(3000):
            if step > 200 and all(t.status.terminal for t in sim.engine.trials.values()):
                break
            sim.advance(1.0)
            if step < 200 and rng.random() < 0.25:
                n += 1
                tid = f"t{n}"
                nodes[tid] = rng.choice((1, 1, 1, 2, 3, 4))
                limit[tid] = rng.choice((3.0, 6.0, D)) if limits and nodes[tid] == 1 else D
                own = limit[tid] if limit[tid] < D else 0.0
                sim.feed(ev.TrialSubmitted(tid, {}, "python trial.py", 0, 0, nodes=nodes[tid], max_duration=own))
                sim.feed(ev.Ticked())
            for when, env_id, tid, outcome in [e for e in ends if e[0] <= sim.now]:
                ends.remove((when, env_id, tid, outcome))
                sim.end(env_id, tid, outcome)
            for e in sim.engine.envs:
                if e in sim.links:
                    sim.feed(ev.HeartbeatReceived(e, sim.links[e], False))
            sim.feed(ev.Ticked())
            for s in [s for s in sim.take(ev.Send) if isinstance(s.message, ev.StartTrial)]:
                m, env_id = s.message, by_link[s.link]
                sim.report(env_id, ev.TrialStartReported(m.trial_id, 1, 0.0, "h", 1 + m.node_rank))
                started.setdefault(m.trial_id, sim.now)
                runs = rng.uniform(1.0, limit[m.trial_id] - 1.0)
                ends.append((sim.now + runs, env_id, m.trial_id, ev.Outcome.SUCCEEDED))
            waiting = sorted((t for t in sim.engine.trials.values() if t.status is TrialStatus.WAITING
                              and nodes[t.id] > 1), key=lambda t: t.seq)
            if waiting:
                oldest_since.setdefault(waiting[0].id, sim.now)
        assert all(t.status is TrialStatus.SUCCEEDED for t in sim.engine.trials.values()), seed
        for tid, since in oldest_since.items():
            assert started[tid] - since <= D + 2.0, (seed, tid, started[tid] - since)
