"""A fleet too large for its heartbeat interval is told to heartbeat less often."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import async_wait_until, build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.events import HeartbeatReceived
from trialkeeper.coordinator.states import EnvStatus

WAIT_S = 30.0


def test_heartbeats_are_spread_out_to_stay_under_the_coordinators_budget(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "print('unused')\n")
    # Three agents at 0.2 s would send 15 heartbeats/s; the budget is 5/s, so the interval
    # grows to at least 0.6 s (with headroom: 0.75 s) and the lost timeouts with it.
    config = build_config(
        tmp_path,
        trialConcurrency=3,
        trainingService={"environmentCount": 3},
        coordinator={"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.0,
                     "maxHeartbeatsPerSecond": 5},
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            beats: dict[str, list[float]] = {}
            assert c._shell is not None
            agent_event = c._shell.agent_event

            def recording(event, link):  # type: ignore[no-untyped-def]
                if isinstance(event, HeartbeatReceived):
                    beats.setdefault(event.env_id, []).append(time.monotonic())
                agent_event(event, link)

            c._shell.agent_event = recording  # type: ignore[method-assign]
            await async_wait_until(
                lambda: sum(e.status is EnvStatus.READY for e in c.environments()) == 3, WAIT_S,
                message="three agents never registered",
            )
            assert c.heartbeat_interval == pytest.approx(0.75)
            # Once every agent has been told, each one's heartbeats come at the new interval.
            since = len(beats.get("env-1", []))
            await async_wait_until(lambda: len(beats.get("env-1", [])) >= since + 5, WAIT_S,
                                   message="env-1 stopped heartbeating")
            gaps = [b - a for a, b in zip(beats["env-1"][-4:], beats["env-1"][-3:])]
            assert min(gaps) > 0.5, gaps
            # And an agent is not taken for lost at the configured 1 s of silence.
            assert all(e.status is EnvStatus.READY for e in c.environments())

    run_async(body, timeout=90)
