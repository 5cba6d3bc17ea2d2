"""A platform that groups environments (one object per gang: a PyTorchJob, a Framework), in
the decision core in virtual time: each waiting trial is asked for as one group of its nodes,
the group's environments are the gang's while it waits, and the pool's room bounds it all."""

from __future__ import annotations

import random
from pathlib import Path

from test_engine import Sim
from test_gangs import start_gang, submit
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.store.store import Store


def grouping_sim(envs: int, **policy: object) -> Sim:
    policy.setdefault("trial_concurrency", 2)
    sim = Sim(environment_count=envs, groups_environments=True, **policy)
    sim.start()
    return sim


def groups(sim: Sim) -> dict[str, tuple[str, ...]]:
    """The groups asked for since the last look, by trial; each accepted by the platform."""
    found = {}
    for g in sim.take(ev.StartEnvironmentGroup):
        assert g.group == g.env_ids[0]
        found[g.trial_id] = g.env_ids
        for env_id in g.env_ids:
            sim.feed(ev.EnvironmentStarted(env_id, f"job-{g.group}"))
    return found


def test_a_waiting_gang_is_asked_for_as_one_group_and_starts_on_it() -> None:
    sim = grouping_sim(4)
    assert sim.take(ev.StartEnvironmentGroup) == [] and sim.take(ev.StartEnvironment) == []  # none wait
    submit(sim, "g", 3)
    asked = groups(sim)
    assert list(asked) == ["g"] and len(asked["g"]) == 3
    assert sim.take(ev.StartEnvironment) == []  # only whole groups on this platform
    sim.feed(ev.Ticked())
    assert groups(sim) == {}  # asked once
    for env_id in asked["g"]:
        sim.register(env_id)
    assert sorted(start_gang(sim, "g")) == sorted(asked["g"])
    assert sim.status("g") is TrialStatus.RUNNING


def test_a_group_is_the_gangs_while_it_waits_no_other_trial_takes_it() -> None:
    sim = grouping_sim(5, trial_concurrency=3)
    submit(sim, "g", 2)
    submit(sim, "h", 2)
    submit(sim, "one", 1)
    asked = groups(sim)
    assert {t: len(e) for t, e in asked.items()} == {"g": 2, "h": 2, "one": 1}
    # h's group comes up first, then one of g's: neither the one-node trial nor h takes g's.
    for env_id in (*asked["h"], asked["g"][0]):
        sim.register(env_id)
    assert sorted(start_gang(sim, "h")) == sorted(asked["h"])
    assert sim.status("one") is TrialStatus.WAITING and sim.engine.trials["one"].env_id is None
    assert "the group of 2 environments started for it" in sim.engine.trials["g"].waiting_reason
    sim.register(asked["g"][1])
    assert sorted(start_gang(sim, "g")) == sorted(asked["g"])
    sim.register(asked["one"][0])
    assert sim.starts().keys() == {"one"} and sim.engine.trials["one"].env_id == asked["one"][0]


def test_a_group_that_lost_a_member_is_not_held_and_the_gang_is_given_another() -> None:
    sim = grouping_sim(4)
    submit(sim, "g", 2)
    first = sim.take(ev.StartEnvironmentGroup)[0].env_ids
    sim.feed(ev.EnvironmentStarted(first[0], "job"))
    sim.feed(ev.EnvironmentStartFailed(first[1], "quota exceeded"))
    again = groups(sim)
    assert len(again["g"]) == 2 and not set(again["g"]) & set(first)
    sim.register(first[0])
    submit(sim, "one", 1)
    # The first group's survivor is nobody's now: the one-node trial takes it at once.
    assert sim.starts().keys() == {"one"} and sim.engine.trials["one"].env_id == first[0]
    sim.register(again["g"][0])
    assert sim.status("g") is TrialStatus.WAITING  # not on a part of each group
    sim.register(again["g"][1])
    assert sorted(start_gang(sim, "g")) == sorted(again["g"])


def test_a_gang_the_pool_has_no_room_for_waits_and_starts_on_what_the_pool_has() -> None:
    sim = grouping_sim(3)
    submit(sim, "a", 2)
    submit(sim, "b", 2)
    asked = groups(sim)
    assert list(asked) == ["a"]  # b's group would not fit the pool: it is not asked for
    submit(sim, "one", 1)
    assert groups(sim) == {}  # nor is one behind b in the queue (b would never get room)
    for env_id in asked["a"]:
        sim.register(env_id)
    a = start_gang(sim, "a")
    for e in a:
        sim.end(e, "a", ev.Outcome.SUCCEEDED)
    sim.feed(ev.Ticked())
    b = start_gang(sim, "b")  # on a's group, which is anyone's once a ran
    assert sorted(b) == sorted(a)
    assert sim.status("b") is TrialStatus.RUNNING


