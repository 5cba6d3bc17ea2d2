"""The job base (one environment is one job) through the plug-in of tests/procjobs.py: real
agent processes, detached as a cluster's jobs are; what the contract suite does not pin
down: stop with grace, throttled polling, errors of the platform calls as data."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import procjobs
from conftest import async_wait_until, run_async
from trialkeeper.coordinator.services._jobs import Job, JobState
from trialkeeper.coordinator.services.base import EnvironmentRequest

WAIT_S = 30.0
# Nothing listens there: the agent keeps trying to reach it until it is stopped.
NOWHERE = "127.0.0.1:1"


class CountingService(procjobs.ProcJobsService):
    """The plug-in, counting how often the platform is asked about its jobs."""

    observed = 0

    async def observe(self, jobs: Sequence[Job]) -> dict[str, JobState]:
        self.observed += 1
        return await super().observe(jobs)


def _service(tmp_path: Path, poll_interval: float = 0.1) -> CountingService:
    config = procjobs.ProcJobsConfig(state_directory=str(tmp_path / "state"), poll_interval=poll_interval)
    (tmp_path / "code").mkdir(exist_ok=True)
    return CountingService(config, tmp_path / "exp", tmp_path / "code")


def _request(env_id: str, *args: str) -> EnvironmentRequest:
    return EnvironmentRequest(
        env_id, "jb1", NOWHERE, token="tok-" + env_id, agent_args=("--reconnect-window", "120", *args)
    )


def test_stop_waits_the_grace_period_then_kills(tmp_path: Path) -> None:
    service = _service(tmp_path)

    async def body() -> None:
        started = await service.start(_request("env-1"))
        assert started.error is None
        await async_wait_until(lambda: procjobs._alive(tmp_path / "state" / started.platform_id) is not None, WAIT_S)
        began = time.monotonic()
        await service.stop("env-1", grace_s=1.0)
        # The agent did not end on its own: it was killed, after the grace period only.
        assert time.monotonic() - began >= 1.0
        assert (tmp_path / "state" / started.platform_id / "killed").exists()
        assert procjobs._alive(tmp_path / "state" / started.platform_id) is None
        seen = (await service.poll(["env-1"]))["env-1"]
        assert (seen.state, seen.detail, seen.platform_id) == ("exited", "stopped", started.platform_id)
        await service.close()

    run_async(body)


def test_a_job_that_ended_on_its_own_is_not_killed(tmp_path: Path) -> None:
    service = _service(tmp_path)

    async def body() -> None:
        started = await service.start(_request("env-1", "--no-such-agent-option"))
        assert started.error is None
        await async_wait_until(lambda: (tmp_path / "state" / started.platform_id / "exit").exists(), WAIT_S)
        await service.stop("env-1", grace_s=30.0)  # answers at once: the job has ended
        assert not (tmp_path / "state" / started.platform_id / "killed").exists()
        await service.close()

    run_async(body, timeout=20.0)


def test_an_unasked_end_is_a_failure_that_says_why(tmp_path: Path) -> None:
    service = _service(tmp_path)

    async def body() -> None:
        started = await service.start(_request("env-1", "--no-such-agent-option"))

        async def failed() -> bool:
            return (await service.poll(["env-1"]))["env-1"].state == "failed"

        await async_wait_until(failed, WAIT_S, message="the job never failed")
        seen = (await service.poll(["env-1"]))["env-1"]
        assert seen.platform_id == started.platform_id
        assert "failed" in seen.detail and "status 2" in seen.detail and "no-such-agent-option" in seen.detail, seen
        await service.close()

    run_async(body)


def test_the_platform_is_asked_at_most_once_per_poll_interval(tmp_path: Path) -> None:
    service = _service(tmp_path, poll_interval=30.0)

    async def body() -> None:
        started = await service.start(_request("env-1"))
        for _ in range(20):
            assert (await service.poll(["env-1"]))["env-1"].platform_id == started.platform_id
        assert service.observed == 1
        await service.stop("env-1", grace_s=0.0)
        assert (await service.poll(["env-1"]))["env-1"].state == "exited"  # a stop is seen at once
        await service.close()

    run_async(body)


def test_a_failing_platform_call_is_data_without_the_secret(tmp_path: Path) -> None:
    service = _service(tmp_path)
    (tmp_path / "state").write_text("not a directory")  # every submit fails
    request = _request("env-1")

    async def body() -> None:
        result = await service.start(request)
        assert result.error is not None and "could not be submitted" in result.error, result
        assert request.token not in result.error
        seen = (await service.poll(["env-1"]))["env-1"]
        assert seen.state == "failed" and seen.detail == result.error
        assert await service.sweep("jb1") == []
        await service.close()

    run_async(body)
