"""The search core: events in, stop instructions out; tuner and assessor failures; resume."""

from __future__ import annotations

from typing import Any

import pytest
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_assessor, create_tuner
from trialkeeper.coordinator.search.assessors import AssessorError, MedianStopAssessor
from trialkeeper.coordinator.search.search import (
    IntermediateStored,
    Search,
    StopTrial,
    TrialEnded,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.tuners import PastTrial, RandomTuner, Tuner

SPACE = {"x": {"_type": "uniform", "_value": [0, 1]}}


class Recording(Tuner):
    """A tuner that proposes a counter and records what it hears."""

    def __init__(self, search_space: dict[str, Any], *, fail_at: int | None = None) -> None:
        super().__init__(search_space)
        self.fail_at, self.heard = fail_at, []  # type: ignore[var-annotated]

    def generate_parameters(self, parameter_id: int) -> dict[str, Any]:
        if parameter_id == self.fail_at:
            raise RuntimeError("the model server is down")
        return {"n": parameter_id}

    def receive_intermediate_result(self, parameter_id: int, step: int, value: float) -> None:
        self.heard.append(("intermediate", parameter_id, step, value))

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None:
        self.heard.append(("final", parameter_id, value))

    def trial_end(self, parameter_id: int, success: bool) -> None:
        self.heard.append(("end", parameter_id, success))


def run_trial(search: Search, trial_id: str, pid: int, values: list[float], final: float | None) -> list[StopTrial]:
    """Feeds one trial's events; stops at the first stop instruction (as the loop would)."""
    search.handle(TrialSubmitted(trial_id, pid, {"n": pid}))
    for v in values:
        stops = search.handle(IntermediateStored(trial_id, v))
        if stops:
            search.handle(TrialEnded(trial_id, TrialStatus.EARLY_STOPPED, None))
            return stops
    search.handle(TrialEnded(trial_id, TrialStatus.SUCCEEDED, final))
    return []


def test_median_assessor_stops_a_trial_worse_than_the_median_and_the_tuner_learns_its_last_result() -> None:
    tuner = Recording({})
    search = Search(tuner, MedianStopAssessor(optimize_mode="maximize", start_step=2))
    assert run_trial(search, "a", 0, [0.5, 0.6, 0.7], 0.7) == []
    assert run_trial(search, "b", 1, [0.6, 0.7, 0.8], 0.8) == []
    # Below the median from step 2 on; step 1 is before start_step.
    stops = run_trial(search, "c", 2, [0.1, 0.2, 0.3], 0.3)
    assert stops == [StopTrial("c", "stopped early by the assessor after 2 intermediate results")]
    assert ("intermediate", 2, 1, 0.2) in tuner.heard
    assert tuner.heard[-2:] == [("final", 2, 0.2), ("end", 2, False)]  # its last intermediate result
    # A good one goes on.
    assert run_trial(search, "d", 3, [0.9, 0.9, 0.9], 0.9) == []


def test_median_assessor_minimizing() -> None:
    a = MedianStopAssessor(optimize_mode="minimize")
    for tid, h in (("a", [1.0, 0.5]), ("b", [1.0, 0.4])):
        a.assess_trial(tid, h)
        a.trial_end(tid, True)
    assert a.assess_trial("c", [3.0]) is False
    assert a.assess_trial("d", [0.2]) is True


def test_a_tuner_that_raises_fails_the_search_with_its_reason_and_proposes_nothing_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    search = Search(Recording({}, fail_at=1))
    assert search.propose(0) == {"n": 0}
    assert search.propose(1) is None
    assert search.failure == "the tuner raised in generate_parameters: RuntimeError: the model server is down"
    assert "Traceback" in caplog.text and "the model server is down" in caplog.text
    assert search.propose(2) is None  # it is not asked again


def test_an_assessor_that_raises_is_dropped_and_the_trials_run_on() -> None:
    class Broken(MedianStopAssessor):
        def assess_trial(self, trial_id: str, history: Any) -> bool:
            raise ZeroDivisionError("oops")

    search = Search(Recording({}), Broken())
    assert run_trial(search, "a", 0, [0.1, 0.2], 0.2) == []
    assert search.assessor is None and search.failure == ""


def test_results_of_trials_the_search_did_not_submit_are_ignored() -> None:
    tuner = Recording({})
    search = Search(tuner, MedianStopAssessor())
    assert search.handle(IntermediateStored("embedded", 1.0)) == []
    search.handle(TrialEnded("embedded", TrialStatus.SUCCEEDED, 1.0))
    assert tuner.heard == []


def test_resume_tells_every_stored_result_and_tracks_running_trials() -> None:
    tuner, assessor = Recording({}), MedianStopAssessor()
    search = Search(tuner, assessor)
    search.resume([
        PastTrial("a", 0, {"n": 0}, (0.5, 0.9), 0.9, TrialStatus.SUCCEEDED),
        PastTrial("b", 1, {"n": 1}, (0.2,), None, TrialStatus.EARLY_STOPPED),
        PastTrial("c", 2, {"n": 2}, (0.1,), None, None),
    ])
    assert ("final", 0, 0.9) in tuner.heard and ("final", 1, 0.2) in tuner.heard
    assert ("end", 2, False) not in tuner.heard and ("end", 2, True) not in tuner.heard
    # The still-running trial is judged on its whole history against the completed one.
    assert search.handle(IntermediateStored("c", 0.1)) == [
        StopTrial("c", "stopped early by the assessor after 2 intermediate results")
    ]


def test_a_resumed_seeded_random_tuner_goes_on_where_it_was() -> None:
    straight = RandomTuner(SPACE, seed=7)
    expected = [straight.generate_parameters(i) for i in range(6)]
    resumed = Search(RandomTuner(SPACE, seed=7))
    resumed.resume([PastTrial(f"t{i}", i, expected[i], (), 0.5, TrialStatus.SUCCEEDED) for i in range(3)])
    assert [resumed.propose(i) for i in range(3, 6)] == expected[3:]


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("medain", {}, "unknown assessor 'medain'; did you mean 'median'?"),
        ("median", {"start": 1}, "unexpected classArgs 'start' (did you mean 'start_step'?) for assessor 'median'"),
        ("median", {"start_step": -1}, "start_step must be an integer >= 0"),
        ("optuna", {"pruner": "nope"}, "classArgs.pruner: unknown Optuna pruner 'nope'; valid: hyperband, median"),
    ],
)
def test_assessor_errors_name_what_is_wrong(name: str, args: dict[str, Any], message: str) -> None:
    with pytest.raises(AssessorError) as info:
        create_assessor(name, None, args, tuner=create_tuner("random", None, {}, SPACE))
    assert message in str(info.value)


