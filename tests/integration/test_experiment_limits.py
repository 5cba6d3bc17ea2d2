"""maxExperimentDuration ends an experiment: running trials are stopped, the reason kept."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import async_wait_until, build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import ExperimentResult, run_experiment
from trialkeeper.coordinator.search.steering import Steering
from trialkeeper.coordinator.store.store import Store

WAIT_S = 60.0

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
        tmp_path, trialConcurrency=2, maxTrialNumber=10, maxExperimentDuration="10m",
        searchSpace={"x": {"_type": "uniform", "_value": [0, 1]}},
    )
    exp = tmp_path / "exp"

    async def cut_short() -> ExperimentResult:
        # Once both trials run and reported, the duration is cut to one second, long past by then
        # (as `trialkeeper update --max-duration` does): however slow the start, it ends there.
        steering = Steering()
        started: list[Coordinator] = []
        run = asyncio.ensure_future(run_experiment(config, experiment_dir=exp, steering=steering,
                                                   on_start=started.append))
        await async_wait_until(lambda: started, WAIT_S, message="the experiment never started")
        c = started[0]
        assert c.store is not None
        await async_wait_until(
            lambda: len(c.trials()) == 2 and all(c.store.metrics(t.id) for t in c.trials()),  # type: ignore[union-attr]
            WAIT_S, message="two trials never reported",
        )
        await steering.update(max_experiment_duration=1.0)
        return await asyncio.wait_for(run, WAIT_S)

    result = run_async(cut_short, timeout=3 * WAIT_S)
    assert result.reason == "maxExperimentDuration (1 s) reached"
    assert len(result.trials) == 2  # no new trial once the time was up
    assert {t.status for t in result.trials} == {TrialStatus.SYS_CANCELED}
    store = Store.in_dir(exp, readonly=True)
    try:
        stored = store.experiment()
        assert stored is not None and stored["reason"] == "maxExperimentDuration (1 s) reached"
        # What the trials reported before the end is kept.
        assert all(store.metrics(t.id) for t in result.trials)
    finally:
        store.close()
