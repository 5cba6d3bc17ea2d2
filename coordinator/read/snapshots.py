"""What the read model returns: immutable snapshots of an experiment, its trials and its
environments, and how trials rank by their final metric. Plain data, the same whether read
from a live coordinator's store or a finished one's."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..engine.model import TrialInfo
from ..engine.states import EnvStatus

# One picture of a trial, live or stored: the core's (see engine/model.py).
TrialSnapshot = TrialInfo


@dataclass(frozen=True)
class HistoryEntry:
    at: float | None
    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class GpuUsage:
    """What the stored GPU samples say about one trial."""

    samples: int
    mean_utilization_percent: float | None = None
    max_utilization_percent: float | None = None
    peak_memory_used_bytes: int | None = None
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrialDetail:
    """A trial with what is read on demand: its metrics, GPU usage and status history."""

    trial: TrialSnapshot
    intermediate: tuple[float, ...]
    # The same results as the trial reported each: a number, or a dict of keys (NNI's).
    intermediate_results: tuple[Any, ...]
    gpu_usage: GpuUsage
    history: tuple[HistoryEntry, ...]
    stdout: str
    stderr: str
    # Its checkpoints kept, oldest first.
    checkpoints: tuple[CheckpointInfo, ...] = ()
    # A FAILED trial's reason with the last meaningful line of its stderr ("" otherwise).
    failure_summary: str = ""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint a trial saved, as the CLI, the dashboard and the embedding API show it."""

    trial_id: str
    step: int
    metric_index: int  # results the trial had reported when it saved
    size_bytes: int
    digest: str
    location: str  # "" in the experiment's checkpoint directory; else an object storage URL
    saved_at: float
    env_id: str


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU of an environment, with its latest stored sample (None before the first)."""

    index: int | None
    uuid: str
    name: str
    memory_total_bytes: int | None
    mig: bool
    simulated: bool
    utilization_percent: float | None
    memory_used_bytes: int | None
    sampled_at: float | None
    held_by: tuple[str, ...]


@dataclass(frozen=True)
class EnvSnapshot:
    id: str
    platform: str
    platform_id: str
    status: EnvStatus | None
    reason: str
    hostname: str
    connected: bool  # its agent's stream is open (as the coordinator last stored it)
    instance_id: str  # the agent process that registered last ('' before any did)
    gpus: tuple[GpuSnapshot, ...]
    gpu_unavailable_reason: str
    trials: tuple[str, ...]  # every trial placed on it last
    running_trials: tuple[str, ...]  # those still waiting to start or running
    stopping_trials: tuple[str, ...]  # those canceled whose processes are being stopped
    stopping: bool  # the environment itself is draining
    created_at: float | None
    ended_at: float | None
    unreadable: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExperimentSnapshot:
    id: str
    name: str | None
    status: str
    reason: str
    directory: str
    coordinator_address: str
    started_at: float | None
    ended_at: float | None
    optimize_mode: str
    trials: Mapping[str, int]  # trial count per status
    trial_count: int
    metrics: int
    environments: int
    best: TrialSnapshot | None
    unreadable: tuple[str, ...] = ()


# ---- best trial ----------------------------------------------------------------------------


class _Scored(Protocol):
    @property
    def final_metric(self) -> float | None: ...


S = TypeVar("S", bound=_Scored)


def optimize_mode(class_args: Mapping[str, Any] | None) -> str:
    """The tuner's optimize mode: "maximize" (the default) or "minimize"."""
    mode = (class_args or {}).get("optimize_mode", "maximize")
    return "minimize" if mode == "minimize" else "maximize"


def ranked(trials: Iterable[S], mode: str) -> list[S]:
    """Trials with a final metric, best first."""
    scored = [t for t in trials if t.final_metric is not None]
    return sorted(scored, key=lambda t: t.final_metric, reverse=mode == "maximize")  # type: ignore[arg-type,return-value]


def best_trial(trials: Iterable[S], mode: str) -> S | None:
    scored = [t for t in trials if t.final_metric is not None]
    if not scored:
        return None
    pick = max if mode == "maximize" else min
    return pick(scored, key=lambda t: t.final_metric)  # type: ignore[arg-type,return-value]
