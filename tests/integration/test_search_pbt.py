"""Population-based training end to end: real agents, real trial processes that checkpoint their
state, the experiment loop pausing the bottom trials and continuing them from the top trials'
checkpoints with explored parameters, which the trials read when they continue."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build_config, run_async, write_script
from experiment_stop import run_until_stopped
from s3server import S3Server, s3_server  # noqa: F401 - the fixture
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import resume_experiment, run_experiment
from trialkeeper.coordinator.store.store import Store

EPOCHS = 8
POPULATION = 4

# A model whose state grows each epoch by what its learning rate gives (best near 0.01). The
# state file says which trial's run wrote it; each run appends to runs.jsonl where it started,
# from whose state, with which learning rate.
TRIAL = """
import json, math, os, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
me = trial.get_trial_id()
here = os.environ["TRIALKEEPER_CHECKPOINT_DIR"]
start = trial.checkpoint_step() or 0
state = {{"epoch": 0, "value": 0.0, "owner": me}}
if start:
    with open(os.path.join(here, "state.json")) as f:
        state = json.load(f)
    assert state["epoch"] == start, "the checkpoint holds another epoch"
with open({log!r}, "a") as f:
    f.write(json.dumps({{"trial": me, "start": start, "from": state["owner"], "lr": p["lr"]}}) + "\\n")
state["owner"] = me
# The population trains side by side: a first run waits (60 s at most) until every trial has begun,
# so however staggered their starts, each ranking sees all of them still going.
deadline = time.monotonic() + 60
while not start and time.monotonic() < deadline:
    with open({log!r}) as f:
        if sum(json.loads(line)["start"] == 0 for line in f) >= {population}:
            break
    time.sleep(0.05)
for epoch in range(start, {epochs}):
    time.sleep(0.3)  # an epoch's work
    state["value"] += math.exp(-(math.log10(p["lr"]) + 2) ** 2)
    state["epoch"] = epoch + 1
    trial.report_intermediate_result(state["value"])
    with open(os.path.join(here, "state.json"), "w") as f:
        json.dump(state, f)
    trial.save_checkpoint(epoch + 1)
trial.report_final_result(state["value"])
"""


def _write_trial(tmp_path: Path, epochs: int) -> None:
    write_script(tmp_path, "trial.py", TRIAL.format(log=str(tmp_path / "runs.jsonl"), epochs=epochs,
                                                   population=POPULATION))


def _runs(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]


def _gain(lr: float) -> float:
    return math.exp(-((math.log10(lr) + 2) ** 2))


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["experiment directory", "object storage"])
def test_pbt_continues_bottom_trials_from_top_trials_checkpoints_with_explored_parameters(
    tmp_path: Path, storage: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_trial(tmp_path, EPOCHS)
    where: dict[str, Any] = {}
    if storage == "object storage":  # the agents write and read the bucket; the copy is read from there
        s3: S3Server = request.getfixturevalue("s3_server")
        for name, value in s3.env.items():
            monkeypatch.setenv(name, value)
        where["checkpointStorage"] = f"s3://{s3.new_bucket()}/runs"
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=4, **where,
        searchSpace={"lr": {"_type": "loguniform", "_value": [1e-5, 1.0]}},
        tuner={"name": "pbt", "classArgs": {"population_size": POPULATION, "perturbation_interval": 2, "seed": 7,
                                            "resample_probability": 0.0}},
    )
    result = run_async(run_experiment(config, experiment_dir=tmp_path / "exp"), timeout=240)
    assert result.ok, result.reason
    assert len(result.trials) == 4 and all(t.status is TrialStatus.SUCCEEDED for t in result.trials), [
        (t.id, t.status, t.reason) for t in result.trials]
    runs = _runs(tmp_path)
    first_lr = {r["trial"]: r["lr"] for r in runs if r["start"] == 0}
    exploits = [r for r in runs if r["start"] > 0 and r["from"] != r["trial"]]
    assert exploits, runs
    for r in exploits:
        donor_lr = [d["lr"] for d in runs if d["trial"] == r["from"]]
        # It read the donor's state and the donor's learning rate perturbed by 1.2 or 0.8 (or the
        # donor's own after an exploit of its own), and goes on from the donor's epoch.
        assert any(r["lr"] == pytest.approx(lr * f) for lr in donor_lr for f in (1.2, 0.8)), (r, donor_lr)
    # Each trial's final parameters are those it last ran with, and its curve is one.
    store = Store.in_dir(tmp_path / "exp", readonly=True)
    try:
        curves: dict[str, list[int]] = {}
        for m in store.metrics():
            if m.kind == "intermediate":
                curves.setdefault(m.trial_id, []).append(m.index)
    finally:
        store.close()
    for t in result.trials:
        last = [r for r in runs if r["trial"] == t.id][-1]
        assert t.parameters is not None and t.parameters["lr"] == pytest.approx(last["lr"])
        assert curves[t.id] == sorted(set(curves[t.id])), curves[t.id]
        # It trained to the end (or took the state of a trial that had just trained to the end).
        assert curves[t.id][-1] == EPOCHS - 1 or last["start"] == EPOCHS, (curves[t.id], last)
    taker = {r["trial"] for r in exploits}
    # A trial that took a better one's state ends above what its own first learning rate would reach.
    for t in result.trials:
        if t.id in taker:
            assert t.final_metric is not None and t.final_metric > _gain(first_lr[t.id]) * EPOCHS


@pytest.mark.slow
def test_a_stopped_pbt_experiment_resumes_its_population_and_goes_on_exploiting(tmp_path: Path) -> None:
    _write_trial(tmp_path, 16)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=4,
        searchSpace={"lr": {"_type": "loguniform", "_value": [1e-5, 1.0]}},
        tuner={"name": "pbt", "classArgs": {"population_size": POPULATION, "perturbation_interval": 2, "seed": 11}},
    )
    exp = tmp_path / "exp"

    first = run_until_stopped(
        config, exp, lambda c: len(c.trials()) == 4 and all((t.checkpoint_step or 0) >= 3 for t in c.trials()),
        "the trials never got to their third checkpoint",
    )
    assert not first.ok and first.reason == "stopped by the user"
    before = len(_runs(tmp_path))
    again = run_async(resume_experiment(exp), timeout=240)
    assert again.ok, again.reason
    assert sorted(t.id for t in again.trials) == sorted(t.id for t in first.trials)  # the population, no new trial
    assert {t.status for t in again.trials} == {TrialStatus.SUCCEEDED}, [(t.id, t.status, t.reason)
                                                                         for t in again.trials]
    after = _runs(tmp_path)[before:]
    # Each trial went on from its checkpoint after the resume, in the population the tuner rebuilt.
    assert {r["trial"] for r in after if r["start"] > 0} == {t.id for t in again.trials}, after
    assert all(t.final_metric is not None for t in again.trials)
