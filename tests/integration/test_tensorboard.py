"""`trialkeeper tensorboard`: its log directory of one run per trial, what it says of trials
whose output is elsewhere or when TensorBoard is missing, and real TensorBoard serving the
event files that a real experiment's trials wrote.

The TensorBoard test needs `tensorboard` (in the dev extra); without it the test skips with the
command that installs it, and in CI (``CI`` set) it fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from conftest import wait_until, write_script
from dashboard import HTTP_TIMEOUT_S, first_line, many_trials, tk_bare
from test_cli import RUN_TIMEOUT_S, _script, tk
from trialkeeper.coordinator.read.model import ReadModel
from trialkeeper.coordinator.store import index
from trialkeeper.coordinator.store.store import MetricRow, Store

START_TIMEOUT_S = 60.0
LISTED_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
URL = re.compile(r"TensorBoard \S+ at (http://\S+?)/? ")

# A trial that writes a TensorBoard event file (three `loss` scalars) into its output directory
# with TensorBoard's own writer, then reports its final result.
EVENT_TRIAL = """
import time
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from trialkeeper.agent import trial

p = trial.get_next_parameter()
writer = EventFileWriter(trial.get_output_dir())
for step in range(3):
    value = summary_pb2.Summary.Value(tag="loss", simple_value=p["lr"] / (step + 1))
    writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value])))
