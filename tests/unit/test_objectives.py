"""Several objectives: the config's section read and refused by field, the ranking one number
makes of a result, the Pareto front, and `trialkeeper trials --pareto` over a stored experiment."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.objectives import ObjectivesError, dominates, pareto_front, parse, single
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.read.pareto import objectives_of, pareto_trials
from trialkeeper.coordinator.search.search import (
    ContinueTrial,
    IntermediateStored,
    Search,
    TrialEnded,
    TrialPaused,
    TrialSubmitted,
)
from trialkeeper.coordinator.search.tuners import RandomTuner
from trialkeeper.coordinator.store.store import Store

SECTION = {
    "optimize": {"accuracy": "maximize", "latency": "minimize"},
    "constraints": {"memory": {"max": 8}},
}


def test_a_section_gives_keys_directions_constraints_and_the_first_objective_ranks() -> None:
    o = parse(SECTION)
    assert o.keys == ("accuracy", "latency") and o.directions == ("maximize", "minimize") and o.several
    assert o.score({"accuracy": 0.9, "latency": 3, "memory": 4}) == 0.9
    assert o.score({"accuracy": 0.9, "latency": 3, "memory": 9}) is None  # breaks its constraint
    assert o.score({"accuracy": 0.9, "latency": 3}) is None  # the constrained key is missing
    assert o.violation({"accuracy": 0.9, "memory": 9.5}) == 1.5
    by_latency = parse({**SECTION, "rank": "latency"})
    assert by_latency.rank_direction == "minimize"
    assert by_latency.score({"accuracy": 0.9, "latency": 3, "memory": 1}) == -3  # bigger is better
    weighted = parse({**SECTION, "rank": {"weights": {"accuracy": 10, "latency": -0.5}}})
    assert weighted.rank_direction == "maximize"
    assert weighted.rank_value({"accuracy": 0.5, "latency": 2, "memory": 1}) == 4.0
    assert weighted.rank_value({"accuracy": 0.5}) is None


def test_a_bare_number_is_the_default_key() -> None:
    o = single("minimize")
    assert o.values(0.25) == (0.25,) and o.score(0.25) == -0.25
    assert parse({"optimize": {"loss": "minimize"}}).values(0.25) is None
    assert o.values(math.nan) is None and o.values(True) is None


@pytest.mark.parametrize(("raw", "field", "says"), [
    ([], "objectives", "expected a mapping with optimize"),
    ({}, "objectives.optimize", "expected a mapping of result key to maximize or minimize"),
    ({"optimize": {"acc": "max"}}, "objectives.optimize.acc", "expected maximize or minimize, got 'max'"),
    ({"optimize": {"acc": "maximize"}, "constraint": {}}, "objectives.constraint", "unknown field"),
    ({"optimize": {"acc": "maximize"}, "constraints": {"m": 8}}, "objectives.constraints.m", "{min: number}"),
    ({"optimize": {"acc": "maximize"}, "constraints": {"m": {"min": 2, "max": 1}}}, "objectives.constraints.m",
     "min (2) is above max (1)"),
    ({"optimize": {"acc": "maximize"}, "constraints": {"m": {"max": "x"}}}, "objectives.constraints.m.max",
     "expected a finite number"),
    ({"optimize": {"acc": "maximize"}, "rank": "loss"}, "objectives.rank", "one of the objectives (acc)"),
    ({"optimize": {"acc": "maximize"}, "rank": {"acc": 1}}, "objectives.rank", "{weights: {key: number"),
    ({"optimize": {"acc": "maximize"}, "rank": {"weights": {"acc": None}}}, "objectives.rank.weights.acc",
     "expected a finite number"),
])
def test_a_bad_section_names_the_field_and_what_is_valid(raw: Any, field: str, says: str) -> None:
    with pytest.raises(ObjectivesError) as e:
        parse(raw)
    assert any(where == field and says in what for where, what in e.value.issues), e.value.issues


def test_the_config_refuses_a_bad_section_by_its_field(tmp_path: Path) -> None:
    from trialkeeper.coordinator.config.experiment import ConfigError, parse_config

    raw = {"trialCommand": "python t.py", "trialConcurrency": 1, "trainingService": {"platform": "local"},
           "objectives": {"optimize": {"acc": "maximise"}}}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, base_dir=tmp_path)
    assert "objectives.optimize.acc: expected maximize or minimize, got 'maximise'" in str(e.value)
    ok = parse_config({**raw, "objectives": SECTION}, base_dir=tmp_path)
    assert ok.objectives == SECTION


def test_dominance_and_the_front_keep_only_what_nothing_beats() -> None:
    assert dominates((1, 1), (1, 2), ("maximize", "minimize"))
    assert not dominates((1, 1), (1, 1), ("maximize", "minimize"))
    assert not dominates((2, 3), (1, 1), ("maximize", "minimize"))
    o = parse(SECTION)
    results = {
        "a": {"accuracy": 0.9, "latency": 10, "memory": 1},
        "b": {"accuracy": 0.8, "latency": 5, "memory": 1},
        "c": {"accuracy": 0.7, "latency": 6, "memory": 1},  # b beats it in both
        "d": {"accuracy": 0.99, "latency": 1, "memory": 20},  # beats all, but breaks its constraint
        "e": {"accuracy": 0.9, "latency": 10, "memory": 2},  # ties a: neither dominates
        "f": {"accuracy": 0.95},  # misses an objective
    }
    assert pareto_front(results, o, results.__getitem__) == ["a", "b", "e"]


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    store = Store.in_dir(tmp_path / "exp")
    store.create_experiment("exp1", "demo", {"trialCommand": "python t.py", "objectives": SECTION})
    finals = [{"accuracy": 0.9, "latency": 10, "memory": 1}, {"accuracy": 0.8, "latency": 5, "memory": 1},
              {"accuracy": 0.7, "latency": 6, "memory": 1}, None]
    with store.transaction():
        for seq, final in enumerate(finals):
            row = {"id": f"t{seq}", "seq": seq, "status": "SUCCEEDED" if final else "FAILED",
                   "parameters_json": json.dumps({"x": seq}), "command": "python t.py", "gpu_number": 0,
                   "submitted_at": 1000.0 + seq}
            if final is not None:
                row.update(final_metric=final["accuracy"], final_metric_json=json.dumps(final))
            store.insert_trial(row)
    store.close()
    return tmp_path / "exp"


def test_the_read_side_and_trials_show_the_front(exp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ReadModel.open(exp) as model:
        assert objectives_of(model.stored_config()).keys == ("accuracy", "latency")
        assert [t.id for t in pareto_trials(model)] == ["t0", "t1"]
    assert cli.main(["trials", str(exp), "--pareto", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(t["id"], t["pareto"]) for t in shown] == [("t0", True), ("t1", True)]
    assert cli.main(["trials", str(exp)]) == 0
    table = capsys.readouterr().out
    assert "accuracy=0.7 latency=6" in table and table.count("front") == 2


def test_with_one_objective_the_front_is_the_best_trial(tmp_path: Path) -> None:
    store = Store.in_dir(tmp_path / "exp")
    store.create_experiment("exp1", "demo", {"trialCommand": "python t.py",
                                             "tuner": {"name": "random", "classArgs": {"optimize_mode": "minimize"}}})
    with store.transaction():
        for seq, final in enumerate([0.5, 0.2, 0.9]):
            store.insert_trial({"id": f"t{seq}", "seq": seq, "status": "SUCCEEDED", "parameters_json": "{}",
                                "command": "python t.py", "gpu_number": 0, "submitted_at": 1.0, "final_metric": final,
                                "final_metric_json": json.dumps(final)})
    store.close()
    with ReadModel.open(tmp_path / "exp") as model:
        assert [t.id for t in pareto_trials(model)] == ["t1"]


RANKER = '''
from trialkeeper.coordinator.search.assessors import Assessor, Verdict


class Ranker(Assessor):
    objectives = None

    def use_objectives(self, objectives):
        self.objectives = objectives

    def decide(self, trial_id, history):
        return Verdict.CONTINUE
'''


def test_the_experiment_hands_its_objectives_to_a_tuner_and_an_assessor_that_rank_by_them(tmp_path: Path) -> None:
    from trialkeeper.coordinator.config.experiment import parse_config
    from trialkeeper.coordinator.experiment import make_search as _search

    (tmp_path / "ranker.py").write_text(RANKER)
    config = parse_config({
        "trialCommand": "python t.py", "trialConcurrency": 2, "trainingService": {"platform": "local"},
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "pbt", "classArgs": {"population_size": 2}},
        "assessor": {"className": "ranker:Ranker", "codeDirectory": str(tmp_path)},
        "objectives": {**SECTION, "rank": "latency"},
    }, base_dir=tmp_path)
    search = _search(config, "exp1")
    for algorithm in (search.tuner, search.assessor):
        objectives = getattr(algorithm, "objectives", None)
        assert objectives is not None and objectives.keys == ("accuracy", "latency")
        assert objectives.rank_direction == "minimize"


class _Heard(RandomTuner):
    def __init__(self, space: dict[str, Any], **args: Any) -> None:
        super().__init__(space, **args)
        self.heard: list[tuple[str, int, Any]] = []

    def receive_intermediate_result(self, parameter_id: int, step: int, value: Any) -> None:
        self.heard.append(("intermediate", parameter_id, value))

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: Any) -> None:
        self.heard.append(("final", parameter_id, value))


@pytest.mark.parametrize(("mode", "sign"), [("minimize", 1), ("maximize", -1)])
def test_a_tuner_that_learns_one_value_hears_the_ranking_in_its_own_direction(mode: str, sign: int) -> None:
    tuner = _Heard({"x": {"_type": "uniform", "_value": [0, 1]}}, optimize_mode=mode, seed=1)
    search = Search(tuner, objectives=parse({**SECTION, "rank": "latency"}))
    for pid, (latency, memory) in enumerate([(3.0, 1), (2.0, 99)]):
        search.handle(TrialSubmitted(f"t{pid}", pid, {"x": 0.5}))
        r = {"default": 0.9, "accuracy": 0.9, "latency": latency, "memory": memory}
        search.handle(IntermediateStored(f"t{pid}", 0.9, 0, result=r))
        status = TrialStatus.EARLY_STOPPED if pid == 0 else TrialStatus.SUCCEEDED
        search.handle(TrialEnded(f"t{pid}", status, None if pid == 0 else 0.9, None if pid == 0 else r))
    # t0: its latency (a smaller one is better), also as its last result once stopped early; t1 breaks
    # the memory bound: nothing is heard of it.
    assert tuner.heard == [("intermediate", 0, sign * 3.0), ("final", 0, sign * 3.0)]


def test_after_a_resume_a_tuner_that_learns_one_value_hears_the_stored_results_ranking() -> None:
    from trialkeeper.coordinator.search.tuners import PastTrial

    tuner = _Heard({"x": {"_type": "uniform", "_value": [0, 1]}}, optimize_mode="maximize", seed=1)
    search = Search(tuner, objectives=parse({**SECTION, "rank": {"weights": {"accuracy": 1.0, "latency": -0.1}}}))
    search.resume([
        PastTrial("t0", 0, {"x": 0.1}, (), 0.9, TrialStatus.SUCCEEDED,
                  reported={"accuracy": 0.9, "latency": 2.0, "memory": 1}),
        PastTrial("t1", 1, {"x": 0.2}, (), 0.8, TrialStatus.SUCCEEDED,
                  reported={"accuracy": 0.8, "latency": 1.0, "memory": 50}),
    ])
    assert [(what, pid) for what, pid, _ in tuner.heard] == [("final", 0)]
    assert tuner.heard[0][2] == pytest.approx(0.7)


def test_asha_ranks_a_rung_by_the_objectives_ranking() -> None:
    from trialkeeper.coordinator.search.algorithms import create_assessor
    from trialkeeper.coordinator.search.search import PauseTrial

    asha = create_assessor("asha", None, {"max_resource": 9, "min_resource": 1, "reduction_factor": 3})
    asha.use_objectives(parse({**SECTION, "rank": "latency"}))  # type: ignore[attr-defined]
    tuner = _Heard({"x": {"_type": "uniform", "_value": [0, 1]}}, seed=1)
    search = Search(tuner, asha)
    # By the default number t0 is best; by latency (smaller is better) t1; t2 breaks the memory bound.
    results = {"t0": {"default": 0.9, "accuracy": 0.9, "latency": 5.0, "memory": 1},
               "t1": {"default": 0.5, "accuracy": 0.5, "latency": 1.0, "memory": 1},
               "t2": {"default": 0.7, "accuracy": 0.7, "latency": 0.5, "memory": 9}}
    orders: list[Any] = []
    for pid, (tid, r) in enumerate(results.items()):
        search.handle(TrialSubmitted(tid, pid, {"x": 0.5}))
        orders += search.handle(IntermediateStored(tid, r["default"], 0, checkpointed=True, result=r))
    assert sorted(o.trial_id for o in orders if isinstance(o, PauseTrial)) == ["t0", "t1", "t2"]
    # Once the rung has 3 trials it promotes its best one by latency: t1 is continued, the others wait.
    continued = [o.trial_id for tid in results for o in search.handle(TrialPaused(tid)) if isinstance(o, ContinueTrial)]
    assert continued == ["t1"]
