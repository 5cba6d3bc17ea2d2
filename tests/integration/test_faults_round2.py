"""Store and process faults, round 2: one coordinator per experiment directory, `resume` of
an experiment that ended, and what `run` says when it is stopped.

Real processes throughout: `trialkeeper run` and `trialkeeper resume` as commands, with
local agents and trials.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import stored_rows, wait_until, write_script

WAIT_S = 60.0

# Runs until the test creates the gate file (or for 90 s at most).
GATED_TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
deadline = time.monotonic() + 90
while not pathlib.Path(os.environ["GATE"]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
trial.report_final_result(p["x"])
"""


def _config(tmp_path: Path, name: str = "config.yml", **overrides: Any) -> Path:
    write_script(tmp_path, "trial.py", GATED_TRIAL)
    cfg = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": str(tmp_path),
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4, 5, 6]}},
        "tuner": {"name": "grid"},
        "trialEnv": {"GATE": str(tmp_path / "gate")},
        "trainingService": {"platform": "local"},
        **overrides,
    }
    path = tmp_path / name
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trialkeeper.coordinator.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = WAIT_S) -> tuple[int, list[str]]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"{proc.args} did not end within {timeout} s: {out[-2000:]}") from None
    return proc.returncode, [line for line in out.splitlines() if line.strip()]


def test_a_second_coordinator_is_refused_and_a_stop_says_what_resume_will_run(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    run = _cli("run", str(_config(tmp_path)), "--experiment-dir", str(exp), "--quiet")
    try:
        wait_until(
            lambda: [t["status"] for t in stored_rows(exp, "trials")] == ["RUNNING", "RUNNING"],
            WAIT_S, message="two trials running",
        )
        # A second coordinator on the directory: refused at once, in one line naming the first.
        code, lines = _finish(_cli("resume", str(exp), "--quiet"))
        assert code == 1, lines
        assert len(lines) == 1, lines
        assert f"in use by process {run.pid} (" in lines[0] and f"run {_config(tmp_path)}" in lines[0]
        envs = {e["id"] for e in stored_rows(exp, "envs")}
        assert envs == {"env-1", "env-2"}, "the refused coordinator started no environment"

        run.send_signal(signal.SIGTERM)
        code, lines = _finish(run)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate(timeout=30)
    assert code == 1
    # The reason is the last line, and it says what a resume will (not) run.
    assert lines[-1] == (
        "trialkeeper: experiment did not complete: stopped by the user; 2 running trials canceled as "
        f"SYS_CANCELED; `trialkeeper resume {exp}` does not run them again: it goes on with the "
        "trials not submitted yet"
    ), lines[-3:]
    assert [t["status"] for t in stored_rows(exp, "trials")] == ["SYS_CANCELED", "SYS_CANCELED"]


def test_resume_of_an_ended_experiment_starts_nothing_and_says_how_to_extend_it(tmp_path: Path) -> None:
    (tmp_path / "gate").touch()  # trials end at once
    exp = tmp_path / "exp"
    config = _config(tmp_path, maxTrialNumber=2)
    code, lines = _finish(_cli("run", str(config), "--experiment-dir", str(exp), "--quiet"))
    assert code == 0, lines
    envs_before = stored_rows(exp, "envs")

    code, lines = _finish(_cli("resume", str(exp), "--quiet"))
    assert code == 3, lines
    assert len(lines) == 1, lines
    assert "has ended: DONE, 2 trials (2 SUCCEEDED); nothing to resume." in lines[0]
    assert "raise maxTrialNumber" in lines[0] and f"trialkeeper resume {exp} --config FILE" in lines[0]
    # The same limits again: still nothing to do.
    code, lines = _finish(_cli("resume", str(exp), "--quiet", "--config", str(config)))
    assert code == 3, lines
    assert "its maxTrialNumber (2) counts the 2 trials already submitted" in lines[0]
    assert stored_rows(exp, "envs") == envs_before, "no agent was started"
    assert not list((exp / "envs").glob("env-3"))

    # A raised limit carries it on.
    raised = _config(tmp_path, "raised.yml", maxTrialNumber=3)
    code, lines = _finish(_cli("resume", str(exp), "--quiet", "--config", str(raised)))
    assert code == 0, lines
    assert [t["status"] for t in stored_rows(exp, "trials")] == ["SUCCEEDED"] * 3
