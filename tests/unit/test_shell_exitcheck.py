"""A killed agent's loss is seen when its platform sees the exit, not at the monitor's next
tick: the stream's end comes before the exit can be seen (exitcheck.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_shell import Link
from trialkeeper.coordinator.engine import events as ev
from trialkeeper.coordinator.engine.engine import Engine
from trialkeeper.coordinator.engine.events import Observation
from trialkeeper.coordinator.engine.policy import PlatformPolicy, Policy
from trialkeeper.coordinator.engine.states import TrialStatus
from trialkeeper.coordinator.exitcheck import FIRST_RECHECK_S, ExitCheck
from trialkeeper.coordinator.shell import Shell
from trialkeeper.coordinator.store.store import Store

RUNNING = Observation("running")
FAILED = Observation("failed", "agent was killed by SIGKILL")


def test_after_a_streams_end_the_platform_is_asked_again_at_doubling_intervals() -> None:
    check = ExitCheck(horizon_s=0.5)
    check.stream_ended("env-1", now=10.0)
    assert check.due_in(10.0) == 0.0  # the poll the stream's end asks for
    check.polled({"env-1": RUNNING}, 10.0, connected=lambda _: False)
    assert check.due_in(10.0) == pytest.approx(FIRST_RECHECK_S)
    check.polled({"env-1": RUNNING}, 10.0 + FIRST_RECHECK_S, connected=lambda _: False)
    assert check.due_in(10.0 + FIRST_RECHECK_S) == pytest.approx(2 * FIRST_RECHECK_S)
    check.polled({"env-1": FAILED}, 10.01, connected=lambda _: False)
    assert check.due_in(10.01) is None  # seen to have ended: the engine has it now


def test_no_look_again_for_an_agent_that_came_back_or_past_the_horizon() -> None:
    check = ExitCheck(horizon_s=0.5)
    check.stream_ended("env-1", now=0.0)
    check.polled({"env-1": RUNNING}, 0.0, connected=lambda _: True)
    assert check.due_in(0.0) is None
    check.stream_ended("env-1", now=1.0)
    check.polled({"env-1": RUNNING}, 1.5, connected=lambda _: False)
    assert check.due_in(1.5) is None  # the monitor's ticks take over
    check.stream_ended("env-1", now=2.0)
    check.polled({}, 2.0, connected=lambda _: False)  # no longer polled: nothing to look at
    assert check.due_in(2.0) is None


class _LateExit:
    """A platform that sees its agent's exit only a few polls after the stream ended, as the
    local platform sees it only once asyncio has reaped the process."""

    platform = "manual"

    def __init__(self, polls_until_seen: int) -> None:
        self.disconnected = False
        self.polls_until_seen = polls_until_seen
        self.polls_after: list[float] = []

    async def poll(self, env_ids: Sequence[str]) -> dict[str, Observation]:
        if self.disconnected:
            self.polls_after.append(time.monotonic())
            self.polls_until_seen -= 1
        seen = FAILED if self.disconnected and self.polls_until_seen < 0 else RUNNING
        return dict.fromkeys(env_ids, seen)


def test_a_lost_agent_is_seen_without_waiting_for_the_monitors_tick(tmp_path: Path) -> None:
    async def body() -> None:
        store = Store.in_dir(tmp_path)
        store.create_experiment("exp", None, {})
        platform = PlatformPolicy(name="manual", reuse=True, environment_count=1, trial_slots=1)
        engine = Engine(Policy(experiment_id="exp", trial_concurrency=1, platforms=(platform,)))
        service = _LateExit(polls_until_seen=3)
        shell = Shell(
            engine, store, service=service,  # type: ignore[arg-type]
            experiment_dir=tmp_path,
            request_for=lambda env_id: None,  # type: ignore[arg-type,return-value]
        )
        link = Link(1)
        registered = ev.AgentRegistered("by-hand", 1, "i-1", "host", 1, "", (), "", frozenset(), {})
        assert shell.agent_connected(registered, link) is None
        shell.handle(ev.TrialSubmitted("t1", {"x": 1}, "python trial.py", 0, 0))
        shell.handle(ev.Ticked())
        started = ev.TrialStartReported("t1", 42, 0.0)
        shell.agent_event(ev.AgentReported("by-hand", link.id, 1, started), link)
        shell.drain_inbox()
        assert engine.trials["t1"].status is TrialStatus.RUNNING
        # A tick far away: only a look again soon after the stream's end can see the loss.
        shell.start_monitor(60.0)
        try:
            service.disconnected = True
            shell.agent_disconnected("by-hand", link)
            lost = shell.done.setdefault("t1", asyncio.Event())
            await asyncio.wait_for(lost.wait(), 30)
        finally:
            await shell.stop_monitor()
        assert engine.trials["t1"].status is not TrialStatus.RUNNING
        assert len(service.polls_after) == 4  # at once, then three looks again
        store.close()

    asyncio.run(asyncio.wait_for(body(), 45))
