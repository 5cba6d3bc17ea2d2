"""Several objectives end to end: real trials report dicts of results, Optuna's NSGA-II study
optimizes two of their keys under a constraint, and `trialkeeper trials --pareto` shows the
trials no other beats, as the read side computes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import build_config, run_async, write_script
from trialkeeper.coordinator import cli
from trialkeeper.coordinator.config.objectives import dominates
from trialkeeper.coordinator.experiment import run_experiment

TRIAL = """
from trialkeeper.agent import trial

p = trial.get_next_parameter()
accuracy, latency, memory = p["x"] - 0.1 * p["y"], p["x"] ** 2 + 0.1, p["y"]
trial.report_final_result({"default": accuracy, "accuracy": accuracy, "latency": latency, "memory": memory})
"""


@pytest.mark.slow
def test_an_optuna_study_optimizes_two_keys_and_trials_shows_the_pareto_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    optuna = pytest.importorskip("optuna", reason="the optuna tuner needs optuna: pip install -e '.[optuna]'")
    write_script(tmp_path, "trial.py", TRIAL)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=2, maxTrialNumber=12,
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}, "y": {"_type": "uniform", "_value": [0, 1]}},
        tuner={"name": "optuna", "classArgs": {"sampler": "NSGA-II", "seed": 3, "storage": f"sqlite:///{tmp_path}/s.db"}},
        objectives={"optimize": {"accuracy": "maximize", "latency": "minimize"},
                    "constraints": {"memory": {"max": 0.7}}},
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=180)
    assert result.ok, result.reason
    study = optuna.load_study(study_name=f"trialkeeper-{result.experiment_id}", storage=f"sqlite:///{tmp_path}/s.db")
    assert len(study.directions) == 2 and len(study.get_trials()) == 12
    finals = {t.id: t.final_metric_value for t in result.trials}
    assert cli.main(["trials", str(tmp_path / "exp"), "--pareto", "--json"]) == 0
    front = {t["id"] for t in json.loads(capsys.readouterr().out)}
    feasible = {tid: (r["accuracy"], r["latency"]) for tid, r in finals.items() if r["memory"] <= 0.7}
    expected = {tid for tid, v in feasible.items()
                if not any(dominates(w, v, ("maximize", "minimize")) for w in feasible.values())}
    assert front == expected and front
    # The study's own front over the feasible trials is the same trials.
    by_params = {(round(t.parameters["x"], 9), round(t.parameters["y"], 9)): t.id for t in result.trials}
    study_front = {by_params[(round(t.params["x"], 9), round(t.params["y"], 9))] for t in study.best_trials}
    assert study_front == front
