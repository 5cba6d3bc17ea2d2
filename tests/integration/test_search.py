"""Search end to end: real agents, real trial processes, the experiment loop driving a
tuner and an assessor (built-in and Optuna's), a tuner that raises, and resume."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from conftest import build_config, pid_gone, run_async, wait_until, write_script
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import LOG_FILENAME, resume_experiment, run_experiment
from trialkeeper.coordinator.search.tuners import RandomTuner
from trialkeeper.coordinator.store.store import Store

# Reports its parameter x as every intermediate result, `steps` times, then as final; with x below
# `floor`, 300 times: a trial meant to be stopped runs until it is, however late the stop arrives.
CURVE = """
import time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
for step in range({steps} if p["x"] >= {floor} else 300):
    time.sleep({pause})
    trial.report_intermediate_result(p["x"])
trial.report_final_result(p["x"])
"""


def _config(tmp_path: Path, steps: int, pause: float, floor: float = 0.0, **overrides: Any) -> Any:
    write_script(tmp_path, "trial.py", CURVE.format(steps=steps, pause=pause, floor=floor))
    return build_config(tmp_path, trialCommand=f"{sys.executable} trial.py", **overrides)


def _metric_counts(exp: Path) -> dict[str, int]:
    store = Store.in_dir(exp, readonly=True)
    try:
        counts: dict[str, int] = {}
        for m in store.metrics():
            if m.kind == "intermediate":
                counts[m.trial_id] = counts.get(m.trial_id, 0) + 1
        return counts
    finally:
        store.close()


@pytest.mark.slow
def test_the_median_assessor_stops_hopeless_trials_and_their_slot_takes_the_next_at_once(tmp_path: Path) -> None:
    config = _config(
        tmp_path, steps=20, pause=0.15, floor=0.5, trialConcurrency=1,
        searchSpace={"x": {"_type": "choice", "_value": [0.5, 0.9, 0.1, 0.7, 0.2]}},
        tuner={"name": "grid"}, assessor={"name": "median"},
    )
    result = run_async(run_experiment(config), timeout=120)
    assert result.ok, result.reason
    trials = result.trials
    # Against the completed trials' running averages: 0.1 < median(0.5, 0.9), 0.2 < median(0.5, 0.7, 0.9).
    assert [(t.parameters["x"], t.status) for t in trials] == [
        (0.5, TrialStatus.SUCCEEDED), (0.9, TrialStatus.SUCCEEDED), (0.1, TrialStatus.EARLY_STOPPED),
        (0.7, TrialStatus.SUCCEEDED), (0.2, TrialStatus.EARLY_STOPPED),
    ]
    counts = _metric_counts(result.experiment_dir)
    for t in trials:
        if t.status is TrialStatus.EARLY_STOPPED:
            assert counts[t.id] < 300 and t.final_metric is None
            assert "stopped early by the assessor" in t.reason
    # The stopped trial's slot was given to the next trial before the stopped one had ended.
    assert trials[3].submitted_at < trials[2].ended_at  # type: ignore[operator]


# A bad trial (x < 0.5) starts a grandchild that would outlive it, then reports slowly.
SPAWNING = """
import os, subprocess, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
if p["x"] < 0.5:
    child = subprocess.Popen(["sleep", "300"])
    path = os.path.join(os.environ["TRIALKEEPER_TRIAL_DIR"], "grandchild.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.replace(path + ".tmp", path)
for step in range(300 if p["x"] < 0.5 else 3):
    time.sleep(0.1)
    trial.report_intermediate_result(p["x"])
trial.report_final_result(p["x"])
"""


@pytest.mark.slow
def test_an_assessors_stop_signals_the_trials_whole_process_tree(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", SPAWNING)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=1,
        searchSpace={"x": {"_type": "choice", "_value": [0.9, 0.1]}}, tuner={"name": "grid"},
        assessor={"name": "median", "classArgs": {"start_step": 2}},
    )
    result = run_async(run_experiment(config), timeout=90)
    assert result.ok, result.reason
    assert [t.status for t in result.trials] == [TrialStatus.SUCCEEDED, TrialStatus.EARLY_STOPPED]
    stopped = result.trials[1]
    grandchild = int((result.experiment_dir / "trials" / stopped.id / "grandchild.pid").read_text())
    wait_until(lambda: pid_gone(grandchild), 15.0, message=f"grandchild {grandchild} survived the early stop")


@pytest.mark.slow
def test_optuna_tpe_with_successive_halving_mirrors_into_an_optuna_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    config = _config(
        tmp_path,
        steps=6,
        pause=0.05,
        trialConcurrency=2,
        maxTrialNumber=10,
        searchSpace={
            "x": {"_type": "uniform", "_value": [0, 1]},
            "opt": {
                "_type": "choice",
                "_value": ["adam", {"_name": "sgd", "m": {"_type": "uniform", "_value": [0, 1]}}],
            },
        },
        tuner={"name": "optuna", "classArgs": {"sampler": "TPE", "seed": 1, "storage": url, "study_name": "mine"}},
        assessor={"name": "optuna", "classArgs": {"pruner": "successive_halving", "pruner_args": {"min_resource": 1}}},
    )
    result = run_async(run_experiment(config), timeout=120)
    assert result.ok, result.reason
    study = optuna.load_study(study_name="mine", storage=url)
    assert len(study.trials) == 10
    expected = {TrialStatus.SUCCEEDED: "COMPLETE", TrialStatus.EARLY_STOPPED: "PRUNED"}
    by_pid = {t.user_attrs["trialkeeper_parameter_id"]: t for t in study.trials}
    counts = _metric_counts(result.experiment_dir)
    for t in result.trials:
        ot = by_pid[t.sequence_id]
        assert ot.state.name == expected[t.status]
        assert len(ot.intermediate_values) == counts[t.id]
        assert ot.params["x"] == t.parameters["x"]
        if t.status is TrialStatus.SUCCEEDED:
            assert ot.value == t.final_metric


@pytest.mark.slow
def test_optuna_storage_mirrors_an_experiment_with_a_builtin_tuner_into_an_optuna_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mirror.db'}"
    config = _config(
        tmp_path, steps=5, pause=0.02, trialConcurrency=1, maxTrialNumber=8,
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}, "k": {"_type": "choice", "_value": [1, 2, 3]}},
        tuner={"name": "random", "classArgs": {"seed": 4}}, assessor={"name": "median"},
        optunaStorage=url, optunaStudyName="watched",
    )
    result = run_async(run_experiment(config), timeout=120)
    assert result.ok, result.reason
    study = optuna.load_study(study_name="watched", storage=url)
    counts = _metric_counts(result.experiment_dir)
    by_pid = {t.user_attrs["trialkeeper_parameter_id"]: t for t in study.trials}
    assert sorted(by_pid) == sorted(t.sequence_id for t in result.trials)
    expected = {TrialStatus.SUCCEEDED: "COMPLETE", TrialStatus.EARLY_STOPPED: "PRUNED"}
    for t in result.trials:
        ot = by_pid[t.sequence_id]
        assert ot.state.name == expected[t.status]
        assert ot.params == t.parameters
        assert len(ot.intermediate_values) == counts[t.id]
        assert next(iter(ot.intermediate_values.values())) == pytest.approx(t.parameters["x"])
        if t.status is TrialStatus.SUCCEEDED:
            assert ot.value == t.final_metric
    # Optuna's own analysis reads it: the score is x, so x is what matters.
    best = max((t for t in result.trials if t.status is TrialStatus.SUCCEEDED), key=lambda t: t.final_metric or 0.0)
    assert study.best_trial.user_attrs["trialkeeper_parameter_id"] == best.sequence_id
    importance = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0)
    )
    assert max(importance, key=importance.__getitem__) == "x", importance


BROKEN_TUNER = """
from trialkeeper.coordinator.search.tuners import Tuner

class Flaky(Tuner):
    def generate_parameters(self, parameter_id):
        if parameter_id == 2:
            raise RuntimeError("lost its model")
        return {"x": 0.1 * (parameter_id + 1)}
"""


def test_a_tuner_that_raises_ends_the_experiment_cleanly_with_its_traceback_logged(tmp_path: Path) -> None:
    write_script(tmp_path, "flaky_tuner.py", BROKEN_TUNER)
    config = _config(
        tmp_path, steps=2, pause=0.0, trialConcurrency=1, maxTrialNumber=5,
        tuner={"className": "flaky_tuner:Flaky", "codeDirectory": str(tmp_path)},
    )
    result = run_async(run_experiment(config), timeout=60)
    assert not result.ok
    assert result.reason == (
        f"the tuner raised in generate_parameters: RuntimeError: lost its model (its traceback is in {LOG_FILENAME})"
    )
    assert [(t.status, t.final_metric) for t in result.trials] == [
        (TrialStatus.SUCCEEDED, pytest.approx(0.1)), (TrialStatus.SUCCEEDED, pytest.approx(0.2))
    ]
    log_text = (result.experiment_dir / LOG_FILENAME).read_text()
    assert "Traceback" in log_text and 'raise RuntimeError("lost its model")' in log_text
    store = Store.in_dir(result.experiment_dir, readonly=True)
    try:
        assert store.experiment()["status"] == "FAILED"  # type: ignore[index]
        assert len(store.metrics()) == 2 * 3
    finally:
        store.close()


def test_two_experiments_in_one_process_keep_their_own_logs(tmp_path: Path) -> None:
    write_script(tmp_path, "flaky_tuner.py", BROKEN_TUNER)
    broken = _config(
        tmp_path, steps=2, pause=0.0, trialConcurrency=1, maxTrialNumber=5,
        tuner={"className": "flaky_tuner:Flaky", "codeDirectory": str(tmp_path)},
    )
    healthy = _config(
        tmp_path, steps=2, pause=0.0, trialConcurrency=1,
        searchSpace={"x": {"_type": "choice", "_value": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}}, tuner={"name": "grid"},
    )

    async def both() -> Any:
        return await asyncio.gather(run_experiment(broken), run_experiment(healthy))

    failed, fine = run_async(both, timeout=90)
    assert not failed.ok and fine.ok, fine.reason
    assert "lost its model" in (failed.experiment_dir / LOG_FILENAME).read_text()
    assert "lost its model" not in (fine.experiment_dir / LOG_FILENAME).read_text()


UNSENDABLE_TUNER = """
from trialkeeper.coordinator.search.tuners import Tuner

class Odd(Tuner):
    def generate_parameters(self, parameter_id):
        return {"x": 0.5} if parameter_id == 0 else {"x": {1, 2}}
"""


def test_parameters_that_cannot_be_submitted_end_the_experiment_with_the_reason(tmp_path: Path) -> None:
    write_script(tmp_path, "odd_tuner.py", UNSENDABLE_TUNER)
    config = _config(tmp_path, steps=1, pause=0.0, trialConcurrency=1, maxTrialNumber=3,
                     tuner={"className": "odd_tuner:Odd", "codeDirectory": str(tmp_path)})
    result = run_async(run_experiment(config), timeout=60)
    assert (
        not result.ok
        and "the tuner proposed parameters that cannot be submitted: parameters must be JSON-serialisable"
        in result.reason
    )
    assert "traceback" not in result.reason  # nothing raised: the log holds none to point to
    assert [(t.status, t.final_metric) for t in result.trials] == [(TrialStatus.SUCCEEDED, 0.5)]



SPACE = {"x": {"_type": "uniform", "_value": [0, 1]}}


@pytest.mark.slow
@pytest.mark.parametrize("tuner", ["random", "optuna"])
def test_after_resume_the_search_goes_on_from_its_history(tmp_path: Path, tuner: str) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = {"seed": 4} if tuner == "random" else {"seed": 4, "storage": url, "study_name": "s"}
    first = _config(tmp_path, steps=2, pause=0.0, trialConcurrency=1, maxTrialNumber=3, searchSpace=SPACE,
                    tuner={"name": tuner, "classArgs": args}, assessor={"name": "median"})
    done = run_async(run_experiment(first), timeout=60)
    assert done.ok, done.reason
    more = _config(tmp_path, steps=2, pause=0.0, trialConcurrency=1, maxTrialNumber=6, searchSpace=SPACE,
                   tuner={"name": tuner, "classArgs": args}, assessor={"name": "median"})
    resumed = run_async(resume_experiment(done.experiment_dir, config=more), timeout=60)
    assert resumed.ok, resumed.reason
    xs = [t.parameters["x"] for t in resumed.trials]
    assert len(xs) == 6 and xs[:3] == [t.parameters["x"] for t in done.trials]
    if tuner == "random":
        straight = RandomTuner(SPACE, seed=4)  # as if it had never stopped
        assert xs == [straight.generate_parameters(i)["x"] for i in range(6)]
    else:
        study = optuna.load_study(study_name="s", storage=url)
        assert [t.number for t in study.trials] == list(range(6))
        assert [t.params["x"] for t in study.trials] == xs
        assert [t.value for t in study.trials] == [t.final_metric for t in resumed.trials]


@pytest.mark.slow
def test_without_an_assessor_metrics_are_stored_and_not_published_to_the_loop(tmp_path: Path) -> None:
    config = _config(tmp_path, steps=3, pause=0, trialConcurrency=2, maxTrialNumber=2,
                     searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}}, tuner={"name": "random"})
    published: list[bool] = []
    result = run_async(run_experiment(
        config, on_start=lambda c: published.append(c._engine.publish_metrics)),  # type: ignore[union-attr]
        timeout=120)
    assert result.ok, result.reason
    assert published == [False]  # no per-metric event is built when nothing hears it
    assert _metric_counts(result.experiment_dir) == {t.id: 3 for t in result.trials}
    assert all(t.final_metric == t.parameters["x"] for t in result.trials)
