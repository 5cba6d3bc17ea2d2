"""A fleet too large for its heartbeat interval is told to heartbeat less often."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import async_wait_until, build_config, run_async, write_script
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.engine.events import HeartbeatReceived
from trialkeeper.coordinator.engine.states import EnvStatus

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


@pytest.mark.slow
def test_heartbeats_leave_out_unchanged_gpu_samples_but_carry_them_first_on_every_stream(tmp_path: Path) -> None:
    write_script(tmp_path, "trial.py", "print('unused')\n")
    # A real agent with two simulated GPUs (their samples never change), heartbeating every
    # 0.2 s, and lost after 1 s of silence.
    config = build_config(
        tmp_path,
        trialConcurrency=1,
        trainingService={"environmentCount": 1, "simulatedGpus": 2},
        coordinator={"heartbeatInterval": 0.2, "agentLostTimeout": 1.0, "trialLostTimeout": 2.0},
    )

    async def body() -> None:
        async with Coordinator(config, experiment_dir=tmp_path / "exp") as c:
            beats: list[HeartbeatReceived] = []
            assert c._shell is not None
            shell = c._shell
            agent_event = shell.agent_event

            def recording(event, link):  # type: ignore[no-untyped-def]
                if isinstance(event, HeartbeatReceived):
                    beats.append(event)
                agent_event(event, link)

            shell.agent_event = recording  # type: ignore[method-assign]
            await async_wait_until(lambda: len(beats) >= 10, WAIT_S, message="no heartbeats")
            first_link = beats[0].link
            # The stream's first carries both GPUs; those within the sample interval (5 s)
            # say only "unchanged", and they keep the agent alive past agentLostTimeout.
            assert len(beats[0].gpus) == 2 and not beats[0].gpus_unchanged
            assert all(b.gpus_unchanged and not b.gpus for b in beats[1:10] if b.link == first_link)
            assert [e.status for e in c.environments()] == [EnvStatus.READY]
            # The coordinator ends the stream: the agent dials again, and the new stream's
            # first heartbeat carries the samples whatever the old one had said.
            seen = len(beats)
            link = shell.links[first_link]
            link.close()
            await async_wait_until(
                lambda: any(b.link != first_link for b in beats[seen:]), WAIT_S, message="the agent never came back"
            )
            again = next(b for b in beats[seen:] if b.link != first_link)
            assert len(again.gpus) == 2 and not again.gpus_unchanged
            # Nothing changes on simulated GPUs: the samples still come every 5 s, for the record.
            second = again.link
            await async_wait_until(
                lambda: sum(1 for b in beats if b.link == second and b.gpus) >= 2, WAIT_S,
                message="no samples after the sample interval",
            )
            assert [e.status for e in c.environments()] == [EnvStatus.READY]

    run_async(body, timeout=90)
