"""Agents that die or freeze: two timers, retries, replacement, and agents that come back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
from conftest import async_wait_until, build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator, TrialHandle
from trialkeeper.coordinator.engine.model import TrialInfo
from trialkeeper.coordinator.engine.states import EnvStatus, TrialStatus

WAIT_S = 30.0
FAST = {"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.5}

# Runs until the file named by its parameter "go" exists (or 60 s pass).
HOLD = """
import os, pathlib, time
from trialkeeper.agent import trial
p = trial.get_next_parameter()
out = pathlib.Path(os.environ["TRIALKEEPER_OUTPUT_DIR"])
(out / "started.tmp").write_text(str(os.getpid()))
(out / "started.tmp").replace(out / "started")  # whole: the test reads the pid once it exists
deadline = time.monotonic() + 60
while not pathlib.Path(p["go"]).exists() and time.monotonic() < deadline:
    time.sleep(0.02)
trial.report_final_result(1.0)
"""


def _agent_pid(c: Coordinator, env_id: str) -> int:
    assert c.store is not None
    row = next(e for e in c.store.envs() if e["id"] == env_id)
    return int(json.loads(row["info_json"])["pid"])


def _started(c: Coordinator, trial_id: str) -> bool:
    return (c.experiment_dir / "trials" / trial_id / "output" / "started").exists()


async def _one_running(c: Coordinator, go: Path) -> tuple[TrialHandle, str, int]:
    """Submit one holding trial and wait until it runs: its handle, environment, agent pid."""
    h = await c.submit({"go": str(go)})
    await async_wait_until(lambda: _started(c, h.id), WAIT_S)
    env_id = h.info.environment_id
    assert env_id is not None
    return h, env_id, _agent_pid(c, env_id)


def _statuses(c: Coordinator) -> dict[str, EnvStatus]:
    return {e.id: e.status for e in c.environments()}


def test_killed_agent_fails_its_trial_with_environment_lost_and_is_replaced(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", HOLD)
    go = tmp_path / "go"
    config = build_config(tmp_path, trialConcurrency=1, coordinator=FAST)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            doomed, env_id, pid = await _one_running(c, go)
            trial_pid = int((c.experiment_dir / "trials" / doomed.id / "output" / "started").read_text())
            os.kill(pid, signal.SIGKILL)
            info = await doomed.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED
            assert info.reason.startswith("environment lost"), info.reason
            # The trial its agent left behind (in a session of its own) does not run on.
            await async_wait_until(lambda: not psutil.pid_exists(trial_pid), WAIT_S,
                                   message="the killed agent's trial still runs")
            # The environment was replaced and the experiment goes on.
            go.write_text("")
            after = await c.submit({"go": str(go)})
            assert (await after.wait(WAIT_S)).status is TrialStatus.SUCCEEDED
            assert after.info.environment_id != env_id
            assert _statuses(c)[env_id].terminal

    run_async(body)


def _runs_again_elsewhere(
    tmp_path: Path, stop: Callable[[Coordinator, str, int], Awaitable[None]], **timers: float
) -> tuple[str, TrialInfo]:
    """Run a holding trial, ``stop`` its agent (given its environment and pid): the trial runs
    again on another environment and succeeds. The reasons of its history, and the trial as
    its second attempt started."""
    write_script(tmp_path, "trial.py", HOLD)
    go = tmp_path / "go"
    config = build_config(tmp_path, trialConcurrency=1, maxTrialRetries=1, coordinator={**FAST, **timers})

    async def body() -> tuple[str, TrialInfo]:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h, first_env, pid = await _one_running(c, go)
            await stop(c, first_env, pid)
            await async_wait_until(
                lambda: h.info.attempts == 2 and h.info.environment_id not in (None, first_env), WAIT_S,
                message=f"the trial did not run again elsewhere: {h.info}",
            )
            again = h.info
            go.write_text("")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED and info.attempts == 2, info
            assert c.store is not None
            history = [(e["old"], e["new"]) for e in c.store.events(h.id)]
            assert ("RUNNING", "WAITING") in history, history
            return " | ".join(str(e.get("reason", "")) for e in c.store.events(h.id)), again

    return run_async(body)


def test_killed_agent_with_retries_runs_the_trial_again_elsewhere(tmp_path: Path) -> None:
    async def kill(c: Coordinator, env_id: str, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    _runs_again_elsewhere(tmp_path, kill)


def test_a_lost_attempts_time_ends_when_its_agent_was_last_heard_from(tmp_path: Path) -> None:
    """An agent that stops answering (frozen here; killed where its platform cannot tell) is
    lost once trialLostTimeout has passed: the attempt's time ends at its last heartbeat, not
    when the loss was noticed."""
    ran: list[float] = []
    frozen: list[int] = []

    async def freeze(c: Coordinator, env_id: str, pid: int) -> None:
        await async_wait_until(lambda: time.time() - (c.trials()[0].started_at or time.time()) > 1.0, WAIT_S)
        os.kill(pid, signal.SIGSTOP)
        frozen.append(pid)
        ran.append(time.time() - (c.trials()[0].started_at or 0.0))

    try:
        _, again = _runs_again_elsewhere(tmp_path, freeze, trialLostTimeout=5.0)
    finally:
        for pid in frozen:  # the coordinator stopped it; should it not have, it is not left frozen
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # Its last heartbeat came at most an interval (and a busy machine's delay) before it froze;
    # noticed, the loss came agentLostTimeout and trialLostTimeout (6 s) later.
    assert ran[0] - 2.0 <= again.ran_s <= ran[0] + 0.5, (again.ran_s, ran)


def test_an_agent_stopped_by_a_second_signal_loses_its_trial_which_is_run_again_not_failed(tmp_path: Path) -> None:
    """The first SIGTERM drains the agent, a second one stops its trial: that trial is lost
    with its environment through no fault of its own, and runs again elsewhere."""

    async def twice(c: Coordinator, env_id: str, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        # Two signals sent at once may arrive as one: the second once the first drains it.
        await async_wait_until(lambda: _statuses(c)[env_id] is EnvStatus.DRAINING, WAIT_S,
                               message="the agent did not drain on the first signal")
        os.kill(pid, signal.SIGTERM)

    reasons, _ = _runs_again_elsewhere(tmp_path, twice)
    assert "environment lost (its agent was stopped by a second signal)" in reasons, reasons


def test_frozen_agent_is_unreachable_first_then_lost(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", HOLD)
    go = tmp_path / "go"
    config = build_config(tmp_path, trialConcurrency=1, coordinator=FAST)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h, env_id, pid = await _one_running(c, go)
            os.kill(pid, signal.SIGSTOP)
            try:
                # First timer: unreachable, the trial still counts as running.
                await async_wait_until(lambda: _statuses(c)[env_id] is EnvStatus.LOST, WAIT_S)
                assert h.info.status is TrialStatus.RUNNING
                # Second timer: the trial is lost and the environment given up.
                info = await h.wait(WAIT_S)
                assert info.status is TrialStatus.FAILED and info.reason.startswith("environment lost"), info.reason
                assert _statuses(c)[env_id] is EnvStatus.FAILED
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            # The frozen agent was stopped by the coordinator, with its trial.
            await async_wait_until(
                lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, WAIT_S
            )
            go.write_text("")

    run_async(body)


def test_agent_that_comes_back_before_the_trial_lost_timer_carries_on(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", HOLD)
    go = tmp_path / "go"
    config = build_config(
        tmp_path, trialConcurrency=1, coordinator={**FAST, "trialLostTimeout": 60.0}
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            h, env_id, pid = await _one_running(c, go)
            os.kill(pid, signal.SIGSTOP)
            try:
                await async_wait_until(lambda: _statuses(c)[env_id] is EnvStatus.LOST, WAIT_S)
            finally:
                os.kill(pid, signal.SIGCONT)
            await async_wait_until(lambda: _statuses(c)[env_id] in (EnvStatus.BUSY, EnvStatus.READY), WAIT_S)
            go.write_text("")
            info = await h.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED and info.environment_id == env_id and info.attempts == 1

    run_async(body)


def test_user_failures_are_not_retried_unless_asked(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "import sys; sys.exit(3)\n")

    async def run(retry: bool) -> tuple[TrialStatus, int]:
        config = build_config(
            tmp_path, trialConcurrency=1, maxTrialRetries=2, retryFailedTrials=retry,
            experimentWorkingDirectory=str(tmp_path / f"exps-{retry}"),
        )
        async with Coordinator(config, experiment_dir=tmp_path / f"exp-{retry}") as c:
            h = await c.submit({})
            info = await h.wait(WAIT_S)
            return info.status, info.attempts

    assert run_async(lambda: run(False)) == (TrialStatus.FAILED, 1)
    assert run_async(lambda: run(True)) == (TrialStatus.FAILED, 3)


def test_trial_signalled_with_its_agent_is_lost_with_the_environment_not_failed(tmp_path: Path) -> None:
    """A platform taking an environment down (scancel, a pod deleted) signals every process
    in it at once: the trial dies of SIGTERM and so is its agent told to stop. That trial
    is lost with its environment and retried, without retryFailedTrials; a trial killed by
    a signal on its own is a failure of the trial."""
    write_script(tmp_path, "trial.py", HOLD)
    go = tmp_path / "go"
    config = build_config(tmp_path, trialConcurrency=1, maxTrialRetries=1, coordinator=FAST)

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            alone, _, _ = await _one_running(c, go)
            trial_pid = int((c.experiment_dir / "trials" / alone.id / "output" / "started").read_text())
            os.kill(trial_pid, signal.SIGTERM)
            info = await alone.wait(WAIT_S)
            assert info.status is TrialStatus.FAILED and info.attempts == 1, info
            assert "killed by signal 15" in info.reason, info.reason

            taken, env_id, agent_pid = await _one_running(c, go)
            trial_pid = int((c.experiment_dir / "trials" / taken.id / "output" / "started").read_text())
            os.kill(trial_pid, signal.SIGTERM)  # the trial first: the harder order for the agent
            os.kill(agent_pid, signal.SIGTERM)
            await async_wait_until(lambda: taken.info.attempts == 2, WAIT_S,
                                   message=f"the trial was not retried: {taken.info}")
            assert c.store is not None
            reasons = " | ".join(str(e.get("reason", "")) for e in c.store.events(taken.id))
            assert "environment lost" in reasons and "as its environment was stopped" in reasons, reasons
            go.write_text("")
            info = await taken.wait(WAIT_S)
            assert info.status is TrialStatus.SUCCEEDED, info
            assert info.environment_id != env_id

    run_async(body)

