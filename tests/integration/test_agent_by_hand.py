"""Agents started by hand: a second agent of an environment already served from the same
work dir is refused at once, and leaves the first one's socket and trials alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import pid_gone, wait_until

START_S = 30.0


def _agent(workdir: Path, env_id: str) -> list[str]:
    # A coordinator that never answers: the agent keeps dialling it within its reconnect window.
    return [sys.executable, "-m", "trialkeeper.agent", "--coordinator", "127.0.0.1:9", "--environment-id", env_id,
            "--workdir", str(workdir), "--no-gpu", "--reconnect-window", "120"]


def test_a_second_agent_of_one_environment_in_one_work_dir_is_refused_before_it_touches_anything(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "TRIALKEEPER_TOKEN": "t" * 32}
    first = subprocess.Popen(_agent(tmp_path, "box-a"), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        sock = tmp_path / "sockets" / "box-a.sock"
        wait_until(sock.exists, START_S, message="the first agent never bound its metric socket")
        second = subprocess.run(_agent(tmp_path, "box-a"), env=env, capture_output=True, text=True,
                                timeout=START_S, check=False)
        assert second.returncode == 2, second.stderr
        assert (f"trialkeeper agent: another agent of environment box-a runs in {tmp_path} (pid {first.pid}): "
                "give each agent its own --environment-id") in second.stderr, second.stderr
        assert sock.exists(), "the refused agent took the first one's socket away"
        assert first.poll() is None
        # Another environment in the same work dir is an agent of its own (local environments share one).
        other = subprocess.Popen(_agent(tmp_path, "box-b"), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            wait_until((tmp_path / "sockets" / "box-b.sock").exists, START_S, message="box-b never started")
        finally:
            other.kill()
            other.wait(START_S)
    finally:
        first.kill()
        first.wait(START_S)
    # Its lock went with it, kill -9 and all: the environment's next agent starts.
    assert pid_gone(first.pid)
    again = subprocess.Popen(_agent(tmp_path, "box-a"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / ".agent-box-a.lock").read_text() == str(again.pid), START_S,
                   message="the next agent of box-a did not take the environment")
        assert again.poll() is None
    finally:
        again.send_signal(signal.SIGKILL)
        again.wait(START_S)
