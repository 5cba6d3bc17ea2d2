"""maxExperimentDuration ends an experiment: running trials are stopped, the reason kept."""

from __future__ import annotations

from pathlib import Path

from conftest import build_config, run_async, write_script
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import run_experiment
from trialkeeper.coordinator.store.store import Store

# Runs until the experiment stops it (or 60 s pass).
FOREVER = """
import time
from trialkeeper.agent import trial
trial.get_next_parameter()
trial.report_intermediate_result(1.0)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_max_experiment_duration_stops_running_trials(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", FOREVER)
    config = build_config(
        # Long enough for a trial to start and report on a loaded machine.
        tmp_path, trialConcurrency=2, maxTrialNumber=10, maxExperimentDuration="8s",
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}},
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=60)
    assert result.reason == "maxExperimentDuration (8 s) reached"
    assert result.trials and all(t.status.terminal for t in result.trials)
    assert {t.status for t in result.trials} == {TrialStatus.SYS_CANCELED}
    store = Store.in_dir(tmp_path / "exp", readonly=True)
    try:
        exp = store.experiment()
        assert exp is not None and exp["reason"] == "maxExperimentDuration (8 s) reached"
        # What the trials reported before the end is kept.
        assert any(store.metrics(t.id) for t in result.trials)
    finally:
        store.close()
