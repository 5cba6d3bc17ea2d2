"""Checkpoints end to end on the remote platform, against two real OpenSSH servers on
127.0.0.1 acting as two machines: the experiment of examples/checkpoints while its agents are
killed with SIGKILL again and again and each killed agent's work directory is deleted, so
that no copy of a checkpoint survives on the machine that saved it. Checkpoints go up the
agents' streams to the coordinator and come back down to whichever agent continues the
trial. Every trial ends SUCCEEDED with one complete curve, and the epochs computed in all
stay within 1.3 times those of an undisturbed run (tests/checkpoint_chaos.py).

Where sshd cannot start these tests skip with the reason; in CI (``CI`` set) they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from conftest import wait_until
from sshd import Credentials, Machine, SshdUnavailable, make_credentials, start_machine
from trialkeeper.coordinator.read.model import EnvSnapshot, ReadModel

# Real sshd servers: left out of the fast subset.
pytestmark = pytest.mark.slow

WAIT_S = 60.0
RUN_S = 150.0


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Machine], Credentials, Path]]:
    """Two sshd machines, the credentials to log in to them and a known_hosts file naming them."""
    base = tmp_path_factory.mktemp("sshd")
    started: list[Machine] = []
    try:
        creds = make_credentials(base / "credentials")
        for name in ("m1", "m2"):
            started.append(start_machine(name, base, creds))
    except SshdUnavailable as e:
        for m in started:
            m.stop()
        if os.environ.get("CI"):
            pytest.fail(f"the remote-platform tests need sshd and could not start it: {e}")
        pytest.skip(f"sshd cannot run here: {e}")
    known_hosts = base / "known_hosts"
    known_hosts.write_text("".join(m.known_hosts_line + "\n" for m in started))
    try:
        yield started, creds, known_hosts
    finally:
        for m in started:
            m.stop()


def _training_service(lab: tuple[list[Machine], Credentials, Path]) -> dict[str, Any]:
    ms, creds, known_hosts = lab
    return {
        "platform": "remote", "reuseMode": True, "knownHostsFile": str(known_hosts),
        "machineList": [
            {"host": m.host, "port": m.port, "user": creds.user, "pythonPath": sys.executable,
             "sshKeyFile": str(creds.key_file), "sshPassphrase": creds.passphrase}
            for m in ms
        ],
    }


def _agent_dir(ms: list[Machine], experiment_id: str, env_id: str) -> Path:
    """The agent's work directory on whichever machine runs it."""
    found = [d for m in ms if (d := m.home / "trialkeeper-experiments" / experiment_id / "envs" / env_id).is_dir()]
    assert len(found) == 1, (env_id, found)
    return found[0]


@pytest.mark.timeout(300)
def test_agents_killed_with_their_files_deleted_continue_from_uploaded_checkpoints(
    tmp_path: Path, machines: tuple[list[Machine], Credentials, Path]
) -> None:
    ms = machines[0]
    w = workload(tmp_path, trials=4, epochs=6)
    config = w.write_config(_training_service(machines))
    deleted: list[Path] = []

    def kill_and_delete(env: EnvSnapshot, now: Seen) -> None:
        assert now.experiment is not None
        agent_dir = _agent_dir(ms, now.experiment.id, env.id)
        os.kill(int((agent_dir / "agent.pid").read_text()), signal.SIGKILL)
        shutil.rmtree(agent_dir)
        deleted.append(agent_dir)

    run = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    try:
        losses = take_environments(w, run, 3, kill_and_delete, timeout=WAIT_S)
        finish(run, RUN_S, "trialkeeper run")
    finally:
        end(run)
    summary = check_finished(w, losses)
    for loss in losses.taken:
        assert summary["attempts"][loss.trial_id] >= 2, (loss, summary)
    # No copy survived where a killed agent had saved: what the trials continued from came
    # from the coordinator, which holds each trial's last checkpoint in the experiment's directory.
    assert len(deleted) == 3 and not any(d.exists() for d in deleted), deleted
    with ReadModel.open(w.exp) as model:
        for trial_id in summary["attempts"]:
            last = model.checkpoints(trial_id)[-1]
            assert last.step == w.epochs and last.location == "", last
            assert (w.exp / "checkpoints" / trial_id / str(last.step) / "state.pkl").is_file(), last
    wait_until(lambda: not any(m.processes() for m in ms), timeout=15.0,
               message=f"processes left on the machines: {[(p.pid, p.cmdline()) for m in ms for p in m.processes()]}")


@pytest.mark.timeout(300)
def test_stopped_and_resumed_on_other_agents_the_trials_continue_from_uploaded_checkpoints(
    tmp_path: Path, machines: tuple[list[Machine], Credentials, Path]
) -> None:
    """`trialkeeper stop` pauses the trials (their checkpoints uploaded); with every work
    directory of the machines deleted, `trialkeeper resume` continues them on new agents,
    which download them from the resumed coordinator."""
    ms = machines[0]
    w = workload(tmp_path, trials=4, epochs=6)
    config = w.write_config(_training_service(machines), pauseGracePeriod="60s")
    first = cli("run", str(config), "--experiment-dir", str(w.exp), "--quiet")
    resumed = None
    try:
        paused = stop_experiment(w, first, after=2, timeout=WAIT_S)
        with ReadModel.open(w.exp) as model:
            experiment = model.experiment()
        assert experiment is not None
        agent_dirs = [d for m in ms if (d := m.home / "trialkeeper-experiments" / experiment.id / "envs").is_dir()]
        assert agent_dirs
        for d in agent_dirs:
            shutil.rmtree(d)
        # The stored config has the key's passphrase redacted: the config file gives it again.
        resumed = cli("resume", str(w.exp), "--config", str(config), "--quiet")
        finish(resumed, RUN_S, "trialkeeper resume")
    finally:
        end(first, resumed)
    check_finished(w, Losses(paused))
    wait_until(lambda: not any(m.processes() for m in ms), timeout=15.0,
               message=f"processes left on the machines: {[(p.pid, p.cmdline()) for m in ms for p in m.processes()]}")
