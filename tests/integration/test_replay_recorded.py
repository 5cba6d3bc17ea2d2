"""Replay end to end: an experiment recorded by a real coordinator with real agents and trial
processes, then replayed by `trialkeeper replay`: its own search makes the same decisions at
the same steps; another search follows the recorded curves (the nearest one for a
configuration never run, or none with --unseen skip)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build_config, run_async, write_script
from trialkeeper.coordinator.cli.app import main
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.experiment import run_experiment
from trialkeeper.coordinator.store.store import Store

# A curve that rises towards x, the faster the larger x; the last result is the final one.
CURVE = """
import time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
value = 0.0
for step in range(6):
    time.sleep(0.05)
    value = p["x"] * (1 - 0.6 ** (step + 1))
    trial.report_intermediate_result(value)
trial.report_final_result(value)
"""


def _record(tmp_path: Path, **search: Any) -> Path:
    write_script(tmp_path, "trial.py", CURVE)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=1, maxTrialNumber=10,
        searchSpace={"x": {"_type": "uniform", "_value": [0.0, 1.0]}}, **search,
    )
    result = run_async(run_experiment(config), timeout=180)
    assert result.ok, result.reason
    return result.experiment_dir


def _replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["replay", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _stored(exp: Path) -> list[dict[str, Any]]:
    store = Store.in_dir(exp, readonly=True)
    try:
        return store.trials()
    finally:
        store.close()


@pytest.mark.slow
def test_replaying_an_experiments_own_search_makes_its_decisions_at_the_same_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = _record(tmp_path, tuner={"name": "random", "classArgs": {"seed": 7}},
                  assessor={"name": "median", "classArgs": {"start_step": 2}})
    recorded = _stored(exp)
    stopped = [r for r in recorded if r["status"] == TrialStatus.EARLY_STOPPED.value]
    assert stopped and len(stopped) < len(recorded)  # the search made decisions both ways

    got = _replay(capsys, str(exp))
    replayed = sorted(got["trials"], key=lambda t: t["parameter_id"])
    assert len(replayed) == len(recorded) and all(t["exact"] for t in replayed)
    assert [(t["parameters"], t["status"], t["reason"]) for t in replayed] == [
        (json.loads(r["parameters_json"]), r["status"], r["reason"] or "") for r in recorded
    ]
    # Each stop at the step the recorded one was decided at (its reason says after how many results).
    steps = {d["trial_id"]: d["step"] for d in got["decisions"] if d["kind"] == "stop"}
    by_seq = {t["parameter_id"]: t["trial_id"] for t in replayed}
    assert {by_seq[r["seq"]]: int(re.search(r"after (\d+) intermediate", r["reason"])[1]) for r in stopped} == steps
    best = max(r["final_metric"] for r in recorded if r["final_metric"] is not None)
    assert got["best"]["value"] == pytest.approx(best) and got["gap"] == pytest.approx(0.0)


@pytest.mark.slow
def test_another_search_follows_the_nearest_recorded_curve_or_skips_what_was_never_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exp = _record(tmp_path, tuner={"name": "random", "classArgs": {"seed": 3}})
    recorded = {r["id"]: r for r in _stored(exp)}
    other = tmp_path / "other.yml"
    other.write_text(
        "searchSpace:\n  x: {_type: choice, _value: [0.05, 0.5, 0.95]}\n"
        "tuner: {name: grid}\nassessor: {name: median}\ntrialConcurrency: 2\n"
    )
    got = _replay(capsys, str(exp), "--config", str(other))
    trials = got["trials"]
    assert sorted(t["parameters"]["x"] for t in trials) == [0.05, 0.5, 0.95]
    assert got["nearest"] == 3 and got["skipped"] == 0 and not any(t["exact"] for t in trials)
    xs = {rid: json.loads(r["parameters_json"])["x"] for rid, r in recorded.items()}
    for t in trials:  # the recorded trial nearest to it, and its curve's final result
        nearest = min(xs, key=lambda rid: abs(xs[rid] - t["parameters"]["x"]))
        assert t["drawn_from"] == nearest
        if t["status"] == "SUCCEEDED":
            assert t["final"] == pytest.approx(recorded[nearest]["final_metric"])

    skipped = _replay(capsys, str(exp), "--config", str(other), "--unseen", "skip")
    assert skipped["skipped"] == 3 and skipped["best"] is None
    assert all(t["status"] == "FAILED" and "never ran" in t["reason"] for t in skipped["trials"])

    capsys.readouterr()
    assert main(["replay", str(exp), "--config", str(other)]) == 0
    text = capsys.readouterr().out
    assert "replayed 3 trials against 10 recorded ones" in text and "3 followed the nearest" in text

    bad = tmp_path / "bad.yml"
    bad.write_text("tuner: {name: nosuchtuner}\n")
    assert main(["replay", str(exp), "--config", str(bad)]) == 2
    assert "unknown tuner 'nosuchtuner'" in capsys.readouterr().err


# Saves a checkpoint after each result, and goes on from it when continued. A trial reaches
# its first rung before any save: ASHA judges it when that save is heard, and the pause lands
# at that save, as replayed (the save is answered once the search has had its pass over it,
# so the pause reaches the trial first); a later rung's verdict on a result lands at the save
# that follows it.
CHECKPOINTING = """
import json, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
ckpt = pathlib.Path(trial.get_checkpoint_dir())
start = json.loads((ckpt / "state.json").read_text())["step"] if trial.checkpoint_step() is not None else 0
value = 0.0
for step in range(start, 6):
    time.sleep(0.05)
    value = p["x"] * (1 - 0.6 ** (step + 1))
    trial.report_intermediate_result(value)
    (ckpt / "state.json").write_text(json.dumps({"step": step + 1}))
    trial.save_checkpoint(step + 1)