def test_a_platform_that_does_not_group_starts_its_pool_as_before() -> None:
    sim = Sim(environment_count=3, trial_concurrency=2)
    sim.start()
    assert len(sim.take(ev.StartEnvironment)) == 3 and sim.take(ev.StartEnvironmentGroup) == []


def test_random_trials_on_a_grouping_platform_all_finish_each_gang_on_one_group_where_it_got_one() -> None:
    """Virtual time: trials of 1 to 3 nodes arrive at random on a pool of 6 that comes as
    groups; a tenth of the members fail to start, the others register after a random delay,
    trials run up to D seconds. Every trial ends (no group held forever, no pool filled with
    groups nobody can use), and a gang given a group whose members all started runs on that
    group alone (one whose member failed is not held: the gang may start anywhere)."""
    D = 10.0
    on_their_group: set[tuple[int, str]] = set()
    for seed in range(12):
        rng = random.Random(seed)
        sim = grouping_sim(6, trial_concurrency=3)
        ends: list[tuple[float, str, str]] = []
        up: list[tuple[float, str]] = []  # (when its agent registers, env)
        whole: dict[str, set[str]] = {}  # trial -> the last group started for it whose members all started
        n = 0
        for step in range(3000):
            if step > 100 and all(t.status.terminal for t in sim.engine.trials.values()):
                break
            sim.advance(1.0)
            if step < 100 and rng.random() < 0.3:
                n += 1
                submit(sim, f"t{n}", rng.choice((1, 1, 2, 3)))
            for g in sim.take(ev.StartEnvironmentGroup):
                failing = {env_id for env_id in g.env_ids if rng.random() < 0.1}
                if not failing:
                    whole[g.trial_id] = set(g.env_ids)
                for env_id in g.env_ids:
                    if env_id in failing:
                        sim.feed(ev.EnvironmentStartFailed(env_id, "no room on the cluster"))
                    else:
                        sim.feed(ev.EnvironmentStarted(env_id, f"job-{g.group}"))
                        up.append((sim.now + rng.uniform(0.0, 5.0), env_id))
            for when, env_id in [u for u in up if u[0] <= sim.now]:
                up.remove((when, env_id))
                sim.register(env_id)
            for when, env_id, tid in [e for e in ends if e[0] <= sim.now]:
                ends.remove((when, env_id, tid))
                sim.end(env_id, tid, ev.Outcome.SUCCEEDED)
            for e in sim.engine.envs:
                if e in sim.links:
                    sim.feed(ev.HeartbeatReceived(e, sim.links[e], False))
            sim.feed(ev.Ticked())
            by_link = {link: env for env, link in sim.links.items()}
            for s in [s for s in sim.take(ev.Send) if isinstance(s.message, ev.StartTrial)]:
                m, env_id = s.message, by_link[s.link]
                sim.report(env_id, ev.TrialStartReported(m.trial_id, 1, 0.0, "h", 1 + m.node_rank))
                ends.append((sim.now + rng.uniform(1.0, D), env_id, m.trial_id))
            for t in sim.engine.trials.values():
                ranks = {r.environment_id for r in sim.engine.trial_info(t.id).ranks}
                if len(ranks) > 1 and t.id in whole:
                    assert ranks == whole[t.id], (seed, t.id, ranks, whole[t.id])
                    on_their_group.add((seed, t.id))
        assert n and all(t.status is TrialStatus.SUCCEEDED for t in sim.engine.trials.values()), seed
        assert len([e for e in sim.engine.envs.values() if not e.status.terminal]) <= 6, seed
    assert len(on_their_group) >= 5  # the check above was not vacuous (10 gangs over the 12 seeds)


def test_a_resumed_coordinator_still_holds_a_waiting_gangs_group_for_it(tmp_path: Path) -> None:
    """Which environments form a group, and for which trial, is kept in the store: a core
    restored from it holds the group for its gang (asks for no second group, lets no other
    trial take its members) and starts the gang on it once its agents are back."""
    sim = grouping_sim(4)
    submit(sim, "g", 2)
    asked = groups(sim)["g"]
    submit(sim, "one", 1)
    store = Store.in_dir(tmp_path)
    try:
        for fact in sim.out:
            if isinstance(fact, ev.FACTS):
                store.keep(fact)
        rows = {r["id"]: r for r in store.envs()}
        assert {e: (rows[e]["group_id"], rows[e]["group_for"]) for e in asked} == {e: (asked[0], "g") for e in asked}
        trial_rows, env_rows = store.trials(), store.envs()
    finally:
        store.close()

    after = grouping_sim(4)
    after.engine.restore(trial_rows, env_rows, {}, now=after.now, wall=after.now)
    after.feed(ev.Ticked())
    again = groups(after)
    assert "g" not in again and set(again) == {"one"}  # g keeps its group; one is given its own
    for env_id in asked:
        after.register(env_id)
    assert sorted(start_gang(after, "g")) == sorted(asked)
    assert after.engine.trials["one"].env_id not in asked
