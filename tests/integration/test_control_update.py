"""Controlling a running experiment as NNI users do, from other processes: `trialkeeper run
--detach` starts it in the background, `update` changes its concurrency and limits live,
`submit` and `rerun` add trials that its tuner hears of, `view` serves its dashboard by id,
and each says plainly when the experiment is not running. Real agents, real trials."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import build_config, pid_gone, stored_rows, wait_until, write_script
from test_cli import assert_one_line_error, tk
from test_control import _finish, _Run
from trialkeeper.coordinator.core import UPDATED_META, Coordinator
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.store.reads import StoreReader
from trialkeeper.coordinator.sync import SyncCoordinator

WAIT_S = 60.0
STOP_S = 120.0

# Waits for a gate file named by its sequence id (or "all"); a gate that says "fail" fails it,
# otherwise it reports x as its final result.
TRIAL = """
import os, pathlib, sys, time
from trialkeeper.agent import trial

p = trial.get_next_parameter()
gates = pathlib.Path(os.environ["GATES"])
mine, every = gates / os.environ["TRIALKEEPER_SEQUENCE_ID"], gates / "all"
deadline = time.monotonic() + 120
while not (mine.exists() or every.exists()) and time.monotonic() < deadline:
    time.sleep(0.05)
if mine.exists() and mine.read_text() == "fail":
    sys.exit("RuntimeError: told to fail")
trial.report_final_result(float(p["x"]))
"""

# Proposes x = 1, 2, 3, ... and writes down each result it hears, with its parameters.
TUNER = """
import json
from trialkeeper.coordinator.search.tuners import Tuner

class Recorder(Tuner):
    def __init__(self, search_space, heard):
        super().__init__(search_space)
        self.heard = heard

    def generate_parameters(self, parameter_id):
        return {"x": parameter_id + 1}

    def receive_trial_result(self, parameter_id, parameters, value):
        with open(self.heard, "a") as f:
            f.write(json.dumps({"id": parameter_id, "parameters": parameters, "value": value}) + "\\n")
