"""A trial the user submits (`trialkeeper submit`, `rerun`) is told to the tuner as NNI's
customized trials are: an Optuna study takes it as one of its own trials, with its result;
a tuner that cannot take it still runs the search on."""

from __future__ import annotations

from typing import Any

import optuna
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.optunasearch import OptunaTuner
from trialkeeper.coordinator.search.search import Search, TrialEnded, TrialSubmitted
from trialkeeper.coordinator.search.steering import adopt_customized
from trialkeeper.coordinator.search.tuners import RandomTuner

SPACE = {"lr": {"_type": "loguniform", "_value": [1e-4, 1e-1]}, "layers": {"_type": "choice", "_value": [1, 2, 3]}}


def _customized(search: Search, parameter_id: int, params: dict[str, Any], value: float) -> None:
    adopt_customized(search, parameter_id, params)
    search.handle(TrialSubmitted(f"t{parameter_id}", parameter_id, params))
    search.handle(TrialEnded(f"t{parameter_id}", TrialStatus.SUCCEEDED, value))


def test_an_optuna_study_takes_a_customized_trial_with_its_result() -> None:
    tuner = OptunaTuner(SPACE, seed=1)
    search = Search(tuner)
    proposed = search.propose(0)
    assert proposed is not None
    search.handle(TrialSubmitted("t0", 0, proposed))
    search.handle(TrialEnded("t0", TrialStatus.SUCCEEDED, 0.25))
    _customized(search, 1, {"lr": 0.01, "layers": 2}, 0.75)

    done = tuner.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert [(t.params, t.value) for t in done][1] == ({"lr": 0.01, "layers": 2}, 0.75)
    assert search.failure == "" and search.propose(2) is not None


def test_a_tuner_without_a_way_to_adopt_hears_the_result_and_goes_on() -> None:
    heard: list[tuple[int, dict[str, Any], float]] = []

    class Listening(RandomTuner):
        def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: float) -> None:
            heard.append((parameter_id, parameters, value))

    search = Search(Listening(SPACE, seed=1))
    _customized(search, 0, {"lr": 0.001, "layers": 3}, 0.5)
    assert heard == [(0, {"lr": 0.001, "layers": 3}, 0.5)]
    assert search.failure == "" and search.propose(1) is not None
