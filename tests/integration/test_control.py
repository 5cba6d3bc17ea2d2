"""Steering a running experiment from the command line, as a user does: `trialkeeper run` in
one process, `pause`, `continue`, `cancel` and `stop` in others, through the run's control
socket; real agents and real trials that save checkpoints; then `resume`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml
from conftest import stored_rows, wait_until, write_script
from test_cli import assert_one_line_error, tk
from trialkeeper.coordinator.cli.control import socket_path
from trialkeeper.coordinator.read.model import ExperimentSnapshot, ReadModel

WAIT_S = 60.0
RUN_EXIT_S = 90.0

# Counts steps, saving its step as a checkpoint after each, until the directory $GATES holds
# a file named by its sequence id, or "all"; then reports the step it reached. Continued, it
# says from which step, and what its checkpoint held.
TRIAL = """
import os, pathlib, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
ck = pathlib.Path(os.environ["TRIALKEEPER_CHECKPOINT_DIR"])
start = trial.checkpoint_step()
if start is not None:
    print(f"continued from {start} holding {(ck / 'state.txt').read_text()}", flush=True)
step = start or 0
gates = pathlib.Path(os.environ["GATES"])
mine, every = gates / os.environ["TRIALKEEPER_SEQUENCE_ID"], gates / "all"
deadline = time.monotonic() + 120
while not (mine.exists() or every.exists()) and time.monotonic() < deadline:
    step += 1
    trial.report_intermediate_result(step)
    (ck / "state.txt").write_text(str(step))
    trial.save_checkpoint(step)
    time.sleep(0.2)  # a step's work
