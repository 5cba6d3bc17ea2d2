"""Store and process faults, round 2: one coordinator per experiment directory, `resume` of
an experiment that ended, and what `run` says when it is stopped.

Real processes throughout: `trialkeeper run` and `trialkeeper resume` as commands, with
local agents and trials.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import build_config, run_async, stored_rows, wait_until, write_script

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


def test_a_second_coordinator_is_refused_and_a_stop_says_what_resume_will_run(
    tmp_path: Path,
) -> None:
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
        assert f"in use by process {run.pid} (" in lines[0]
        assert f"run {_config(tmp_path)}" in lines[0]
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
        "trialkeeper: experiment did not complete: stopped by the user; 2 running trials canceled "
        f"as SYS_CANCELED; `trialkeeper resume {exp}` does not run them again: it goes on with the "
        "trials not submitted yet"
    ), lines[-3:]
    assert [t["status"] for t in stored_rows(exp, "trials")] == ["SYS_CANCELED", "SYS_CANCELED"]


def test_resume_of_an_ended_experiment_starts_nothing_and_says_how_to_extend_it(
    tmp_path: Path,
) -> None:
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
    assert "raise maxTrialNumber" in lines[0]
    assert f"trialkeeper resume {exp} --config FILE" in lines[0]
    # The same limits again: still nothing to do.
    code, lines = _finish(_cli("resume", str(exp), "--quiet", "--config", str(config)))
    assert code == 3, lines
    assert "its maxTrialNumber (2) counts the 2 trials already submitted" in lines[0]
    assert stored_rows(exp, "envs") == envs_before, "no agent was started"
    assert not list((exp / "envs").glob("env-3"))

    # A raised limit carries it on, on a new port where another process holds the one it had
    # (resumed, it listens where it did before, for agents still running to dial back).
    from trialkeeper.coordinator.store.store import Store

    old = Store.in_dir(exp, readonly=True).meta("bound_address") or ""
    host, _, port = old.rpartition(":")
    raised = _config(tmp_path, "raised.yml", maxTrialNumber=3)
    with socket.socket() as taker:
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old port's TIME_WAIT
        taker.bind((host, int(port)))
        taker.listen()
        code, lines = _finish(_cli("resume", str(exp), "--quiet", "--config", str(raised)))
    assert code == 0, lines
    assert [t["status"] for t in stored_rows(exp, "trials")] == ["SUCCEEDED"] * 3
    assert Store.in_dir(exp, readonly=True).meta("bound_address") != old


# ---- a full disk ------------------------------------------------------------------------

# Reports results (which need store writes) until it is stopped; prints nothing.
REPORTING_TRIAL = """
import os, time
from trialkeeper.agent import trial

trial.get_next_parameter()
if os.environ.get("FILL"):  # the file system its output directory is on, its stdout log's too
    try:
        with open(os.path.join(os.environ["TRIALKEEPER_OUTPUT_DIR"], "fill"), "wb") as f:
            while True:
                f.write(b"x" * (1 << 16))
                f.flush()
    except OSError:
        pass
deadline = time.monotonic() + 90
i = 0
while time.monotonic() < deadline:
    trial.report_intermediate_result(float(i))
    i += 1
    time.sleep(0.002)
"""

FULL_DISK_REASON = "the store refused a write: OperationalError: database or disk is full"


def _tmpfs_runner(mount_point: Path) -> list[str] | None:
    """A command prefix that runs a command with a 24 MiB tmpfs on ``mount_point``, in a
    mount namespace of its own (so nothing is left mounted): None where it cannot be made."""
    script = 'mount -t tmpfs -o size=24m tmpfs "$0" && exec "$@"'
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        argv = [*prefix, "sh", "-c", script, str(mount_point)]
        try:
            probe = subprocess.run([*argv, "true"], check=False, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return argv
    return None


def test_a_full_disk_ends_the_experiment_with_its_reason_last_and_no_traceback(
    tmp_path: Path,
) -> None:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    runner = _tmpfs_runner(mount_point)
    if runner is None:
        pytest.skip("no small file system to fill: mounting a tmpfs needs root or user namespaces")
    write_script(tmp_path, "fill.py", REPORTING_TRIAL)
    config = _config(
        tmp_path, trialCommand=f"{sys.executable} fill.py", maxTrialNumber=2, trialEnv={"FILL": "1"}
    )
    exp = mount_point / "exp"
    run = subprocess.Popen(
        [*runner, sys.executable, "-m", "trialkeeper.coordinator.cli", "run", str(config),
         "--experiment-dir", str(exp), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    code, lines = _finish(run, 120)
    text = "\n".join(lines)
    assert code == 1, text
    assert lines[-1] == f"trialkeeper: experiment did not complete: {FULL_DISK_REASON}", text
    for noise in ("Traceback", "--- Logging error ---", "Task exception was never retrieved"):
        assert noise not in text, text
    logged = [line.split(" ", 2)[2] for line in lines if " ERROR " in line or " WARNING " in line]
    assert len(logged) == len(set(logged)), f"an error was logged more than once: {text}"
    assert sum(FULL_DISK_REASON in line for line in logged) == 1, text


def test_a_store_that_refuses_writes_ends_the_experiment_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same end where no file system can be filled: the store's connection refuses
    every write from a moment on, as SQLite does on a full disk."""
    from trialkeeper.coordinator.experiment import run_experiment
    from trialkeeper.coordinator.store.store import Store

    full = threading.Event()

    def refusing(method: Any) -> Any:
        def call(self: Store, *args: Any, **kwargs: Any) -> Any:
            if full.is_set():
                raise sqlite3.OperationalError("database or disk is full")
            return method(self, *args, **kwargs)
        return call

    monkeypatch.setattr(Store, "transaction", refusing(Store.transaction))
    monkeypatch.setattr(Store, "_write", refusing(Store._write))
    write_script(tmp_path, "report.py", REPORTING_TRIAL)
    config = build_config(
        tmp_path, trialCommand=f"{sys.executable} report.py", maxTrialNumber=2,
        searchSpace={"x": {"_type": "choice", "_value": [1, 2]}}, tuner={"name": "grid"},
    )

    def on_progress(p: Any) -> None:
        if p.counts.get("RUNNING") == 2:
            full.set()  # the disk fills while both trials report

    caplog.set_level(logging.WARNING)
    result = run_async(run_experiment(
        config, experiment_dir=tmp_path / "exp", on_progress=on_progress, progress_interval_s=0.05
    ), timeout=WAIT_S)
    assert not result.ok
    assert result.reason == FULL_DISK_REASON
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    messages = [r.getMessage() for r in errors]
    assert len(messages) == len(set(messages)), messages
    told = [m for m in messages if FULL_DISK_REASON in m]
    assert told == [f"the experiment cannot go on: {FULL_DISK_REASON}"], messages
    assert not any(r.exc_info for r in errors), "no traceback for a full disk"
    assert not any("never retrieved" in m for m in messages), messages
