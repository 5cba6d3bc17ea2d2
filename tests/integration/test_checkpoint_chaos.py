"""Checkpoints end to end on the local platform: the experiment of examples/checkpoints run by
`trialkeeper run` while its agents are killed with SIGKILL again and again, and while it is
stopped with `trialkeeper stop` and carried on with `trialkeeper resume`, twice. Every trial
ends SUCCEEDED with one complete curve, and the epochs computed in all stay within 1.3 times
those of an undisturbed run (tests/checkpoint_chaos.py says what is checked)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from checkpoint_chaos import (
    Losses,
    Seen,
    check_finished,
    cli,
    end,
    finish,
    stop_experiment,
    take_environments,
    workload,
)
from conftest import stored_rows
from trialkeeper.coordinator.read.model import EnvSnapshot

WAIT_S = 60.0
RUN_S = 150.0
LOCAL = {"platform": "local", "reuseMode": True, "environmentCount": 2}


def _agent_pid(exp: Path, env_id: str) -> int:
    row = next(e for e in stored_rows(exp, "envs") if e["id"] == env_id)
    return int(json.loads(str(row["info_json"]))["pid"])


@pytest.mark.timeout(300)
def test_agents_killed_again_and_again_the_trials_continue_from_their_checkpoints(tmp_path: Path) -> None:
    w = workload(tmp_path, trials=4, epochs=8)
    config = w.write_config(LOCAL)

    def kill_agent(env: EnvSnapshot, now: Seen) -> None:
        os.kill(_agent_pid(w.exp, env.id), signal.SIGKILL)

    run = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    try:
        losses = take_environments(w, run, 4, kill_agent, timeout=WAIT_S)
        finish(run, RUN_S, "trialkeeper run")
    finally:
        end(run)
    summary = check_finished(w, losses)
    # Each trial whose agent was killed ran again: the losses were real.
    for loss in losses.taken:
        assert summary["attempts"][loss.trial_id] >= 2, (loss, summary)
    envs = stored_rows(w.exp, "envs")
    for loss in losses.taken:
        row = next(e for e in envs if e["id"] == loss.env_id)
        assert row["status"] == "FAILED", row


@pytest.mark.timeout(300)
def test_stopped_twice_and_resumed_the_paused_trials_continue_from_their_checkpoints(tmp_path: Path) -> None:
    w = workload(tmp_path, trials=4, epochs=8)
    config = w.write_config(LOCAL, pauseGracePeriod="60s")
    losses = Losses()
    first = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    second = third = None
    try:
        losses.taken += stop_experiment(w, first, after=4, timeout=WAIT_S)
        second = cli("resume", str(w.exp), "--quiet")
        losses.taken += stop_experiment(w, second, after=18, timeout=WAIT_S)
        third = cli("resume", str(w.exp), "--quiet")
        finish(third, RUN_S, "the second trialkeeper resume")
    finally:
        end(first, second, third)
    check_finished(w, losses)