writer.close()
trial.report_final_result(p["lr"])
"""


def _tensorboard() -> Path:
    exe = Path(sys.executable).parent / "tensorboard"
    if not exe.exists():
        why = (
            "tensorboard is not installed beside this interpreter: pip install -e '.[dev]' (or pip install tensorboard)"
        )
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return exe


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_tensorboard_serves_one_run_per_trial_of_a_real_experiment(tmp_path: Path) -> None:
    exe = _tensorboard()
    write_script(tmp_path, "trial.py", EVENT_TRIAL)
    config = tmp_path / "config.yml"
    config.write_text(textwrap.dedent(f"""
        trialCommand: {sys.executable} trial.py
        trialCodeDirectory: .
        trialConcurrency: 2
        maxTrialNumber: 3
        searchSpace:
          lr: {{_type: choice, _value: [0.1, 0.01, 0.001]}}
          units: {{_type: choice, _value: [16, 32]}}
        tuner: {{name: random, classArgs: {{optimize_mode: minimize, seed: 3}}}}
        trainingService: {{platform: local}}
        """).lstrip())
    exp = tmp_path / "exp"
    ran = tk("run", config, "--experiment-dir", exp, "--quiet", timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    with ReadModel.open(exp) as model:
        trials = list(model.trials())
    assert len(trials) == 3 and all(t.status is not None and t.status.value == "SUCCEEDED" for t in trials)
    # Named as nnictl names them: the id, then each parameter, in order of name.
    expected = {f"{t.id}_lr={t.parameters['lr']},units={t.parameters['units']}" for t in trials if t.parameters}

    proc = subprocess.Popen(
        [_script(), "tensorboard", str(exp), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PATH": f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    try:
        url, lines = first_line(proc, lambda line: (m := URL.search(line)) and m.group(1), timeout=START_TIMEOUT_S)
        assert url, f"TensorBoard did not start: {''.join(lines)}"
        assert f"log directory {exp / 'tensorboard'}: 3 run(s)" in "".join(lines)
        assert "no trial wrote TensorBoard event files" not in "".join(lines)
        # Beside each trial's own run, its stored results (here its final one) as scalars.
        stored = {f"stored/{name}" for name in expected}
        runs = wait_until(
            lambda: (r := _get(url + "/data/runs")) and set(r) == expected | stored and r,
            timeout=LISTED_TIMEOUT_S, message=f"TensorBoard listing {sorted(expected | stored)}",
        )
        assert len(runs) == 6
        # Each run's event file was read through its link: its `loss` scalars are there.
        tags = wait_until(
            lambda: (t := _get(url + "/data/plugin/scalars/tags")) and set(t) == expected | stored and t,
            timeout=LISTED_TIMEOUT_S, message="the trials' scalars",
        )
        assert all(set(tags[run]) == {"loss"} for run in expected)
        assert all(set(tags[run]) == {"final"} for run in stored)
    finally:
        proc.terminate()  # TensorBoard itself: the command became it
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


def test_tensorboard_builds_one_run_per_trial_and_says_how_to_install(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    many_trials(exp, 4)
    store = Store.in_dir(exp)
    store.update_env("env-0", platform="local")
    store.update_env("env-1", hostname="gpu-box-7")  # a remote one
    store.update_trial("tr00001", environment_id="env-1")
    store.update_trial("tr00000", environment_id="env-0")
    store.update_trial("tr00002", environment_id="env-0")
    store.update_trial("tr00003", environment_id="env-0")
    store.close()
    for tid in ("tr00000", "tr00002"):
        (exp / "trials" / tid / "output").mkdir(parents=True)
        (exp / "trials" / tid / "output" / "events.out.tfevents.1").write_bytes(b"")

    proc = tk_bare("tensorboard", exp)
    assert proc.returncode == 1, proc.stderr
    logdir = exp / "tensorboard"
    runs = sorted(p.name for p in logdir.iterdir() if p.name != "stored")
    assert len(runs) == 2 and runs[0].startswith("tr00000_layers=") and "lr=" in runs[0] and "opt=" in runs[0]
    assert all((logdir / r).is_symlink() and (logdir / r / "events.out.tfevents.1").exists() for r in runs)
    assert "trial tr00001: output not on this machine" in proc.stdout and "gpu-box-7" in proc.stdout
    assert "trial tr00003: no output directory yet" in proc.stdout
    assert (
        "tensorboard is not installed: pip install tensorboard" in proc.stdout and f"--logdir {logdir}" in proc.stdout
    )

    # Again, for chosen trials, into another directory: only those runs.
    proc = tk_bare("tensorboard", exp, "tr00002", "--logdir", tmp_path / "tb")
    assert sorted(p.name.split("_")[0] for p in (tmp_path / "tb").iterdir()) == ["stored", "tr00002"]
    assert [p.name.split("_")[0] for p in (tmp_path / "tb" / "stored").iterdir() if p.is_dir()] == ["tr00002"]
    proc = tk_bare("tensorboard", exp, "nope")
    assert proc.returncode == 1 and "no trial nope" in proc.stderr

    # By the experiment's id, as the other commands take it, once this machine's index knows it.
    index.record("bigexp", exp)
    proc = tk_bare("tensorboard", "bigexp", "tr00000", "--logdir", tmp_path / "by-id")
    assert [p.name.split("_")[0] for p in (tmp_path / "by-id").iterdir() if p.name != "stored"] == ["tr00000"]
    proc = tk_bare("tensorboard", "no-such-id")
    assert proc.returncode == 1 and "no experiment 'no-such-id': neither a directory holding one" in proc.stderr


def test_tensorboard_shows_the_stored_results_when_no_trial_wrote_event_files(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="reading the written events needs tensorboard: pip install -e '.[dev]' (or pip install tensorboard)",
    )
    exp = tmp_path / "exp"
    many_trials(exp, 3)  # three intermediate results each, no output directories
    store = Store.in_dir(exp)
    store.add_metrics([MetricRow("tr00001", 3, "final", 0.75, json.dumps({"default": 0.75, "loss": 0.2}), 5.0)])
    store.close()
    proc = tk_bare("tensorboard", exp)
    assert "no trial wrote TensorBoard event files (events.out.tfevents.*)" in proc.stdout, proc.stdout
    assert "stored/: the results of 3 trial(s) as scalars" in proc.stdout
    root = exp / "tensorboard" / "stored"
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    assert [r.name.split("_")[0] for r in runs] == ["tr00000", "tr00001", "tr00002"]

    # Read back by TensorBoard's own reader: every stored result, at its step.
    board = event_accumulator.EventAccumulator(str(runs[1]))
    board.Reload()
    assert sorted(board.Tags()["scalars"]) == ["final", "final/loss", "intermediate"]
    assert [(e.step, round(e.value, 6)) for e in board.Scalars("intermediate")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [(e.step, e.value, e.wall_time) for e in board.Scalars("final")] == [(3, 0.75, 5.0)]
    assert [round(e.value, 6) for e in board.Scalars("final/loss")] == [0.2]

    # Written once: a second run leaves the files as they are, until a trial reports more.
    files = {r.name: list(r.glob("events.out.tfevents.*")) for r in runs}
    assert all(len(f) == 1 for f in files.values())
    tk_bare("tensorboard", exp)
    assert {r.name: list(r.glob("events.out.tfevents.*")) for r in runs} == files
    store = Store.in_dir(exp)
    store.add_metrics([MetricRow("tr00000", 3, "intermediate", 0.3, "0.3", 6.0)])
    store.close()
    tk_bare("tensorboard", exp)
    again = list(runs[0].glob("events.out.tfevents.*"))
    assert len(again) == 1
    board = event_accumulator.EventAccumulator(str(runs[0]))
    board.Reload()
    assert [e.step for e in board.Scalars("intermediate")] == [0, 1, 2, 3]
