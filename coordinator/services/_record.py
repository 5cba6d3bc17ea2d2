"""What a service keeps about each environment it started or adopted: one record type,
which each platform extends with what only it knows (a job's phase, a pod's pull failure,
a Ray actor, an SSH machine)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .base import StartResult


@dataclass
class EnvRecord:
    env_id: str
    platform_id: str = ""  # what ``start`` answered (or ``adopt`` was given)
    adopted: bool = False  # started by an earlier coordinator of this experiment
    stop_requested: bool = False  # stopped (or swept) by this coordinator: its end is no failure
    # The one start of this id: concurrent starts await it and answer the same.
    starting: asyncio.Future[StartResult] | None = None