def test_an_advisor_replaces_the_tuner_and_the_assessor(tmp_path: Any) -> None:
    from trialkeeper.coordinator.config.experiment import ConfigError, parse_config

    base = {"trialCommand": "python t.py", "trialConcurrency": 1, "trainingService": {"platform": "local"}}
    config = parse_config(
        {**base, "advisor": {"name": "Hyperband", "classArgs": {"R": 9, "optimize_mode": "minimize"}}}, tmp_path
    )
    assert config.advisor is not None and config.advisor.name == "Hyperband"
    from trialkeeper.coordinator.experiment import optimize_mode_of

    assert optimize_mode_of(config) == "minimize"
    for other in ({"tuner": {"name": "random"}}, {"assessor": {"name": "median"}}):
        with pytest.raises(ConfigError, match="give either advisor or (tuner|assessor), not both"):
            parse_config({**base, "advisor": {"name": "BOHB"}, **other}, tmp_path)
    with pytest.raises(ConfigError, match="advisor.name: an advisor needs name"):
        parse_config({**base, "advisor": {}}, tmp_path)


def test_only_a_search_that_uses_intermediate_results_is_told_them() -> None:
    # The experiment loop publishes each metric to the search only when this is true.
    assert not Search(RandomTuner(SPACE, seed=1)).hears_intermediate
    assert Search(Recording({})).hears_intermediate  # the tuner learns from them
    assert Search(RandomTuner(SPACE, seed=1), MedianStopAssessor(optimize_mode="maximize")).hears_intermediate
