"""The live progress of an experiment: its counts and best trial are kept from the trials'
status changes, not recounted from every trial; what it shows must be what a recount says."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from conftest import build_config, run_async, write_script
from trialkeeper.coordinator.engine.model import StatusEvent, TrialInfo, TrialState
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import _Tally, run_experiment
from trialkeeper.coordinator.read.model import best_trial

WAIT_S = 120.0

TRIAL = """
from trialkeeper.agent import trial

x = trial.get_next_parameter()["x"]
trial.report_intermediate_result(x)
if x == 3:
    raise SystemExit(1)  # a failed trial is counted as one
trial.report_final_result(float(x % 3))  # equal finals: the first submitted is the best
"""


def test_the_progress_counts_and_best_are_what_a_recount_of_every_trial_says(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=3, maxTrialNumber=10,
        searchSpace={"x": {"_type": "choice", "_value": list(range(10))}}, tuner={"name": "grid"},
    )
    coordinators: list[Any] = []
    seen: list[Any] = []

    def on_progress(p: Any) -> None:
        trials = coordinators[0].trials()
        seen.append((p, Counter(t.status.value for t in trials)))

    result = run_async(run_experiment(
        config, experiment_dir=tmp_path / "exp", on_progress=on_progress, progress_interval_s=0.01,
        on_start=coordinators.append,
    ), timeout=WAIT_S)
    assert result.ok, result.reason
    assert len(seen) > 3
    for p, recount in seen:
        assert p.counts == recount  # no status with a count of 0 either
    assert all(not t.status.terminal for p, _ in seen[:-1] for t in p.trials)  # the live ones
    assert len(seen[-1][0].trials) == 10  # and at the end, every trial
    last = seen[-1][0]
    assert last.counts == {"SUCCEEDED": 9, "FAILED": 1}
    assert last.best is not None and last.best.final_metric == 2.0
    # The progress before the last kept the best from the status changes alone.
    kept = [p.best for p, _ in seen[:-1] if p.best is not None]
    assert kept and kept[-1].id == last.best.id == best_trial(result.trials, "maximize").id


def _info(tid: str, seq: int, status: TrialStatus, final: float | None = None) -> TrialInfo:
    return TrialState(tid, seq, status, {}, "python train.py", 0, 0.0, final_metric=final).info()


def test_the_tally_counts_new_trials_once_and_picks_the_first_submitted_of_equal_bests() -> None:
    tally = _Tally("minimize")
    tally.reset([_info("t0", 0, TrialStatus.SUCCEEDED, 5.0)])
    W, R, S = TrialStatus.WAITING, TrialStatus.RUNNING, TrialStatus.SUCCEEDED
    for event in [
        StatusEvent(_info("t1", 1, W), W), StatusEvent(_info("t2", 2, W), W),
    ]:
        tally.status(event)
    assert tally.counts() == {"SUCCEEDED": 1, "WAITING": 2}
    for event in [
        StatusEvent(_info("t2", 2, R), W), StatusEvent(_info("t1", 1, R), W),
        StatusEvent(_info("t2", 2, S, 3.0), R), StatusEvent(_info("t1", 1, S, 3.0), R),
    ]:
        tally.status(event)
    assert tally.counts() == {"SUCCEEDED": 3}
    assert tally.best is not None and tally.best.id == "t1"  # 3.0 beats 5.0; t1 came first
