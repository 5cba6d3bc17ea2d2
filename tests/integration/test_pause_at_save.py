"""A pause the search decides at a save lands at that save, end to end: real agents, real
trial processes that save right after each result and go straight on, the experiment loop
carrying out what the assessor asks. The ack that answers a trial's save_checkpoint waits for
the search's pass over that save, so the pause reaches the agent first, every time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import run_experiment
from trialkeeper.coordinator.store.store import Store

TRIALS = 4
WAIT_S = 120.0

# No time between a result, its save and the next result: a pause that reaches the agent after
# the save's ack lands one epoch late.
TRIAL = """
from trialkeeper.agent import trial

p = trial.get_next_parameter()
for epoch in range(6):
    trial.report_intermediate_result(p["x"] * (epoch + 1))
    trial.save_checkpoint(epoch + 1)
trial.report_final_result(p["x"] * 6)
"""

# Pauses a trial when it hears its first save (as ASHA asks at a rung), or on its first result
# (a rung's verdict on a result the save follows); continues none.
HOOKS = """
from trialkeeper.coordinator.search.assessors import Assessor, Verdict

class AtSave(Assessor):
    def decide(self, trial_id, history):
        return Verdict.CONTINUE

    def trial_checkpointed(self, trial_id):
        self.request_pause(trial_id, "paused at its first save")

class AtResult(Assessor):
    def decide(self, trial_id, history):
        return Verdict.PAUSE if len(history) == 1 else Verdict.CONTINUE
"""

# A tuner that pauses a trial on its first result (as PBT does on the results it ranks).
TUNER = """
from trialkeeper.coordinator.search.tuners import Tuner

class TunerAtResult(Tuner):
    def generate_parameters(self, parameter_id):
        return {"x": 0.1 * (parameter_id + 1)}

    def receive_intermediate_result(self, parameter_id, step, value):
        if step == 0:
            self.request_pause(parameter_id, "paused on its first result")
"""


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["AtSave", "AtResult", "TunerAtResult"])
def test_a_pause_decided_at_a_save_lands_at_that_save_every_time(tmp_path: Path, hook: str) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    write_script(tmp_path, "hooks.py", HOOKS + TUNER)
    own = {"className": f"hooks:{hook}", "codeDirectory": str(tmp_path)}
    search: dict[str, Any] = {"tuner": own}
    if hook != "TunerAtResult":
        search = {"tuner": {"name": "random"}, "assessor": own}
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=2, maxTrialNumber=TRIALS,
        searchSpace={"x": {"_type": "uniform", "_value": [0.0, 1.0]}}, **search,
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=240)
    assert result.ok, result.reason
    assert len(result.trials) == TRIALS
    for t in result.trials:  # paused by the search, never continued: given up at the end
        assert t.status is TrialStatus.EARLY_STOPPED, (t.id, t.status, t.reason)
    store = Store.in_dir(tmp_path / "exp", readonly=True)
    try:
        paused = {e["entity_id"]: e["reason"] for e in store.events()
                  if e["entity"] == "trial" and e["new"] == "PAUSED"}
        results: dict[str, int] = {}
        for m in store.metrics():
            if m.kind == "intermediate":
                results[m.trial_id] = results.get(m.trial_id, 0) + 1
    finally:
        store.close()
    # Each trial ended at its first save, with only the result before it reported.
    assert sorted(paused) == sorted(t.id for t in result.trials), paused
    late = {tid: why for tid, why in paused.items() if not why.endswith("continues from step 1")}
    assert late == {}, late
    assert results == {t.id: 1 for t in result.trials}, results


# Saves three times, writing how long each save_checkpoint took to be answered.
TIMED = """
import time
from trialkeeper.agent import trial

for step in (1, 2, 3):
    trial.report_intermediate_result(step)
    began = time.monotonic()
    trial.save_checkpoint(step)
    with open({log!r}, "a") as f:
        f.write(f"{{time.monotonic() - began}}\\n")
"""


@pytest.mark.slow
def test_a_held_save_is_answered_at_its_deadline_when_no_one_says_it_was_heard(tmp_path: Path) -> None:
    log = tmp_path / "saves.log"
    write_script(tmp_path, "trial.py", TIMED.format(log=str(log)))
    config = build_config(tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=1)
    heard: list[int] = []

    async def body() -> Any:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            for bad in (0, -1, 61):
                with pytest.raises(ValueError, match="hold_s must be more than 0 and at most 60 seconds"):
                    c.hold_saves(bad)
            c.on_checkpoint(lambda e: heard.append(e.step))
            c.hold_saves(1.0)  # and saves_heard() is never called
            handle = await c.submit({})
            return await handle.wait(WAIT_S)

    info = run_async(body, timeout=2 * WAIT_S)
    assert info.status is TrialStatus.SUCCEEDED, (info.status, info.reason)
    assert heard == [1, 2, 3]
    waits = [float(w) for w in log.read_text().split()]
    # Each save was held until its deadline, and then answered: the trial went on.
    assert len(waits) == 3 and min(waits) >= 0.9, waits
