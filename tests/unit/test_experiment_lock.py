"""One owner of an experiment directory at a time (store/lock.py)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import pid_gone, wait_until
from trialkeeper.coordinator.store.lock import LOCK_FILENAME, DirectoryInUse, ExperimentLock

HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from trialkeeper.coordinator.store.lock import ExperimentLock

    lock = ExperimentLock.acquire(Path(sys.argv[1]), command="trialkeeper resume here")
    print("held", flush=True)
    sys.stdin.read()  # held until the test kills this process
    """
)


def test_a_second_owner_is_refused_with_the_first_ones_pid_and_command(tmp_path: Path) -> None:
    first = ExperimentLock.acquire(tmp_path, command="trialkeeper run config.yml")
    with pytest.raises(DirectoryInUse) as refused:
        ExperimentLock.acquire(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert f"process {os.getpid()} (trialkeeper run config.yml)" in message
    first.release()
    # Released: the next one takes it.
    ExperimentLock.acquire(tmp_path).release()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        # A read with a deadline: a holder that hangs before it answers fails the test, not the run.
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        assert ready, "the holder said nothing within 30 s"
        assert holder.stdout.readline().strip() == "held"  # the child exits on EOF of stdin
        with pytest.raises(DirectoryInUse, match=rf"process {holder.pid} \(trialkeeper resume here\)"):
            ExperimentLock.acquire(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        wait_until(lambda: pid_gone(holder.pid), 30, message="holder gone")
        # The kernel let go of it with the process: no stale lock to judge.
        lock = ExperimentLock.acquire(tmp_path, command="trialkeeper resume again")
        assert (tmp_path / LOCK_FILENAME).read_text().count("trialkeeper resume again") == 1
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


def test_the_lock_is_not_inherited_by_processes_the_owner_starts(tmp_path: Path) -> None:
    lock = ExperimentLock.acquire(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        lock.release()
        # An agent that outlives its coordinator must not keep the directory taken.
        ExperimentLock.acquire(tmp_path).release()
    finally:
        child.kill()
        child.wait(timeout=30)
