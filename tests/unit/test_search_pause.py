"""The search core pauses and continues trials: an assessor's "pause" verdict, a tuner's and
an assessor's requests, a new trial from another's checkpoint, and one curve per trial when a
continued run reports again results a lost run had reported."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_assessor
from trialkeeper.coordinator.search.assessors import Assessor, AssessorError, Verdict
from trialkeeper.coordinator.search.nniadvisors import configuration_key
from trialkeeper.coordinator.search.search import (
    ContinueTrial,
    IntermediateStored,
    PauseTrial,
    Search,
    StopTrial,
    SubmitTrial,
    TrialContinued,
    TrialEnded,
    TrialPaused,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.tuners import PastTrial, TryLater, Tuner


class Heard(Tuner):
    """Proposes {"n": id}; records what it hears; ``sources`` says which trial each starts from."""

    def __init__(self, search_space: dict[str, Any]) -> None:
        super().__init__(search_space)
        self.heard: list[tuple[Any, ...]] = []
        self.sources: dict[int, int] = {}
        self.later = False

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        if self.later:
            raise TryLater("waiting for the rung")
        return {"n": parameter_id}

    def checkpoint_from(self, parameter_id: int) -> int | None:
        return self.sources.get(parameter_id)

    def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None:
        self.heard.append(("intermediate", parameter_id, step, value))

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None:
        self.heard.append(("final", parameter_id, parameters, value))

    def trial_paused(self, parameter_id: int) -> None:
        self.heard.append(("paused", parameter_id))

    def trial_continued(self, parameter_id: int, parameters: dict[str, Any]) -> None:
        self.heard.append(("continued", parameter_id, parameters))


class Rung(Assessor):
    """Pauses every trial at its result number ``at``; told a trial paused, continues it at
    once when ``promote`` holds it. Records the curves it judged."""

    def __init__(self, at: int = 2) -> None:
        self.at = at
        self.promote: set[str] = set()
        self.curves: dict[str, list[float]] = {}
        self.told: list[tuple[str, str]] = []

    def decide(self, trial_id: str, history: Sequence[float]) -> Verdict:
        self.curves[trial_id] = list(history)
        return Verdict.PAUSE if len(history) == self.at else Verdict.CONTINUE

    def trial_paused(self, trial_id: str) -> None:
        self.told.append(("paused", trial_id))
        if trial_id in self.promote:
            self.request_continue(trial_id)

    def trial_continued(self, trial_id: str, parameters: dict[str, Any]) -> None:
        self.told.append(("continued", trial_id))


def submit(search: Search, trial_id: str, pid: int) -> None:
    assert search.handle(TrialSubmitted(trial_id, pid, {"n": pid})) == []


def test_an_assessor_pauses_a_trial_at_its_rung_and_continues_it_once_paused() -> None:
    assessor = Rung()
    assessor.promote.add("a")
    search = Search(Heard({}), assessor)
    submit(search, "a", 0)
    assert search.handle(IntermediateStored("a", 0.1, 0)) == []
    assert search.handle(IntermediateStored("a", 0.2, 1)) == [
        PauseTrial("a", "paused by the assessor after 2 intermediate results")
    ]
    # A result stored after the pause was asked (reported before the trial saved) is not judged again.
    assert search.handle(IntermediateStored("a", 0.25, 2)) == []
    assert search.handle(TrialPaused("a")) == [ContinueTrial("a", None)]
    assert search.holds("a") is False  # being continued
    assert search.handle(TrialContinued("a")) == []
    assert assessor.told == [("paused", "a"), ("continued", "a")]
    # Continued, it is judged again on its whole curve.
    assert search.handle(IntermediateStored("a", 0.3, 3)) == []
    assert assessor.curves["a"] == [0.1, 0.2, 0.25, 0.3]


def test_a_trial_the_search_paused_is_held_and_one_paused_by_someone_else_is_not() -> None:
    search = Search(Heard({}), Rung())
    submit(search, "a", 0)
    submit(search, "b", 1)
    search.handle(IntermediateStored("a", 0.1))
    assert search.handle(IntermediateStored("a", 0.2)) == [
        PauseTrial("a", "paused by the assessor after 2 intermediate results")
    ]
    assert search.handle(TrialPaused("a")) == []
    assert search.handle(TrialPaused("b", "paused by the user")) == []
    assert search.holds("a") and not search.holds("b")
    assert ("paused", 0) in search.tuner.heard and ("paused", 1) in search.tuner.heard  # type: ignore[attr-defined]


def test_an_nni_style_assessor_still_stops_through_assess_trial() -> None:
    class Threshold(Assessor):
        def assess_trial(self, trial_id: str, history: Sequence[float]) -> bool:
            return history[-1] > 0.5

    assert Threshold().decide("t", [0.9]) is Verdict.CONTINUE and Threshold().decide("t", [0.1]) is Verdict.STOP
    search = Search(Heard({}), Threshold())
    submit(search, "a", 0)
    assert search.handle(IntermediateStored("a", 0.1)) == [
        StopTrial("a", "stopped early by the assessor after 1 intermediate results")
    ]
    # A pause is "go on" to a caller of the bool form.
    assert Rung().assess_trial("t", [0.1, 0.2]) is True


def test_an_assessor_class_implementing_neither_form_is_refused_by_name(tmp_path: Any) -> None:
    (tmp_path / "mine.py").write_text(
        "from trialkeeper.coordinator.search.assessors import Assessor\nclass Idle(Assessor):\n    pass\n"
    )
    with pytest.raises(AssessorError, match="assessor 'mine:Idle' implements neither decide nor assess_trial"):
        create_assessor(None, "mine:Idle", {}, str(tmp_path))


def test_a_tuner_pauses_and_continues_by_parameter_id_with_new_parameters() -> None:
    tuner = Heard({})
    search = Search(tuner)
    submit(search, "a", 0)
    search.handle(IntermediateStored("a", 0.5))
    tuner.request_pause(0, "rung 1")
    assert search.take_orders() == [PauseTrial("a", "rung 1")]
    tuner.request_pause(0)  # asked twice: one pause
    assert search.take_orders() == []
    assert search.handle(TrialPaused("a")) == []
    tuner.request_continue(0, {"n": 0, "lr": 0.1})
    assert search.take_orders() == [ContinueTrial("a", {"n": 0, "lr": 0.1})]
    search.handle(TrialContinued("a", {"n": 0, "lr": 0.1}))
    search.handle(TrialEnded("a", TrialStatus.SUCCEEDED, 0.9))
    assert tuner.heard[-3:] == [
        ("paused", 0), ("continued", 0, {"n": 0, "lr": 0.1}), ("final", 0, {"n": 0, "lr": 0.1}, 0.9)
    ]


def test_a_continue_asked_while_the_pause_is_on_its_way_is_carried_out_once_paused() -> None:
    tuner = Heard({})
    search = Search(tuner)
    submit(search, "a", 0)
    tuner.request_pause(0)
    tuner.request_continue(0, {"n": 0, "lr": 0.2})
    assert search.take_orders() == [PauseTrial("a", "paused by the tuner")]
    assert search.handle(TrialPaused("a")) == [ContinueTrial("a", {"n": 0, "lr": 0.2})]


def test_requests_for_unknown_or_ending_trials_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    tuner = Heard({})
    search = Search(tuner)
    submit(search, "a", 0)
    tuner.request_pause(7)
    tuner.request_stop(0, "not promising")
    tuner.request_pause(0)
    assert search.take_orders() == [StopTrial("a", "not promising")]
    assert "the tuner asked to pause 7, which is no trial of this search still going" in caplog.text
    search.handle(TrialEnded("a", TrialStatus.EARLY_STOPPED, None))
    tuner.request_continue(0)
    assert search.take_orders() == []


def test_results_reported_again_after_a_lost_run_replace_its_results_from_that_index_on() -> None:
    tuner, assessor = Heard({}), Rung(at=0)
    search = Search(tuner, assessor)
    submit(search, "a", 0)
    for i, v in enumerate([0.1, 0.3, 0.5, 0.7]):
        search.handle(IntermediateStored("a", v, i))
    # The run was lost; continued from its checkpoint at result 2, it reports 2 and 3 again.
    search.handle(IntermediateStored("a", 0.55, 2))
    assert assessor.curves["a"] == [0.1, 0.3, 0.55]
    search.handle(IntermediateStored("a", 0.75, 3))
    assert assessor.curves["a"] == [0.1, 0.3, 0.55, 0.75]
    assert [h for h in tuner.heard if h[0] == "intermediate"][-2:] == [
        ("intermediate", 0, 2, 0.55), ("intermediate", 0, 3, 0.75)
    ]
    search.handle(TrialEnded("a", TrialStatus.EARLY_STOPPED, None))
    assert tuner.heard[-1] == ("final", 0, {"n": 0}, 0.75)  # what it learns is the one curve's last


def test_a_final_result_between_intermediate_ones_leaves_a_gap_that_is_not_a_replacement() -> None:
    tuner = Heard({})
    search = Search(tuner)
    submit(search, "a", 0)
    search.handle(IntermediateStored("a", 0.1, 0))
    search.handle(IntermediateStored("a", 0.2, 2))  # index 1 was a final result
    assert [h[2:] for h in tuner.heard] == [(0, 0.1), (1, 0.2)]


def test_a_new_trial_starts_from_the_checkpoint_of_the_trial_the_tuner_names() -> None:
    tuner = Heard({})
    search = Search(tuner)
    assert search.propose_trial(0) == SubmitTrial(0, {"n": 0}, None)
    submit(search, "a", 0)
    search.handle(TrialEnded("a", TrialStatus.SUCCEEDED, 0.5))
    tuner.sources[1] = 0
    assert search.propose_trial(1) == SubmitTrial(1, {"n": 1}, "a")
    tuner.sources[2] = 99  # no trial of this search: it starts afresh
    assert search.propose_trial(2) == SubmitTrial(2, {"n": 2}, None)
    assert search.propose(3) == {"n": 3}  # the plain form


def test_a_tuner_waiting_while_only_paused_trials_remain_is_not_exhausted() -> None:
    tuner = Heard({})
    search = Search(tuner)
    submit(search, "a", 0)
    search.handle(TrialPaused("a"))
    tuner.later = True
    assert search.propose_trial(1) is None and not search.exhausted
    search.handle(TrialEnded("a", TrialStatus.USER_CANCELED, None))
    assert search.propose_trial(1) is None and search.exhausted


def test_resume_tells_paused_trials_and_drops_what_was_asked_while_replaying() -> None:
    class Replaying(Heard):
        def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None:
            super().receive_intermediate_result(parameter_id, step, value)
            self.request_pause(parameter_id)  # decided in the past: not again

    tuner, assessor = Replaying({}), Rung()
    search = Search(tuner, assessor)
    search.resume([
        PastTrial("a", 0, {"n": 0}, (0.1, 0.2), None, None, paused=True, intermediate_indexes=(0, 1)),
        PastTrial("b", 1, {"n": 1}, (0.4,), None, None),
    ])
    assert ("paused", 0) in tuner.heard and ("paused", "a") in assessor.told
    assert search.take_orders() == []
    assert not search.holds("a")  # paused by the earlier run: not this search's to give up
    assert search.handle(IntermediateStored("b", 0.5, 1)) == [
        PauseTrial("b", "paused by the assessor after 2 intermediate results")
    ]


@pytest.mark.parametrize(
    ("parameter_id", "key"),
    [("0-4_0_3", ("0-4", "3")), ("0-4_1_3", ("0-4", "3")), ("2_0_17", ("2", "17")), ("-1_0_0", ("-1", "0")),
     ("7", None), ("a__b", None)],
)
def test_an_nni_advisors_configuration_is_its_bracket_and_number(parameter_id: str, key: Any) -> None:
    assert configuration_key(parameter_id) == key
