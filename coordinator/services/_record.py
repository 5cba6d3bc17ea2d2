"""What the lifecycle keeps about each environment, and what a platform says about one.

One record type, which each platform extends with what only it knows (a pod's pull
failure, a Ray actor, an SSH machine); the phases a platform reports; the one error a
platform call raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import Observation

Phase = Literal["waiting", "running", "succeeded", "failed", "stopped", "gone"]
FINAL: frozenset[str] = frozenset({"succeeded", "failed", "stopped", "gone"})


class PlatformError(Exception):
    """A platform call that failed; its message is shown (after secrets are blanked)."""


@dataclass(frozen=True)
class State:
    """What the platform says about one environment: its phase and, in its own words, why."""

    phase: Phase
    detail: str = ""


@dataclass
class Record:
    """One environment as the service knows it; a platform extends it with what only it
    knows."""

    env_id: str
    platform_id: str = ""  # the platform's id for it: what ``start`` answered (or ``adopt`` got)
    adopted: bool = False  # started by an earlier coordinator of this experiment
    stop_requested: bool = False  # stopped (or swept) by this coordinator: its end is no failure
    experiment_id: str | None = None  # None when adopted: the platform may say
    phase: Phase = "waiting"
    detail: str = ""
    observation: Observation | None = None  # set once the environment has ended
