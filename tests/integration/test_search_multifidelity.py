"""ASHA and asynchronous Hyperband end to end: the real coordinator, real agents, real trial
processes that save checkpoints; trials paused at their rungs, continued from their
checkpoints when promoted, the best configuration trained to its end once, epoch by epoch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import optuna
import pytest
from conftest import async_wait_until, run_async, wait_until
from experiment_stop import run_until_stopped
from test_search_paused_trials import _config, _curves, _runs
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import resume_experiment, run_experiment
from trialkeeper.coordinator.search.steering import Steering
from trialkeeper.coordinator.store.store import Store

# Arrival order at the rungs mixes good and bad: some wait paused until the rung fills.
XS = [0.3, 0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.4, 0.6]
EPOCHS = 9
WAIT_S = 60  # generous: a loaded machine


def _run(tmp_path: Path, brackets: int) -> None:
    config = _config(
        tmp_path, epochs=EPOCHS, pause=0.05, trialConcurrency=2,
        searchSpace={"x": {"_type": "choice", "_value": XS}}, tuner={"name": "grid"},
        assessor={"name": "asha", "classArgs": {"max_resource": EPOCHS, "reduction_factor": 3, "brackets": brackets}},
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=240)
    assert result.ok, result.reason
    assert len(result.trials) == len(XS)  # each configuration one trial, however often paused
    by_x = {t.parameters["x"]: t for t in result.trials if t.parameters is not None}
    best = by_x[0.9]
    assert best.status is TrialStatus.SUCCEEDED, (best.status, best.reason)
    assert best.final_metric == pytest.approx(0.9 * EPOCHS)
    runs, curves = _runs(tmp_path), _curves(tmp_path / "exp")
    # Every trial's curve holds each epoch's result once, in order: a continued run went on
    # from its checkpoint, training no epoch again.
    for t in result.trials:
        x = t.parameters["x"] if t.parameters else None
        assert curves[t.id] == [(i, pytest.approx(x * (i + 1))) for i in range(len(curves[t.id]))], (t.id, runs)
        starts = runs[t.id]
        assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == len(starts), (t.id, starts)
    # Some trials were paused at a rung and continued from their checkpoints: a continued run
    # says so in runs.log as it starts, which the file may show a moment after the end.
    wait_until(lambda: any(len(r) > 1 for r in _runs(tmp_path).values()), WAIT_S,
               message=f"no trial was continued from its checkpoint: {_runs(tmp_path)}")
    stopped = [t for t in result.trials if t.status is TrialStatus.EARLY_STOPPED]
    assert stopped and all("paused by the search" in t.reason for t in stopped), [(t.id, t.reason) for t in stopped]
    # Far fewer epochs than training every configuration to the end.
    assert sum(len(c) for c in curves.values()) < len(XS) * EPOCHS * 0.7
    if brackets == 1:
        # The first trial reaches rung 1 before any save is known: it is judged there, once the
        # engine tells the search it saved a checkpoint, not at its next result.
        first = min(result.trials, key=lambda t: t.sequence_id or 0)
        store = Store.in_dir(tmp_path / "exp", readonly=True)
        try:
            pauses = [e["reason"] for e in store.events()
                      if e["entity"] == "trial" and e["entity_id"] == first.id and e["new"] == "PAUSED"]
        finally:
            store.close()
        assert pauses and ("waits at rung 1 " in pauses[0] or "after 1 intermediate result" in pauses[0]), pauses


@pytest.mark.slow
def test_asha_pauses_trials_at_rungs_and_continues_the_promoted_from_their_checkpoints(tmp_path: Path) -> None:
    _run(tmp_path, brackets=1)


@pytest.mark.slow
def test_asynchronous_hyperband_runs_its_brackets_on_the_same_checkpoints(tmp_path: Path) -> None:
    _run(tmp_path, brackets=2)


ASHA = {"name": "asha", "classArgs": {"max_resource": EPOCHS}}


def _budget_run(
    tmp_path: Path, tuner: dict[str, Any] | None = None, assessor: dict[str, Any] | None = None, **budget: object
) -> tuple[Any, dict[str, list[tuple[int, float]]]]:
    config = _config(
        tmp_path, epochs=EPOCHS, pause=0.05, trialConcurrency=2,
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}},
        tuner=tuner or {"name": "random", "classArgs": {"seed": 3}}, assessor=assessor or ASHA, **budget,
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=240)
    return result, _curves(tmp_path / "exp")


@pytest.mark.slow
def test_a_resource_budget_ends_the_search_once_that_many_epochs_are_trained(tmp_path: Path) -> None:
    result, curves = _budget_run(tmp_path, maxTrialResource=40)
    assert result.ok, result.reason
    assert result.reason.startswith("maxTrialResource (40) reached"), result.reason
    trained = sum(len(c) for c in curves.values())
    # Reached, and then ended: past it, only what the two trials then running report (a run trains
    # EPOCHS at most), however late the end lands.
    assert 40 <= trained <= 40 + 2 * 10, trained
    assert all(t.status.terminal for t in result.trials), [(t.id, t.status) for t in result.trials]
    # Those waiting at a rung then end stopped early, not canceled: the search is done with them.
    waiting = [t for t in result.trials if t.status is TrialStatus.EARLY_STOPPED]
    assert waiting and all(t.reason.startswith("paused by the search when maxTrialResource (40) reached")
                           for t in waiting), [(t.id, t.reason) for t in waiting]
    # Trials paused at their rungs freed their slots for new configurations.
    assert len(result.trials) > 40 / EPOCHS + 2


@pytest.mark.slow
def test_a_resource_budget_holds_with_optunas_sampler_and_pruner(tmp_path: Path) -> None:
    result, curves = _budget_run(
        tmp_path, {"name": "optuna", "classArgs": {"sampler": "TPE", "seed": 3}},
        {"name": "optuna", "classArgs": {"pruner": "successive_halving", "pruner_args": {"min_resource": 1}}},
        maxTrialResource=30,
    )
    assert result.ok and result.reason.startswith("maxTrialResource (30) reached"), result.reason
    assert 30 <= sum(len(c) for c in curves.values()) <= 30 + 2 * 10
    assert all(t.status.terminal for t in result.trials)


@pytest.mark.slow
def test_the_bo_sampler_learns_from_the_trials_that_end_and_heads_for_the_best(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    bo = {"name": "optuna", "classArgs": {"sampler": "bo", "seed": 5, "storage": url, "study_name": "bo",
                                          "sampler_args": {"n_startup_trials": 3}}}
    config = _config(tmp_path, epochs=3, pause=0.02, trialConcurrency=2, maxTrialNumber=10,
                     searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}}, tuner=bo)
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=240)
    assert result.ok, result.reason
    assert [t.status for t in result.trials] == [TrialStatus.SUCCEEDED] * 10
    study = optuna.load_study(study_name="bo", storage=url)
    assert sorted(t.value for t in study.trials) == sorted(t.final_metric for t in result.trials)
    # Each trial's final result is 3x: once three have ended, the process heads for x = 1.
    proposed = [t.parameters["x"] for t in sorted(result.trials, key=lambda t: t.sequence_id or 0)]
    assert max(proposed[5:]) > max(0.95, *proposed[:3]), proposed


@pytest.mark.slow
def test_an_experiment_duration_buys_new_configurations_until_the_time_is_up(tmp_path: Path) -> None:
    config = _config(
        tmp_path, epochs=EPOCHS, pause=0.05, trialConcurrency=2,
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}},
        tuner={"name": "random", "classArgs": {"seed": 3}}, assessor=ASHA, maxExperimentDuration="10m",
    )

    def bought(c: Coordinator) -> bool:
        assert c.store is not None
        finished = sum(1 for t in c.trials() if len(c.store.metrics(t.id)) == EPOCHS)
        return len(c.trials()) > finished + 2

    async def cut_short() -> Any:
        # Once the pauses have bought more configurations than the slots trained to the end, the
        # duration is cut to one second, long past (as `trialkeeper update --max-duration` does).
        steering = Steering()
        started: list[Coordinator] = []
        run = asyncio.ensure_future(run_experiment(config, experiment_dir=tmp_path / "exp", steering=steering,
                                                   on_start=started.append))
        await async_wait_until(lambda: started, WAIT_S, message="the experiment never started")
        await async_wait_until(lambda: bought(started[0]), 2 * WAIT_S, message="no configuration bought by a pause")
        await steering.update(max_experiment_duration=1.0)
        return await asyncio.wait_for(run, WAIT_S)

    result = run_async(cut_short, timeout=240)
    curves = _curves(tmp_path / "exp")
    assert result.ok, result.reason
    assert result.reason == "maxExperimentDuration (1 s) reached", result.reason
    assert all(t.status.terminal for t in result.trials), [(t.id, t.status) for t in result.trials]
    # More configurations than the slots trained to the end: the time pauses saved bought them.
    finished = sum(1 for c in curves.values() if len(c) == EPOCHS)
    assert len(result.trials) > finished + 2, (len(result.trials), finished)


@pytest.mark.slow
def test_asha_stopped_mid_rung_and_resumed_keeps_its_waiting_trials_paused_until_promoted(tmp_path: Path) -> None:
    config = _config(
        tmp_path, epochs=EPOCHS, pause=0.1, trialConcurrency=2,
        searchSpace={"x": {"_type": "choice", "_value": XS}}, tuner={"name": "grid"},
        assessor={"name": "asha", "classArgs": {"max_resource": EPOCHS}},
    )
    exp = tmp_path / "exp"

    first = run_until_stopped(
        config, exp, lambda c: sum(1 for t in c.trials() if t.status is TrialStatus.PAUSED) >= 2,
        "no trials waited at a rung",
    )
    assert not first.ok and first.reason == "stopped by the user"
    # Paused by the search at a rung (its verdict, or ASHA's own request naming the rung), not by the stop.
    waiting = {t.id for t in first.trials if t.status is TrialStatus.PAUSED
               and ("paused by the assessor" in t.reason or "waits at rung" in t.reason)}
    assert waiting, [(t.id, t.status, t.reason) for t in first.trials]
    again = run_async(resume_experiment(exp), timeout=240)
    assert again.ok, again.reason
    assert len(again.trials) == len(XS)
    by_x = {t.parameters["x"]: t for t in again.trials if t.parameters is not None}
    assert by_x[0.9].status is TrialStatus.SUCCEEDED, (by_x[0.9].status, by_x[0.9].reason)
    runs, curves = _runs(tmp_path), _curves(exp)
    for t in again.trials:  # one curve each, every epoch once (the stop canceled any not yet started)
        curve = curves.get(t.id, [])
        assert [i for i, _ in curve] == list(range(len(curve))), (t.id, runs.get(t.id))
    # Trials that waited at a rung when the experiment stopped were not continued by the
    # resume: those never promoted ran once and ended stopped early by the search.
    never = [t for t in again.trials if t.id in waiting and t.status is TrialStatus.EARLY_STOPPED]
    assert never and all(len(runs[t.id]) == 1 for t in never), {t.id: runs[t.id] for t in never}
