"""Stopping a running experiment once it reaches a given state: what the tests of resuming
a multi-fidelity search start from."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import async_wait_until, run_async
from trialkeeper.coordinator.core import Coordinator
from trialkeeper.coordinator.experiment import ExperimentResult, run_experiment


def run_until_stopped(
    config: Any, exp: Path, until: Callable[[Coordinator], bool], message: str, *, wait_s: float = 60,
    timeout: float = 120,
) -> ExperimentResult:
    """Run the experiment until ``until(coordinator)`` holds (within ``wait_s``, else fail with
    ``message``), then stop it as ``trialkeeper stop`` does; its result."""

    async def stopped() -> ExperimentResult:
        stop = asyncio.Event()
        started: list[Coordinator] = []
        run = asyncio.ensure_future(run_experiment(config, experiment_dir=exp, stop=stop, on_start=started.append))
        await async_wait_until(lambda: started, wait_s, message="the experiment never started")
        c = started[0]
        await async_wait_until(lambda: until(c), wait_s, message=message)
        stop.set()
        return await asyncio.wait_for(run, wait_s)

    return run_async(stopped, timeout=timeout)
