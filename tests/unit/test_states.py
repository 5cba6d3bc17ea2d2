"""The trial and environment lifecycle tables."""

from __future__ import annotations

import itertools

import pytest
from trialkeeper.coordinator.engine.states import (
    ENV_TRANSITIONS,
    TRIAL_TRANSITIONS,
    EnvStatus,
    IllegalTransition,
    TrialStatus,
    check_env,
    check_trial,
)

T, E = TrialStatus, EnvStatus


@pytest.mark.parametrize("edge", sorted(TRIAL_TRANSITIONS), ids=lambda e: f"{e[0].value}->{e[1].value}")
def test_every_legal_trial_edge_passes(edge: tuple[TrialStatus, TrialStatus]) -> None:
    check_trial(*edge)
    assert TRIAL_TRANSITIONS[edge].strip(), "every edge says what triggers it"


@pytest.mark.parametrize("edge", sorted(ENV_TRANSITIONS), ids=lambda e: f"{e[0].value}->{e[1].value}")
def test_every_legal_env_edge_passes(edge: tuple[EnvStatus, EnvStatus]) -> None:
    check_env(*edge)
    assert ENV_TRANSITIONS[edge].strip()


@pytest.mark.parametrize(
    "old,new",
    [
        (T.SUCCEEDED, T.RUNNING),
        (T.FAILED, T.WAITING),
        (T.WAITING, T.SUCCEEDED),
        (T.RUNNING, T.RUNNING),
        (T.USER_CANCELED, T.FAILED),
    ],
)
def test_illegal_trial_edges_raise(old: TrialStatus, new: TrialStatus) -> None:
    with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
        check_trial(old, new)


@pytest.mark.parametrize(
    "old,new",
    [
        (E.STOPPED, E.READY),
        (E.FAILED, E.STARTING),
        (E.REQUESTED, E.READY),
        (E.DRAINING, E.READY),
        (E.READY, E.READY),
    ],
)
def test_illegal_env_edges_raise(old: EnvStatus, new: EnvStatus) -> None:
    with pytest.raises(IllegalTransition, match=f"from {old.value} to {new.value}"):
        check_env(old, new)


def test_every_edge_outside_the_tables_raises() -> None:
    for old, new in itertools.product(TrialStatus, TrialStatus):
        if (old, new) in TRIAL_TRANSITIONS:
            continue
        with pytest.raises(IllegalTransition):
            check_trial(old, new)
    for old_e, new_e in itertools.product(EnvStatus, EnvStatus):
        if (old_e, new_e) in ENV_TRANSITIONS:
            continue
        with pytest.raises(IllegalTransition):
            check_env(old_e, new_e)


def test_terminal_flags() -> None:
    assert {s for s in TrialStatus if s.terminal} == {
        T.SUCCEEDED, T.FAILED, T.USER_CANCELED, T.EARLY_STOPPED, T.SYS_CANCELED,
    }
    assert {s for s in EnvStatus if s.terminal} == {E.STOPPED, E.FAILED}


def test_terminal_trial_states_have_no_way_out() -> None:
    for old, _ in TRIAL_TRANSITIONS:
        assert not old.terminal, f"{old} is terminal but has an outgoing edge"
    # Every non-terminal trial state can end.
    for s in TrialStatus:
        if not s.terminal:
            assert any(new.terminal for (old, new) in TRIAL_TRANSITIONS if old is s)


def test_env_terminal_states_have_no_way_out_and_lost_may_come_back() -> None:
    outgoing = {old for old, _ in ENV_TRANSITIONS if old.terminal}
    assert outgoing == set(), "a stopped or failed environment never returns"
    # An unreachable (LOST) agent may come back (still draining, if it was), or be given up.
    assert {new for old, new in ENV_TRANSITIONS if old is E.LOST} == {
        E.READY, E.BUSY, E.DRAINING, E.FAILED, E.STOPPED}
    # Every state is reachable from REQUESTED.
    reached, frontier = {E.REQUESTED}, [E.REQUESTED]
    while frontier:
        s = frontier.pop()
        for old, new in ENV_TRANSITIONS:
            if old is s and new not in reached:
                reached.add(new)
                frontier.append(new)
    assert reached == set(EnvStatus)


def test_status_values_are_their_names() -> None:
    assert all(s.value == s.name for s in TrialStatus)
    assert all(s.value == s.name for s in EnvStatus)
    assert TrialStatus("RUNNING") is T.RUNNING and T.RUNNING == "RUNNING"