trial.report_final_result(float(step))
"""


def _config(root: Path, *, trials: int = 3, **overrides: Any) -> Path:
    write_script(root, "trial.py", TRIAL)
    (root / "gates").mkdir(exist_ok=True)
    data = {
        "trialCommand": f"{sys.executable} trial.py", "trialCodeDirectory": str(root),
        "trialConcurrency": 2, "maxTrialNumber": trials, "pauseGracePeriod": 30,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4, 5, 6]}},
        "tuner": {"name": "grid"},
        "trialEnv": {"GATES": str(root / "gates")},
        "trainingService": {"platform": "local"},
        "coordinator": {"heartbeatInterval": 0.5, "agentLostTimeout": 20, "trialLostTimeout": 40},
        **overrides,
    }
    path = root / "config.yml"
    path.write_text(yaml.safe_dump(data))
    return path


class _Run(subprocess.Popen[str]):
    """A `trialkeeper` command running, its output lines collected as they come."""

    def __init__(self, *args: str | Path) -> None:
        super().__init__(
            [sys.executable, "-m", "trialkeeper.coordinator.cli", *map(str, args)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
            env={**os.environ, "COLUMNS": "200"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.stdout is not None
        for line in self.stdout:
            self.lines.append(line.rstrip("\n"))


_start = _Run


def _finish(proc: _Run, timeout: float = RUN_EXIT_S) -> tuple[int, list[str]]:
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    proc._reader.join(30)
    return proc.returncode, proc.lines


def _trials(exp: Path) -> dict[str, dict[str, Any]]:
    return {str(t["id"]): t for t in stored_rows(exp, "trials")}


def _by_seq(exp: Path) -> list[dict[str, Any]]:
    return sorted(_trials(exp).values(), key=lambda t: t["seq"])


def _status(exp: Path, trial_id: str) -> str:
    return str(_trials(exp)[trial_id]["status"])


def _experiment(exp: Path) -> ExperimentSnapshot:
    with ReadModel.open(exp) as model:
        found = model.experiment()
    assert found is not None
    return found


def test_pause_continue_cancel_and_stop_a_running_experiment_then_resume_it(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    # Two trials, two slots: a paused trial's slot stays free for it to continue in.
    run = _start("run", _config(tmp_path, trials=2), "--experiment-dir", exp, "--quiet")
    try:
        wait_until(lambda: socket_path(exp).exists(), timeout=WAIT_S, message="the control socket")
        first, second = wait_until(
            lambda: (ts := _by_seq(exp)) and len(ts) == 2 and all(t["checkpoint_step"] for t in ts) and ts,
            timeout=WAIT_S, message="two trials running, each with a checkpoint",
        )
        a, b = str(first["id"]), str(second["id"])

        paused = tk("pause", exp, a)
        assert paused.returncode == 0, paused.stderr
        assert paused.stdout.splitlines()[0] == f"asked to pause: {a}"
        wait_until(lambda: _status(exp, a) != "RUNNING", timeout=WAIT_S, message="the trial ended its run")
        assert _status(exp, a) == "PAUSED", _trials(exp)[a]
        step = int(_trials(exp)[a]["checkpoint_step"])

        # It shows as PAUSED, with its checkpoint.
        listed = tk("trials", exp, "--status", "paused", "--json")
        assert [t["id"] for t in json.loads(listed.stdout)] == [a], listed.stderr
        shown = json.loads(tk("trial", exp, a, "--json").stdout)
        assert shown["status"] == "PAUSED"
        assert [c["step"] for c in shown["checkpoints"]] == [step]
        where = Path(shown["checkpoints"][0]["where"])
        assert where == exp.resolve() / "checkpoints" / a / str(step)
        assert (where / "state.txt").read_text() == str(step)
        text = tk("trial", exp, a).stdout
        assert f"step {step}: {len(str(step))} B, saved " in text and f"in {where}" in text, text

        # What does not apply is refused by trial and state, and nothing is done.
        assert_one_line_error(
            tk("pause", exp, a, b),
            f"trial {a} is PAUSED: pause applies to a trial that is WAITING or RUNNING; nothing was done",
        )
        assert_one_line_error(
            tk("continue", exp, b, "nope"),
            f"trial {b} is RUNNING: continue applies to a trial that is PAUSED; no trial 'nope' in experiment",
        )
        assert _status(exp, b) == "RUNNING"

        # Continued, it goes on from its checkpoint.
        continued = tk("continue", exp, a)
        assert continued.returncode == 0, continued.stderr
        wait_until(
            lambda: f"continued from {step} holding {step}" in (exp / "trials" / a / "stdout.log").read_text(),
            timeout=WAIT_S, message="the trial continued from its checkpoint",
        )
        wait_until(lambda: _status(exp, a) == "RUNNING", timeout=WAIT_S)

        # Stop, by the experiment's id: the running trials pause, the run ends STOPPED.
        exp_id = _experiment(exp).id
        stopped = tk("stop", exp_id, timeout=RUN_EXIT_S)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        lines = stopped.stdout.splitlines()
        assert lines[0].startswith(f"stopping {exp_id}: trials that save checkpoints pause"), lines
        assert lines[-1] == (
            f"experiment {exp_id} STOPPED: 2 PAUSED; `trialkeeper resume {exp_id}` continues them"
        ), lines
        code, out = _finish(run)
        assert code == 1, out
        assert out[-1] == (
            "trialkeeper: experiment did not complete: stopped by the user; 2 trials paused; "
            f"`trialkeeper resume {exp.resolve()}` continues them first, then goes on with the trials not "
            "submitted yet"
        ), out[-3:]
        assert _experiment(exp).status == "STOPPED"
        at_stop = _trials(exp)
        assert {t["status"] for t in at_stop.values()} == {"PAUSED"}
        assert not socket_path(exp).exists(), "the run removed its control socket"

        # Nothing listens any more.
        assert_one_line_error(
            tk("pause", exp, a),
            f"no coordinator is running for {exp} (it ended or crashed: trialkeeper resume {exp})",
        )

        # Resumed, the paused trials go on from their checkpoints, and the experiment ends.
        run = _start("resume", exp_id, "--quiet")  # by its id, as stop's last line says
        wait_until(lambda: all(_status(exp, t) == "RUNNING" for t in (a, b)), timeout=WAIT_S,
                   message="the paused trials continued after the resume")
        (tmp_path / "gates" / "all").touch()
        code, out = _finish(run)
        assert code == 0, out
        assert [t["status"] for t in _by_seq(exp)] == ["SUCCEEDED"] * 2
        ended = _trials(exp)
        for t in (a, b):  # each counted on from the step it had saved (a fresh start reports 0)
            assert ended[t]["final_metric"] >= at_stop[t]["checkpoint_step"] > 0, (ended[t], at_stop[t])
        assert _experiment(exp).status == "DONE"
    finally:
        (tmp_path / "gates" / "all").touch()
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            _finish(run)


def test_a_killed_run_leaves_a_socket_that_says_no_coordinator_runs_and_resume_takes_it_over(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    run = _start("run", _config(tmp_path, coordinator={"heartbeatInterval": 0.5, "reconnectWindow": 30}),
                 "--experiment-dir", exp, "--quiet")
    try:
        wait_until(lambda: socket_path(exp).exists() and len(_trials(exp)) == 2, timeout=WAIT_S)
        run.kill()
        _finish(run)
        assert socket_path(exp).exists(), "a killed run cannot remove its socket"
        trial_id = str(_by_seq(exp)[0]["id"])
        assert_one_line_error(
            tk("cancel", exp, trial_id),
            f"no coordinator is running for {exp} (it ended or crashed: trialkeeper resume {exp})",
        )
        run = _start("resume", exp, "--quiet")
        wait_until(lambda: _experiment(exp).status == "RUNNING" and tk("cancel", exp, trial_id).returncode == 0,
                   timeout=WAIT_S, message="the resumed run answers on the socket")
        wait_until(lambda: _status(exp, trial_id) == "USER_CANCELED", timeout=WAIT_S)
        (tmp_path / "gates" / "all").touch()
        code, out = _finish(run)
        assert code == 0, out
        assert sorted(t["status"] for t in _trials(exp).values()) == ["SUCCEEDED", "SUCCEEDED", "USER_CANCELED"]
    finally:
        (tmp_path / "gates" / "all").touch()
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            _finish(run)


def test_resume_extends_a_finished_experiment_only_when_asked_to(tmp_path: Path) -> None:
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "all").touch()  # trials end at once
    exp = tmp_path / "exp"
    code, out = _finish(_start("run", _config(tmp_path, trials=1), "--experiment-dir", exp, "--quiet"))
    assert code == 0, out
    envs_before = stored_rows(exp, "envs")

    code, out = _finish(_start("resume", exp, "--quiet"))
    assert code == 3, out
    assert len(out) == 1 and "has ended: DONE, 1 trials (1 SUCCEEDED); nothing to resume." in out[0], out
    assert f"`trialkeeper resume {exp} --max-trials N` (N above 1) or `--max-duration D`" in out[0]
    code, out = _finish(_start("resume", exp, "--quiet", "--max-trials", "1"))
    assert code == 3 and "its maxTrialNumber (1) counts the 1 trials already submitted" in out[0], out
    assert stored_rows(exp, "envs") == envs_before, "no agent was started"

    code, out = _finish(_start("resume", exp, "--quiet", "--max-trials", "3"))
    assert code == 0, out
    assert [t["status"] for t in _by_seq(exp)] == ["SUCCEEDED"] * 3
    assert _experiment(exp).status == "DONE"

    refused = tk("resume", exp, "--max-duration", "soon")
    assert refused.returncode == 2 and "argument --max-duration: expected a duration" in refused.stderr


def test_resume_does_not_extend_an_experiment_whose_search_ran_out(tmp_path: Path) -> None:
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "all").touch()
    exp = tmp_path / "exp"
    two = {"x": {"_type": "choice", "_value": [1, 2]}}  # a grid of two: done after two trials
    code, out = _finish(_start("run", _config(tmp_path, trials=5, searchSpace=two), "--experiment-dir", exp, "--quiet"))
    assert code == 0, out
    envs_before = stored_rows(exp, "envs")
    for more in (["--max-trials", "10"], ["--max-duration", "1h"], []):
        code, out = _finish(_start("resume", exp, "--quiet", *more))
        assert code == 3, (more, out)
        assert len(out) == 1 and (
            "nothing to resume: its search had nothing more to propose (it ended below its maxTrialNumber (5)), so "
            "more trials or time would start agents with nothing to run"
        ) in out[0], (more, out)
    assert stored_rows(exp, "envs") == envs_before, "no agent was started"
    # A config that changes the search carries it on, up to its maxTrialNumber.
    wider = {"x": {"_type": "choice", "_value": [1, 2, 3, 4, 5, 6]}}
    code, out = _finish(_start("resume", exp, "--quiet", "--config", _config(tmp_path, trials=5, searchSpace=wider)))
    assert code == 0, out
    assert len(_trials(exp)) == 5 and _experiment(exp).status == "DONE"


# Waits for its gate without ever saving a checkpoint.
# Saves one checkpoint, then none: asked to pause, it is waited on for pauseGracePeriod.
SAVES_ONCE = """
import os, pathlib, time
from trialkeeper.agent import trial

