"""Searches that pause and continue trials, end to end: real agents, real trial processes that
checkpoint, the experiment loop carrying out what the assessor asks; a stopped experiment's
paused trials continued first by a resume; a trial paused by the user keeps the experiment
from ending DONE."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import async_wait_until, build_config, run_async, write_script
from experiment_stop import run_until_stopped
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import resume_experiment, run_experiment
from trialkeeper.coordinator.store.store import Store

WAIT_S = 60.0

# Trains a model whose state is its epoch count, saving a checkpoint after each epoch; a
# continued run starts from the checkpoint's epoch and ends at `epochs` (or at once, when it
# paused later than that). A first run ends after `first` epochs: with `first` far above
# `epochs`, it is held until it is paused (a pause lands at a save), so no pause races the
# trial's end. Each run appends "<trial> <first epoch>" to runs.log, so the test sees where
# each run started.
TRIAL = """
import json, os, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
here = os.environ["TRIALKEEPER_CHECKPOINT_DIR"]
start = trial.checkpoint_step() or 0
if start:
    with open(os.path.join(here, "state.json")) as f:
        assert json.load(f)["epoch"] == start, "the checkpoint holds another epoch"
with open({log!r}, "a") as f:
    f.write(f"{{trial.get_trial_id()}} {{start}}\\n")
end = max({epochs}, start) if start else {first}
for epoch in range(start, end):
    time.sleep({pause})
    trial.report_intermediate_result(p["x"] * (epoch + 1))
    with open(os.path.join(here, "state.json"), "w") as f:
        json.dump({{"epoch": epoch + 1}}, f)
    trial.save_checkpoint(epoch + 1)
trial.report_final_result(p["x"] * end)
"""

# Pauses every trial at its second result; continues a paused trial whose last result is at
# least `keep`, and leaves the others paused (the loop stops them once the search is done).
RUNG = """
from trialkeeper.coordinator.search.assessors import Assessor, Verdict

class Rung(Assessor):
    def __init__(self, keep):
        self.keep, self.last = keep, {}

    def decide(self, trial_id, history):
        self.last[trial_id] = history[-1]
        return Verdict.PAUSE if len(history) == 2 else Verdict.CONTINUE

    def trial_paused(self, trial_id):
        if self.last.get(trial_id, 0) >= self.keep:
            self.request_continue(trial_id)
"""


# A first run held until it is paused ends here at the latest (a failure: the pause never came).
HELD_EPOCHS = 300


def _config(tmp_path: Path, *, epochs: int, pause: float, first: int | None = None, **overrides: Any) -> Any:
    """The TRIAL in tmp_path, a first run ending after ``first`` epochs (``epochs`` when None);
    ``overrides``: the config's fields."""
    trial = TRIAL.format(log=str(tmp_path / "runs.log"), epochs=epochs, first=first or epochs, pause=pause)
    write_script(tmp_path, "trial.py", trial)
    return build_config(tmp_path, trialCommand=f"{sys.executable} trial.py", **overrides)


def _runs(tmp_path: Path) -> dict[str, list[int]]:
    """Each trial's runs, by the epoch each started from."""
    runs: dict[str, list[int]] = {}
    for line in (tmp_path / "runs.log").read_text().splitlines():
        trial_id, start = line.split()
        runs.setdefault(trial_id, []).append(int(start))
    return runs


def _curves(exp: Path) -> dict[str, list[tuple[int, float]]]:
    store = Store.in_dir(exp, readonly=True)
    try:
        curves: dict[str, list[tuple[int, float]]] = {}
        for m in store.metrics():
            if m.kind == "intermediate":
                curves.setdefault(m.trial_id, []).append((m.index, m.value))
        return curves
    finally:
        store.close()


