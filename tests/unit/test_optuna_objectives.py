"""Several objectives with the real Optuna: its multi-objective samplers (TPE, NSGA-II, GP) get
the declared keys and directions, constraints go to the samplers that take them, a pruner is
refused beside several objectives, and a resume tells the study the stored results' keys."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
from trialkeeper.coordinator.config.objectives import dominates, parse
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.search.algorithms import create_assessor, create_tuner
from trialkeeper.coordinator.search.assessors import AssessorError
from trialkeeper.coordinator.search.optunasearch import OptunaTuner
from trialkeeper.coordinator.search.search import IntermediateStored, Search, TrialEnded, TrialSubmitted
from trialkeeper.coordinator.search.tuners import PastTrial, TunerError

SPACE = {"x": {"_type": "uniform", "_value": [0.0, 1.0]}, "y": {"_type": "uniform", "_value": [0.0, 1.0]}}
OBJECTIVES = parse({"optimize": {"accuracy": "maximize", "latency": "minimize"},
                    "constraints": {"memory": {"max": 0.8}}})


def result(p: dict[str, Any]) -> dict[str, float]:
    """Accuracy and latency pull against each other along x; memory grows with y."""
    return {"default": p["x"], "accuracy": p["x"] - 0.1 * p["y"], "latency": p["x"] ** 2 + 0.1, "memory": p["y"]}


SAMPLERS = ["TPE", "NSGA-II", "GP"]


def _needs(sampler: str) -> None:
    if sampler == "GP" and any(importlib.util.find_spec(m) is None for m in ("torch", "scipy")):
        pytest.skip("Optuna's GPSampler needs torch and scipy, not installed here (pip install torch scipy)")


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_multi_objective_sampler_gets_each_trials_values_and_constraints(sampler: str) -> None:
    _needs(sampler)
    tuner = create_tuner("optuna", None, {"sampler": sampler, "seed": 1}, SPACE, objectives=OBJECTIVES)
    assert isinstance(tuner, OptunaTuner)
    search = Search(tuner)
    for pid in range(24):
        p = search.propose(pid)
        assert p is not None
        search.handle(TrialSubmitted(f"t{pid}", pid, p))
        r = result(p)
        search.handle(IntermediateStored(f"t{pid}", r["default"], 0, result=r))  # several objectives: not kept
        search.handle(TrialEnded(f"t{pid}", TrialStatus.SUCCEEDED, r["default"], r))
    study = tuner.study
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    done = study.get_trials(deepcopy=False)
    assert len(done) == 24 and all(t.state.name == "COMPLETE" for t in done)
    for t in done:
        r = result({"x": t.params["x"], "y": t.params["y"]})
        assert t.values == pytest.approx([r["accuracy"], r["latency"]])
        assert t.user_attrs["constraints"] == pytest.approx([r["memory"] - 0.8])
        assert t.intermediate_values == {}
    best = study.best_trials  # feasible ones only, none dominating another
    assert best and all(t.user_attrs["constraints"][0] <= 0 for t in best)
    for a in best:
        assert not any(dominates(b.values, a.values, ("maximize", "minimize")) for b in best)


def test_constraints_need_a_sampler_that_takes_them() -> None:
    with pytest.raises(TunerError, match=r"objectives.constraints: Optuna's sampler 'CMA-ES' takes no constraints"):
        create_tuner("optuna", None, {"sampler": "CMA-ES"}, SPACE, objectives=OBJECTIVES)
    unconstrained = parse({"optimize": {"accuracy": "maximize", "latency": "minimize"}})
    tuner = create_tuner("optuna", None, {"sampler": "random", "seed": 2}, SPACE, objectives=unconstrained)
    assert isinstance(tuner, OptunaTuner) and len(tuner.study.directions) == 2


def test_a_pruner_is_refused_beside_several_objectives() -> None:
    tuner = create_tuner("optuna", None, {"sampler": "TPE"}, SPACE, objectives=OBJECTIVES)
    with pytest.raises(AssessorError, match="Optuna's pruners judge one objective.*accuracy, latency.*objectives.rank"):
        create_assessor("optuna", None, {"pruner": "median"}, tuner=tuner)


def test_one_declared_objective_is_its_key_in_its_direction_with_intermediate_results() -> None:
    loss = parse({"optimize": {"loss": "minimize"}})
    tuner = create_tuner("optuna", None, {"sampler": "TPE", "seed": 4}, SPACE, objectives=loss)
    assert isinstance(tuner, OptunaTuner)
    search = Search(tuner)
    p = search.propose(0)
    assert p is not None
    search.handle(TrialSubmitted("t0", 0, p))
    search.handle(IntermediateStored("t0", 9.0, 0, result={"default": 9.0, "loss": 0.5}))
    search.handle(TrialEnded("t0", TrialStatus.SUCCEEDED, 9.0, {"default": 9.0, "loss": 0.25}))
    (t,) = tuner.study.get_trials(deepcopy=False)
    assert tuner.study.direction.name == "MINIMIZE" and t.values == [0.25] and t.intermediate_values == {0: 0.5}


def test_a_final_result_without_an_objectives_key_is_told_failed_and_a_resume_tells_the_stored_keys() -> None:
    tuner = create_tuner("optuna", None, {"sampler": "NSGA-II", "seed": 5}, SPACE, objectives=OBJECTIVES)
    assert isinstance(tuner, OptunaTuner)
    search = Search(tuner)
    search.resume([
        PastTrial("t0", 0, {"x": 0.5, "y": 0.1}, (), 0.5, TrialStatus.SUCCEEDED,
                  reported={"default": 0.5, "accuracy": 0.49, "latency": 0.35, "memory": 0.1}),
        PastTrial("t1", 1, {"x": 0.9, "y": 0.2}, (), 0.9, TrialStatus.SUCCEEDED, reported=0.9),
    ])
    stored = {t.params["x"]: t for t in tuner.study.get_trials(deepcopy=False)}
    assert stored[0.5].values == pytest.approx([0.49, 0.35]) and stored[0.5].state.name == "COMPLETE"
    assert stored[0.9].state.name == "FAIL"  # a bare number has none of the objectives' keys
    assert not math.isnan(stored[0.5].values[0])