trial.get_next_parameter()
(pathlib.Path(os.environ["TRIALKEEPER_CHECKPOINT_DIR"]) / "state.txt").write_text("1")
trial.save_checkpoint(1)
gates = pathlib.Path(os.environ["GATES"])
deadline = time.monotonic() + 120
while not (gates / "all").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
trial.report_final_result(1.0)
"""


def test_a_second_signal_cancels_the_trials_a_stop_waits_on(tmp_path: Path) -> None:
    write_script(tmp_path, "waits.py", SAVES_ONCE)
    config = _config(tmp_path, trialCommand=f"{sys.executable} waits.py", pauseGracePeriod=600)
    exp = tmp_path / "exp"
    run = _start("run", config, "--experiment-dir", exp, "--quiet")
    try:
        wait_until(
            lambda: [(t["status"], t["checkpoint_step"]) for t in _by_seq(exp)] == [("RUNNING", 1)] * 2,
            timeout=WAIT_S,
        )
        run.send_signal(signal.SIGINT)  # they would be waited on for pauseGracePeriod (10 min)
        wait_until(lambda: any(line.startswith("trialkeeper: stopping: ") for line in run.lines), timeout=WAIT_S)
        run.send_signal(signal.SIGINT)
        code, out = _finish(run)
    finally:
        (tmp_path / "gates" / "all").touch()
        if run.poll() is None:
            run.kill()
            _finish(run)
    assert code == 1, out
    assert "trialkeeper: canceling the trials that have not paused" in out
    assert out[-1] == (
        "trialkeeper: experiment did not complete: stopped by the user; 2 running trials canceled as SYS_CANCELED; "
        f"`trialkeeper resume {exp.resolve()}` does not run them again: it goes on with the trials not submitted yet"
    ), out[-3:]
    assert [(t["status"], t["reason"]) for t in _by_seq(exp)] == [
        ("SYS_CANCELED", "the experiment stopped: canceled by a second signal before it paused")
    ] * 2
    assert _experiment(exp).status == "STOPPED"
