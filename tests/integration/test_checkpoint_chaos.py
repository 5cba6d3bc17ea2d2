"""Checkpoints end to end on the local platform: the experiment of examples/checkpoints run by
`trialkeeper run` while its agents are killed with SIGKILL again and again, and while it is
stopped with `trialkeeper stop` and carried on with `trialkeeper resume`, twice. Every trial
ends SUCCEEDED with one complete curve, and the epochs computed in all stay within 1.3 times
those of an undisturbed run (tests/checkpoint_chaos.py says what is checked)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from checkpoint_chaos import (
    Loss,
    Losses,
    Seen,
    Workload,
    check_finished,
    cli,
    end,
    finish,
    seen,
    take_environments,
    wait_for,
    workload,
)
from conftest import stored_rows
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus
from trialkeeper.coordinator.read.model import EnvSnapshot

WAIT_S = 60.0
RUN_S = 150.0
LOCAL = {"platform": "local", "reuseMode": True, "environmentCount": 2}


def _agent_pid(exp: Path, env_id: str) -> int:
    row = next(e for e in stored_rows(exp, "envs") if e["id"] == env_id)
    return int(json.loads(str(row["info_json"]))["pid"])


@pytest.mark.timeout(300)
def test_agents_killed_again_and_again_lose_at_most_an_epoch_each(tmp_path: Path) -> None:
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


def _stop(w: Workload, run: subprocess.Popen[bytes], after: int) -> list[Loss]:
    """Once the trials have saved ``after`` epochs in all and each running trial has a
    checkpoint, `trialkeeper stop`: the experiment STOPPED, the trials that ran PAUSED at
    their next save, none failed or canceled. The paused trials, as losses to check later."""

    def checkpointed() -> Seen | None:
        now = seen(w.exp)
        if now is None or now.progress < after:
            return None
        running = [t for t in now.trials if t.status is TrialStatus.RUNNING]
        return now if running and all(t.checkpoint_step for t in running) else None

    wait_for(run, checkpointed, WAIT_S, f"the trials never saved {after} epochs in all")
    stop = cli("stop", str(w.exp), "--timeout", str(WAIT_S))
    said = finish(stop, WAIT_S + 30, "trialkeeper stop")
    assert "STOPPED" in said and "resume" in said, said
    out, _ = run.communicate(timeout=WAIT_S)
    text = out.decode(errors="replace")
    assert run.returncode == 1 and "stopped by the user" in text, text  # it did not complete: it was stopped

    now = seen(w.exp)
    assert now is not None and now.experiment is not None and now.experiment.status == "STOPPED", now
    statuses = {t.id: t.status for t in now.trials}
    paused = [t for t in now.trials if t.status is TrialStatus.PAUSED]
    assert paused, statuses
    assert set(statuses.values()) <= {TrialStatus.PAUSED, TrialStatus.SUCCEEDED, TrialStatus.WAITING}, statuses
    assert all(t.checkpoint_step for t in paused), [(t.id, t.checkpoint_step) for t in paused]
    assert all(e.status is not None and e.status.terminal for e in now.envs), [(e.id, e.status) for e in now.envs]
    assert not any(e.status is EnvStatus.FAILED for e in now.envs), [(e.id, e.reason) for e in now.envs]
    # Nothing runs now: whatever is computed from here on is the resumed experiment's.
    computed_before = len(w.computed())
    return [Loss("", t.id, t.checkpoint_step or 0, computed_before) for t in paused]


@pytest.mark.timeout(300)
def test_stopped_twice_and_resumed_the_paused_trials_continue_from_their_checkpoints(tmp_path: Path) -> None:
    w = workload(tmp_path, trials=4, epochs=8)
    config = w.write_config(LOCAL, pauseGracePeriod="60s")
    losses = Losses()
    first = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    second = third = None
    try:
        losses.taken += _stop(w, first, after=4)
        second = cli("resume", str(w.exp), "--quiet")
        losses.taken += _stop(w, second, after=18)
        third = cli("resume", str(w.exp), "--quiet")
        finish(third, RUN_S, "the second trialkeeper resume")
    finally:
        end(first, second, third)
    check_finished(w, losses)
