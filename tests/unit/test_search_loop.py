"""The experiment loop's pass (search/loop.py) driven by hand with a sequence of the engine's
events: what it asks to carry out, submit, give up, and when it ends."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from test_search_asha import search
from trialkeeper.coordinator.engine.model import MetricEvent, StatusEvent, TrialInfo
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.loop import End, GiveUp, Loop
from trialkeeper.coordinator.search.search import ContinueTrial, PauseTrial
from trialkeeper.coordinator.search.steering import Limits


def info(trial_id: str, status: TrialStatus, **fields: Any) -> TrialInfo:
    return replace(TrialInfo(
        trial_id, 0, status, {}, None, (), None, None, None, None, "", "", None, None, None, 1,
    ), **fields)


def changed(loop: Loop, trial_id: str, old: TrialStatus, new: TrialStatus, **fields: Any) -> None:
    loop.status(StatusEvent(info(trial_id, new, **fields), old))


def orders(loop: Loop) -> list[Any]:
    loop.begin()
    out = []
    while (order := loop.next_order()) is not None:
        out.append(order)
    return out


def submit_all(loop: Loop, active: int) -> list[str]:
    submitted = []
    while (proposal := loop.propose(active)) is not None:
        trial_id = f"t{loop.submitted}"
        loop.submitted_as(trial_id, proposal, None)
        submitted.append(trial_id)
        active += 1
    return submitted


def test_the_pass_pauses_at_a_rung_continues_the_promoted_gives_up_the_rest_and_ends() -> None:
    loop = Loop(search([0.5, 0.9], reduction_factor=3), Limits(1, None, None))
    assert orders(loop) == [] and loop.spent(0.0, []) is None
    assert submit_all(loop, 0) == ["t0"]  # one slot
    assert loop.settle(False, []) is None  # it runs: wait for the engine
    changed(loop, "t0", TrialStatus.WAITING, TrialStatus.RUNNING)
    # Its first result reaches rung 1 before it saved a checkpoint: judged once it has.
    loop.metric(MetricEvent("t0", "intermediate", 0, 0.25, 0.25), checkpointed=False)
    assert loop.to_do == []
    loop.checkpointed("t0")
    assert loop.changed and [type(o) for o in orders(loop)] == [PauseTrial]
    changed(loop, "t0", TrialStatus.RUNNING, TrialStatus.PAUSED)
    assert loop.spent(1.0, ["t0"]) is None
    assert submit_all(loop, 0) == ["t1"]  # the paused one holds no slot
    loop.metric(MetricEvent("t1", "intermediate", 0, 0.45, 0.45), checkpointed=True)
    assert [type(o) for o in orders(loop)] == [PauseTrial]  # the rung is not full: it waits too
    changed(loop, "t1", TrialStatus.RUNNING, TrialStatus.PAUSED)
    assert loop.spent(2.0, ["t0", "t1"]) is None
    assert submit_all(loop, 0) == []  # the tuner has nothing more
    # Nothing runs: the search's last chance promotes the best of the rung.
    assert loop.settle(True, ["t0", "t1"]) is None and loop.changed
    assert orders(loop) == [ContinueTrial("t1", None, None)]
    changed(loop, "t1", TrialStatus.PAUSED, TrialStatus.WAITING)
    assert loop.spent(3.0, ["t0"]) is None and submit_all(loop, 1) == []
    assert loop.settle(False, ["t0"]) is None
    changed(loop, "t1", TrialStatus.RUNNING, TrialStatus.SUCCEEDED, final_metric=0.9)
    assert orders(loop) == [] and loop.spent(4.0, ["t0"]) is None and submit_all(loop, 0) == []
    give_up = loop.settle(True, ["t0"])
    assert give_up == GiveUp(("t0",), "paused by the search, which ended without continuing it")
    assert loop.settle(True, ["t0"]) is None  # given up once
    changed(loop, "t0", TrialStatus.PAUSED, TrialStatus.EARLY_STOPPED)
    assert orders(loop) == [] and loop.spent(5.0, []) is None and submit_all(loop, 0) == []
    assert loop.settle(True, []) == End("done", "the tuner has nothing more to propose")


def test_a_spent_training_budget_ends_the_search_giving_up_what_it_holds_paused() -> None:
    loop = Loop(search([0.5, 0.9, 0.7]), Limits(2, None, None, max_trial_resource=3))
    orders(loop)
    assert loop.spent(0.0, []) is None and submit_all(loop, 0) == ["t0", "t1"]
    loop.checkpointed("t0")
    loop.metric(MetricEvent("t0", "intermediate", 0, 0.25, 0.25), checkpointed=True)
    assert [type(o) for o in orders(loop)] == [PauseTrial]
    changed(loop, "t0", TrialStatus.RUNNING, TrialStatus.PAUSED)
    loop.metric(MetricEvent("t1", "intermediate", 0, 0.45, 0.45), checkpointed=True)
    loop.metric(MetricEvent("t1", "intermediate", 1, 0.6, 0.6), checkpointed=True)
    loop.metric(MetricEvent("t1", "final", 0, 0.6, 0.6), checkpointed=True)  # not training: not counted
    assert loop.changed and loop.trained == 3
    orders(loop)
    end = loop.spent(9.0, ["t0"])
    assert end == End("spent", "maxTrialResource (3) reached: 3 results reported",
                      give_up=GiveUp(("t0",), "paused by the search when maxTrialResource (3) reached: 3 results "
                                     "reported"))


def test_a_paused_trial_the_search_does_not_hold_ends_the_search_to_be_resumed() -> None:
    loop = Loop(search([0.5]), Limits(1, None, 10.0))
    orders(loop)
    assert loop.spent(0.0, []) is None and submit_all(loop, 0) == ["t0"]
    changed(loop, "t0", TrialStatus.RUNNING, TrialStatus.PAUSED, reason="paused by the user")
    orders(loop)
    assert loop.spent(1.0, ["t0"]) is None and submit_all(loop, 0) == []
    assert loop.settle(True, ["t0"]) == End("paused", "1 trials are paused and nothing else runs", paused=("t0",))
    assert loop.spent(10.0, ["t0"]) == End(
        "spent", "maxExperimentDuration (10 s) reached", give_up=GiveUp((), "paused by the search when "
                                                                         "maxExperimentDuration (10 s) reached"))


def test_a_refused_submission_ends_the_search_blaming_the_tuner_only_for_what_it_proposed() -> None:
    loop = Loop(search([0.5, 0.6]), Limits(1, 4, None))
    proposal = loop.propose(0)
    assert proposal is not None
    loop.refused(proposal, ValueError("trial asks for 99 GPUs but no environment offers more than 0"))
    s = loop.search
    assert s.failure == "a trial cannot be submitted: trial asks for 99 GPUs but no environment offers more than 0"
    assert not s.traceback_logged  # nothing raised: the experiment's end points to no traceback
    assert loop.propose(0) is None

    loop = Loop(search([0.5, 0.6]), Limits(1, 4, None))
    proposal = loop.propose(0)
    assert proposal is not None
    loop.refused(proposal, TypeError("parameters must be JSON-serialisable: set"))
    assert loop.search.failure == (
        "the tuner proposed parameters that cannot be submitted: parameters must be JSON-serialisable: set")