trial.report_final_result(value)
"""


@pytest.mark.slow
def test_replaying_asha_pauses_and_continues_the_same_trials_at_the_same_rungs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_script(tmp_path, "trial.py", CHECKPOINTING)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=1, maxTrialNumber=10,
        searchSpace={"x": {"_type": "uniform", "_value": [0.0, 1.0]}},
        tuner={"name": "random", "classArgs": {"seed": 6}},
        assessor={"name": "asha", "classArgs": {"min_resource": 1, "max_resource": 6, "reduction_factor": 2}},
    )
    result = run_async(run_experiment(config), timeout=240)
    assert result.ok, result.reason
    store = Store.in_dir(result.experiment_dir, readonly=True)
    try:
        seq = {t["id"]: t["seq"] for t in store.trials()}
        events = [e for e in store.events() if e["entity"] == "trial"]
    finally:
        store.close()
    # Per trial (by submission), the steps it was paused at, and how often it was continued.
    recorded: dict[int, list[Any]] = {}
    for e in events:
        mine = recorded.setdefault(seq[e["entity_id"]], [])
        if e["new"] == "PAUSED":
            # The assessor's verdict at a result, or ASHA's own request on hearing a save at a
            # rung (its resource, epochs here): either way the results the trial had reported.
            at = re.search(r"after (\d+) intermediate|waits at rung (\d+)", e["reason"])
            assert at is not None, e["reason"]
            mine.append(("pause", int(at[1] or at[2])))
        elif e["old"] == "PAUSED" and e["new"] != "EARLY_STOPPED":
            mine.append(("continue",))
        elif e["new"] in ("SUCCEEDED", "EARLY_STOPPED"):
            mine.append((e["new"],))
    assert any(("continue",) in d for d in recorded.values())  # the rungs promoted paused trials

    got = _replay(capsys, str(result.experiment_dir))
    replayed: dict[int, list[Any]] = {}
    number = {t["trial_id"]: t["parameter_id"] for t in got["trials"]}
    for d in got["decisions"]:
        replayed.setdefault(number[d["trial_id"]], []).append((d["kind"], d["step"]) if d["kind"] == "pause"
                                                              else (d["kind"],))
    for t in got["trials"]:
        replayed.setdefault(t["parameter_id"], []).append((t["status"],))
    assert replayed == recorded