"""


def _config(root: Path) -> Path:
    write_script(root, "trial.py", TRIAL)
    write_script(root, "recorder.py", TUNER)
    (root / "gates").mkdir(exist_ok=True)
    data = {
        "trialCommand": f"{sys.executable} trial.py", "trialCodeDirectory": str(root),
        "trialConcurrency": 1, "maxTrialNumber": 3,
        "searchSpace": {"x": {"_type": "choice", "_value": list(range(1, 10))}},
        "tuner": {"className": "recorder:Recorder", "codeDirectory": str(root),
                  "classArgs": {"heard": str(root / "heard.jsonl")}},
        "trialEnv": {"GATES": str(root / "gates")},
        "trainingService": {"platform": "local"},
        "coordinator": {"heartbeatInterval": 0.5},
    }
    path = root / "config.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def _open_gate(root: Path, seq: int, say: str = "") -> None:
    tmp = root / "gates" / f".{seq}"
    tmp.write_text(say)
    tmp.rename(root / "gates" / str(seq))  # whole at once: the trial never reads it half written


def _by_seq(exp: Path) -> list[dict[str, Any]]:
    return sorted(stored_rows(exp, "trials"), key=lambda t: t["seq"])


def _statuses(exp: Path) -> list[str]:
    return [str(t["status"]) for t in _by_seq(exp)]


def _heard(root: Path) -> list[dict[str, Any]]:
    path = root / "heard.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_detached_run_is_updated_given_trials_and_viewed_by_id_then_stopped(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    started = tk("run", _config(tmp_path), "--detach", "--experiment-dir", exp, timeout=STOP_S)
    assert started.returncode == 0, started.stdout + started.stderr
    lines = started.stdout.splitlines()
    pid = int(lines[0].rsplit("(pid ", 1)[1].rstrip(")"))
    exp_id = lines[0].split()[1]
    try:
        assert lines[1] == f"experiment directory: {exp.resolve()}", lines
        assert f"`trialkeeper stop {exp_id}` stops it" in lines[-1], lines
        assert not pid_gone(pid), "the run goes on in the background"
        listed = json.loads(tk("list", "--json").stdout)
        assert any(e.get("id") == exp_id for e in listed), "known by its id as soon as run returns"
        wait_until(lambda: _statuses(exp) == ["RUNNING"], timeout=WAIT_S, message="the first trial running")

        # Invalid values are refused with the field and what is valid; nothing changes.
        refused = tk("update", exp_id, "--concurrency", "0")
        assert refused.returncode == 2
        assert "'0' is not valid for trialConcurrency: an integer >= 1 is needed" in refused.stderr
        refused = tk("update", exp_id, "--max-duration", "soon")
        assert refused.returncode == 2 and "is not valid for maxExperimentDuration" in refused.stderr
        assert_one_line_error(tk("update", exp_id), "nothing to update: give --concurrency")

        # More concurrency and trials, live: the waiting capacity is used at once.
        updated = tk("update", exp_id, "--concurrency", "3", "--max-trials", "6", "--max-duration", "2h")
        assert updated.returncode == 0, updated.stderr
        assert updated.stdout.strip() == (
            f"updated {exp_id}: trialConcurrency 3, maxTrialNumber 6 (1 submitted), maxExperimentDuration 7200 s"
        )
        wait_until(lambda: _statuses(exp) == ["RUNNING"] * 3, timeout=WAIT_S, message="three trials running")
        store = StoreReader.in_dir(exp)
        try:
            kept = json.loads(store.meta(UPDATED_META) or "{}")
        finally:
            store.close()
        assert kept == {"trial_concurrency": 3, "max_trial_number": 6, "max_experiment_duration": 7200.0}

        # A trial of the user's own parameters; names outside the search space are refused.
        assert_one_line_error(
            tk("submit", exp_id, "--params", '{"y": 1}'),
            "parameters: 'y' not in the search space; 'x' missing (the search space has x)",
        )
        assert_one_line_error(tk("submit", exp_id, "--params", "{x"), "--params: not JSON")
        submitted = tk("submit", exp_id, "--params", '{"x": 9}')
        assert submitted.returncode == 0, submitted.stderr
        mine = submitted.stdout.split()[-1]
        rows = {t["id"]: t for t in stored_rows(exp, "trials")}
        assert json.loads(rows[mine]["parameters_json"]) == {"x": 9} and rows[mine]["seq"] == 3
        assert rows[mine]["status"] == "WAITING", "three trials run: it waits for a slot"

        # A failed trial runs again with its parameters, as a new trial.
        assert_one_line_error(tk("rerun", exp_id, "--failed"), f"no trial of experiment {exp_id} is FAILED")
        _open_gate(tmp_path, 0, "fail")
        first = str(_by_seq(exp)[0]["id"])
        wait_until(lambda: _statuses(exp)[:4] == ["FAILED", "RUNNING", "RUNNING", "RUNNING"], timeout=WAIT_S,
                   message="the submitted trial took the failed one's slot")

        # Its result reaches the tuner as any trial's; the tuner proposes the next one.
        _open_gate(tmp_path, 3)
        wait_until(lambda: any(h["parameters"] == {"x": 9} for h in _heard(tmp_path)), timeout=WAIT_S,
                   message="the tuner heard the submitted trial's result")
        assert [h for h in _heard(tmp_path) if h["parameters"] == {"x": 9}] == [
            {"id": 3, "parameters": {"x": 9}, "value": 9.0}
        ]
        wait_until(lambda: len(_by_seq(exp)) == 5, timeout=WAIT_S, message="the tuner's next trial")

        rerun = tk("rerun", exp_id, "--failed")
        assert rerun.returncode == 0, rerun.stderr
        again = rerun.stdout.split()[-1]
        assert rerun.stdout.strip() == f"trial {first} runs again as trial {again}"
        rows = {t["id"]: t for t in stored_rows(exp, "trials")}
        assert json.loads(rows[again]["parameters_json"]) == json.loads(rows[first]["parameters_json"]) == {"x": 1}
        assert rows[again]["seq"] == 5
        assert_one_line_error(tk("rerun", exp_id, "nope"), f"no trial 'nope' in experiment {exp_id}; nothing was done")
        assert_one_line_error(tk("rerun", exp_id), "name the trials to run again, or give --failed")

        # The limit counts them: past it, a trial is refused with how to raise it.
        assert_one_line_error(
            tk("submit", exp_id, "--params", '{"x": 8}'),
            "maxTrialNumber (6) is reached: raise it first (trialkeeper update EXP --max-trials 7)",
        )

        # The dashboard of the experiment, by its id.
        view = _Run("view", exp_id, "--address", "127.0.0.1:0")
        try:
            said = wait_until(lambda: [line for line in view.lines if line.startswith("dashboard: ")], timeout=WAIT_S,
                              message="the dashboard's address")[0]
            assert said.startswith("dashboard: http://127.0.0.1:"), said
            with urllib.request.urlopen(said.split(" ", 1)[1], timeout=30) as page:
                assert page.status == 200
        finally:
            view.send_signal(signal.SIGINT)
            _finish(view, 30)

        stopped = tk("stop", exp_id, "--timeout", str(STOP_S), timeout=STOP_S + 30)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        wait_until(lambda: pid_gone(pid), timeout=WAIT_S, message="the detached run ended")
    finally:
        (tmp_path / "gates" / "all").touch()
        if not pid_gone(pid):
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: pid_gone(pid), timeout=STOP_S, message="the detached run ended after SIGTERM")

    # Not running any more: each command says so.
    gone = f"no coordinator is running for {exp_id} (it ended or crashed: trialkeeper resume {exp_id})"
    for args in (["update", exp_id, "--concurrency", "2"], ["submit", exp_id, "--params", '{"x": 1}'],
                 ["rerun", exp_id, "--failed"]):
        assert_one_line_error(tk(*args), gone)
    # A resume keeps the limits the update set.
    config = Coordinator.resume(exp).config
    assert (config.trial_concurrency, config.max_trial_number, config.max_experiment_duration) == (3, 6, 7200.0)
    with ReadModel.open(exp) as model:
        snapshot = model.experiment()
    assert snapshot is not None and snapshot.status == "STOPPED"
    assert "experiment directory" in (exp / "experiment.log").read_text(), "the run's output went to its log"

    # `resume --detach` carries it on in the background, as `run --detach` started it.
    (tmp_path / "gates" / "all").unlink()
    resumed = tk("resume", exp, "--detach", "--max-trials", "7", timeout=STOP_S)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    lines = resumed.stdout.splitlines()
    assert lines[0].startswith(f"experiment {exp_id} runs in the background (pid "), lines
    assert lines[1] == f"experiment directory: {exp.resolve()}", lines
    pid = int(lines[0].rsplit("(pid ", 1)[1].rstrip(")"))
    try:
        assert_one_line_error(tk("resume", exp, "--detach"), f"experiment {exp_id} is running already")
        wait_until(lambda: "RUNNING" in _statuses(exp), timeout=WAIT_S, message="a trial runs in the resumed run")
        assert len(_by_seq(exp)) == 7
        stopped = tk("stop", exp_id, "--timeout", str(STOP_S), timeout=STOP_S + 30)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        wait_until(lambda: pid_gone(pid), timeout=WAIT_S, message="the resumed run ended")
    finally:
        (tmp_path / "gates" / "all").touch()
        if not pid_gone(pid):
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: pid_gone(pid), timeout=STOP_S, message="the resumed run ended after SIGTERM")


def test_a_detached_run_whose_config_is_wrong_says_so_and_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"trialCommand": "true", "trialConcurrency": 0}))
    refused = tk("run", bad, "--detach", "--experiment-dir", tmp_path / "exp")
    assert refused.returncode == 2
    assert "trialConcurrency" in refused.stderr, refused.stderr
    assert not (tmp_path / "exp").exists(), "nothing was started"

    # A tuner the run would refuse at start is refused before the run's directory is made.
    bad.write_text(yaml.safe_dump({"trialCommand": "true", "trialConcurrency": 1, "tuner": {"name": "randm"},
                                   "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
                                   "trainingService": {"platform": "local"}}))
    refused = tk("run", bad, "--detach", "--experiment-dir", tmp_path / "exp")
    assert refused.returncode == 2
    assert_one_line_error(refused, f"invalid config {bad}: tuner: unknown tuner 'randm'; did you mean 'random'?")
    assert not (tmp_path / "exp").exists(), "nothing was started"


def test_a_detached_run_that_cannot_start_says_why_with_its_output(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        refused = tk("run", _config(tmp_path), "--detach", "--experiment-dir", tmp_path / "exp",
                     "--ui", f"127.0.0.1:{port}", timeout=STOP_S)
    finally:
        taken.close()
    assert refused.returncode == 2, refused.stdout + refused.stderr  # the run's own exit status
    said = refused.stderr.strip().splitlines()
    assert said[-1].startswith("trialkeeper: the run ended at once (exit code 2); its output is in "), said
    assert f"trialkeeper: the dashboard cannot listen on 127.0.0.1:{port}: " in said[-2], "the run's own words first"
    assert not stored_rows(tmp_path / "exp", "trials")


def test_the_embedding_api_updates_the_concurrency_of_a_running_coordinator(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", TRIAL)
    (tmp_path / "gates").mkdir()
    config = build_config(tmp_path, trialCommand=f"{sys.executable} trial.py", trialConcurrency=1,
                          trialEnv={"GATES": str(tmp_path / "gates")})
    with SyncCoordinator(config) as c:
        try:
            handles = [c.submit({"x": x}) for x in (1, 2, 3)]
            wait_until(lambda: [h.info.status.value for h in handles] == ["RUNNING", "WAITING", "WAITING"],
                       timeout=WAIT_S)
            for wrong in ({"trial_concurrency": 0}, {"max_trial_number": True}, {"trial_gpu_number": 1}):
                with pytest.raises(ValueError, match="only trial_concurrency, max_trial_number, max_experiment_dur"):
                    c.update(**wrong)
            c.update(trial_concurrency=3)
            wait_until(lambda: all(h.info.status.value == "RUNNING" for h in handles), timeout=WAIT_S,
                       message="the waiting trials started once the concurrency was raised")
            assert c.coordinator.config.trial_concurrency == 3
        finally:
            (tmp_path / "gates" / "all").touch()
        assert [h.wait(WAIT_S).final_metric for h in handles] == [1.0, 2.0, 3.0]
