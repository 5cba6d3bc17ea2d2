"""The supply of environments on its own: which platforms to start environments on, and
when to give one up. It is told the live environments and the waiting trials; no engine.
"""

from __future__ import annotations

from typing import Any

from trialkeeper.coordinator.engine.model import EnvState
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.states import EnvStatus
from trialkeeper.coordinator.engine.supply import Supply


def supply(*platforms: PlatformPolicy, started: bool = True, **policy: Any) -> Supply:
    """A supply for ``platforms`` (one reuse platform "local" of 2 environments if none)."""
    policy.setdefault("trial_concurrency", 2)
    s = Supply(Policy(
        experiment_id="exp",
        platforms=platforms or (PlatformPolicy("local", True, 2, 1),),
        **policy,
    ))
    s.started = started
    return s


def single(name: str, count: int = 10) -> PlatformPolicy:
    """A platform without reuse: one environment per trial, at most ``count`` at once."""
    return PlatformPolicy(name, reuse=False, environment_count=count, trial_slots=1)


def env(env_id: str, platform: str, *, single_use: bool = False, used: bool = False,
        holders: tuple[str, ...] = ()) -> EnvState:
    return EnvState(env_id, EnvStatus.READY, single_use=single_use, trial_slots=1,
                    platform=platform, used=used, holders=set(holders))


# ---- how many to start ----------------------------------------------------------------------


def test_nothing_is_planned_before_the_experiment_starts() -> None:
    s = supply(started=False)
    plan = s.plan([], waiting=5)
    assert (plan.starts, plan.give_up) == ([], "")
    s.started = True
    assert s.plan([], waiting=5).starts == ["local", "local"]


def test_reuse_tops_up_to_environment_count() -> None:
    s = supply(PlatformPolicy("local", True, 3, 1))
    assert s.plan([env("env-1", "local")], waiting=0).starts == ["local", "local"]
    live = [env(f"env-{i}", "local") for i in range(1, 4)]
    assert s.plan(live, waiting=9).starts == []


def test_an_environment_count_of_0_starts_none_and_leaves_the_trials_to_agents_started_by_hand() -> None:
    s = supply(PlatformPolicy("local", True, 0, 1))
    assert s.plan([], waiting=5).starts == []
    assert s.plan([env("box", "manual")], waiting=5).starts == []


def test_reuse_counts_agents_started_by_hand_as_the_first_platforms() -> None:
    s = supply(PlatformPolicy("a", True, 2, 1), PlatformPolicy("b", True, 1, 1))
    assert s.plan([], waiting=0).starts == ["a", "a", "b"]
    # An operator's agent joins as platform "manual": it takes a place of "a", not of "b".
    assert s.plan([env("box", "manual")], waiting=0).starts == ["a", "b"]


def test_without_reuse_one_environment_per_waiting_trial_within_trial_concurrency() -> None:
    s = supply(single("local"), trial_concurrency=3)
    assert s.plan([], waiting=2).starts == ["local", "local"]
    assert s.plan([], waiting=7).starts == ["local"] * 3
    # A fresh environment (no trial yet) will take one of the waiting trials.
    fresh = env("env-1", "local", single_use=True)
    assert s.plan([fresh], waiting=1).starts == []
    # Running trials use up trialConcurrency.
    busy = [env(f"env-{i}", "local", single_use=True, used=True, holders=(f"t{i}",))
            for i in range(3)]
    assert s.plan(busy, waiting=4).starts == []


def test_without_reuse_the_most_preferred_platform_is_filled_first() -> None:
    s = supply(single("big", 10), single("small", 2), trial_concurrency=5,
               trial_platforms=("small", "big"))
    # "small" is preferred but takes two; "big" takes the rest. Listed in the config's order.
    assert s.plan([], waiting=4).starts == ["big", "big", "small", "small"]
    assert s.plan([], waiting=1).starts == ["small"]


def test_a_platform_that_could_not_be_prepared_starts_nothing() -> None:
    bad = PlatformPolicy("gone", True, 2, 1, unusable="its SDK is missing")
    s = supply(bad, PlatformPolicy("local", True, 1, 1))
    assert s.platform_errors == {"gone": "could not be prepared: its SDK is missing"}
    assert s.plan([], waiting=0).starts == ["local"]
    assert s.env_error == ""


# ---- giving a platform up ---------------------------------------------------------------------


def test_the_limit_is_three_or_twice_trial_concurrency() -> None:
    assert supply(trial_concurrency=1).limit == 3
    assert supply(trial_concurrency=4).limit == 8


def test_after_limit_failed_starts_in_a_row_plan_names_the_platform_to_give_up() -> None:
    s = supply(trial_concurrency=1)
    for _ in range(s.limit - 1):
        s.start_failed("local")
    assert s.plan([], waiting=1).give_up == ""
    s.start_failed("local")
    plan = s.plan([], waiting=1)
    assert (plan.starts, plan.give_up) == ([], "local")
    # Only while it is wanted: with its environments up, nothing is given up.
    live = [env("env-8", "local"), env("env-9", "local")]
    assert s.plan(live, waiting=1).give_up == ""


def test_giving_the_only_platform_up_sets_env_error_and_stops_planning() -> None:
    s = supply(trial_concurrency=1)
    s.give_up("local", "no quota")
    expected = "3 environments in a row failed to start; last: no quota"
    assert s.platform_errors == {"local": expected}
    assert s.env_error == expected
    assert s.plan([], waiting=3).starts == []


def test_with_several_platforms_env_error_waits_until_every_one_is_given_up() -> None:
    s = supply(PlatformPolicy("a", True, 1, 1), PlatformPolicy("b", True, 1, 1),
               trial_concurrency=1)
    for _ in range(3):
        s.start_failed("a")
    plan = s.plan([], waiting=0)
    assert (plan.starts, plan.give_up) == ([], "a")  # those before it come when asked again
    s.give_up("a", "no quota")
    assert s.env_error == ""
    assert s.plan([], waiting=0).starts == ["b"]
    s.give_up("b", "bad image")
    assert s.env_error == (
        "every platform failed: a: 3 environments in a row failed to start; last: no quota; "
        "b: 3 environments in a row failed to start; last: bad image"
    )
    assert s.plan([], waiting=0).starts == []


def test_an_env_error_stops_every_plan() -> None:
    s = supply()
    s.env_error = "broken"
    assert s.plan([], waiting=4).starts == []


def test_an_agent_joining_resets_the_count_of_failed_starts() -> None:
    s = supply(trial_concurrency=1)
    for _ in range(3):
        s.start_failed("local")
    s.joined("local")
    plan = s.plan([], waiting=0)
    assert (plan.starts, plan.give_up) == (["local", "local"], "")
    # Counting starts over: two more failures are not yet the limit.
    s.start_failed("local")
    s.start_failed("local")
    assert s.plan([], waiting=0).give_up == ""