@pytest.mark.slow
def test_an_assessor_pauses_trials_at_a_rung_continues_the_good_and_the_rest_end_early_stopped(
    tmp_path: Path,
) -> None:
    write_script(tmp_path, "rung.py", RUNG)
    config = _config(
        tmp_path, epochs=4, pause=0.2, first=HELD_EPOCHS, trialConcurrency=2,
        searchSpace={"x": {"_type": "choice", "_value": [0.2, 0.8]}}, tuner={"name": "grid"},
        assessor={"className": "rung:Rung", "codeDirectory": str(tmp_path), "classArgs": {"keep": 1.0}},
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=120)
    assert result.ok, result.reason
    by_x = {t.parameters["x"]: t for t in result.trials if t.parameters is not None}
    good, bad = by_x[0.8], by_x[0.2]
    assert good.status is TrialStatus.SUCCEEDED, (good.status, good.reason)
    assert bad.status is TrialStatus.EARLY_STOPPED, (bad.status, bad.reason)
    assert "paused by the search, which ended without continuing it" in bad.reason
    runs = _runs(tmp_path)
    # The good one ran twice: from the start, then from the checkpoint it paused at (its
    # second result was judged; it may have saved one more before it heard).
    assert runs[good.id][0] == 0 and len(runs[good.id]) == 2 and runs[good.id][1] >= 2, runs
    assert runs[bad.id][0] == 0 and len(runs[bad.id]) == 1, runs
    # One curve: each epoch's result once, in order, to the 4th (or to where it paused, if later).
    n = max(4, runs[good.id][1])
    curves = _curves(tmp_path / "exp")
    assert curves[good.id] == [(i, pytest.approx(0.8 * (i + 1))) for i in range(n)], curves[good.id]
    assert good.final_metric == pytest.approx(0.8 * n)


@pytest.mark.slow
def test_a_stopped_experiment_keeps_its_trials_paused_and_a_resume_continues_them_first(tmp_path: Path) -> None:
    config = _config(
        tmp_path, epochs=6, pause=0.3, first=HELD_EPOCHS, trialConcurrency=2, maxTrialNumber=2,
        searchSpace={"x": {"_type": "choice", "_value": [0.5, 1.0]}}, tuner={"name": "grid"},
    )
    exp = tmp_path / "exp"

    first = run_until_stopped(
        config, exp, lambda c: len(c.trials()) == 2 and all(t.checkpoint_step is not None for t in c.trials()),
        "the trials never saved a checkpoint", wait_s=WAIT_S,
    )
    assert not first.ok and first.reason == "stopped by the user"
    assert [t.status for t in first.trials] == [TrialStatus.PAUSED] * 2, [(t.status, t.reason) for t in first.trials]
    store = Store.in_dir(exp, readonly=True)
    try:
        assert store.experiment()["status"] == "STOPPED"  # type: ignore[index]
    finally:
        store.close()

    again = run_async(resume_experiment(exp), timeout=120)
    assert again.ok, again.reason
    assert [t.id for t in again.trials] == [t.id for t in first.trials]  # no new trial: the limit was reached
    assert {t.status for t in again.trials} == {TrialStatus.SUCCEEDED}
    runs = _runs(tmp_path)
    for t in again.trials:
        assert runs[t.id][0] == 0 and len(runs[t.id]) == 2 and runs[t.id][1] >= 1, runs
    curves = _curves(exp)
    assert {t.id: len(curves[t.id]) for t in again.trials} == {t.id: max(6, runs[t.id][1]) for t in again.trials}


@pytest.mark.slow
def test_a_trial_paused_by_the_user_ends_the_experiment_stopped_not_done(tmp_path: Path) -> None:
    config = _config(
        tmp_path, epochs=20, pause=0.2, first=HELD_EPOCHS, trialConcurrency=1, maxTrialNumber=1,
        searchSpace={"x": {"_type": "choice", "_value": [0.5]}}, tuner={"name": "grid"},
    )
    exp = tmp_path / "exp"

    async def paused() -> Any:
        started: list[Coordinator] = []
        run = asyncio.ensure_future(run_experiment(config, experiment_dir=exp, on_start=started.append))
        await async_wait_until(lambda: started, WAIT_S, message="the experiment never started")
        c = started[0]
        await async_wait_until(
            lambda: c.trials() and c.trials()[0].checkpoint_step is not None, WAIT_S,
            message="the trial never saved a checkpoint",
        )
        await c.pause(c.trials()[0].id)
        return await asyncio.wait_for(run, WAIT_S)

    result = run_async(paused, timeout=120)
    assert not result.ok
    assert result.trials[0].status is TrialStatus.PAUSED
    assert "1 trials are paused" in result.reason and "resume the experiment to continue them" in result.reason
