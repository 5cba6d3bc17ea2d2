"""The coordinator's in-memory picture of trials and environments, and what it publishes.

:class:`TrialInfo` is the one picture of a trial that leaves the core: the engine makes it
from its live state, the read side (``read/model.py``) from a stored row, and both give the
same fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .checkpoints import Checkpoint
from .scheduler import GpuSlot
from .states import EnvStatus, TrialStatus


@dataclass(frozen=True)
class RankInfo:
    """One node of a multi-node trial: its environment, GPUs, and where its process is
    (placed | started | running | ended, with how it ended)."""

    rank: int
    environment_id: str
    gpu_indices: tuple[int, ...]
    state: str


@dataclass(frozen=True)
class TrialInfo:
    """One trial, as the embedding API, the CLI and the dashboard show it.

    Made from the live state it is whole. Read from a store, a field held in a form this
    version cannot read is ``None`` (``parameters``, ``status``, ...), and ``unreadable``
    says which and why.
    """

    id: str
    sequence_id: int | None
    status: TrialStatus | None
    parameters: dict[str, Any] | None
    environment_id: str | None
    gpu_indices: tuple[int, ...]
    final_metric: float | None
    final_metric_value: Any
    exit_code: int | None
    signal: int | None
    reason: str
    stderr_tail: str
    submitted_at: float | None
    started_at: float | None
    ended_at: float | None  # once it ended for good: a retried or paused trial has none
    attempts: int
    # Canceled, and its processes are being stopped (the status changes once they are gone).
    stopping: bool = False
    # Why a waiting trial is not placed yet ("" once it runs).
    waiting_reason: str = ""
    unreadable: tuple[str, ...] = ()
    # The step of its newest checkpoint (None: it saved none).
    checkpoint_step: int | None = None
    # Environments it runs on at once, and (a multi-node trial) each rank's, last placed.
    nodes: int = 1
    ranks: tuple[RankInfo, ...] = ()
    # Seconds it ran in its attempts ended so far: every attempt of a retried, paused and
    # continued trial, where ``started_at`` is its latest attempt's start.
    ran_s: float = 0.0
    # The environment it was last placed on: ``environment_id`` while it is placed; kept once
    # it leaves it (a paused trial's, a retried one's), None if it never was.
    last_environment_id: str | None = None

    def duration(self, now: float) -> float | None:
        """Seconds it has run, in all its attempts (the one running until ``now``); None if
        it never started."""
        if self.started_at is None:
            return None
        return self.ran_s + (max(0.0, now - self.started_at) if self.status is TrialStatus.RUNNING else 0.0)

    @property
    def done(self) -> bool:
        return self.status is not None and self.status.terminal

    @property
    def active(self) -> bool:
        """Waiting or running: it still holds (or wants) a place."""
        return self.status in (TrialStatus.WAITING, TrialStatus.RUNNING)


def loads_or(raw: Any, default: Any) -> Any:
    """A stored JSON text's value, or ``default`` where there is none or it cannot be read:
    a row an older or broken version wrote never stops the core."""
    try:
        return json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        return default


def enum_or(kind: Any, raw: Any, default: Any) -> Any:
    """``kind(raw)``, or ``default`` for a value this version does not know."""
    try:
        return kind(raw)
    except ValueError:
        return default


@dataclass(frozen=True)
class MetricEvent:
    """A result a trial reported, delivered once it is stored."""

    trial_id: str
    kind: str  # "intermediate" | "final"
    index: int
    value: float
    raw: Any


@dataclass(frozen=True)
class StatusEvent:
    """A trial changed status; or was submitted (``submitted``: the first event of a trial,
    which has no status before, so ``old`` is the status it starts in)."""

    trial: TrialInfo
    old: TrialStatus

    @property
    def submitted(self) -> bool:
        """Whether this is the trial's submission, not a change: no status goes to itself."""
        return self.old is self.trial.status


@dataclass
class TrialState:
    id: str
    seq: int
    status: TrialStatus
    parameters: dict[str, Any]
    command: str
    gpu_number: int
    submitted_at: float
    gpu_memory: int = 0
    nodes: int = 1  # environments it runs on at once; rank 0's is env_id (the others: ranks.py)
    ranks: tuple[RankInfo, ...] = ()  # as last told (multinode.py)
    max_duration: float = 0.0  # its own time limit in seconds (0: the experiment's maxTrialDuration)
    env_id: str | None = None
    last_env_id: str | None = None  # the environment it was last placed on, kept once it leaves it
    gpu_uuids: tuple[str, ...] = ()
    gpu_indices: tuple[int, ...] = ()
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    stderr_tail: str = ""
    final_metric: float | None = None
    final_metric_json: str | None = None
    attempts: int = 0
    started_at: float | None = None  # of its latest attempt
    ended_at: float | None = None  # its own end: set once it ended for good (a terminal status)
    # When its latest attempt's process ended (its agent's word, or when it was last heard of),
    # until its status says what follows: an end, a retry, a pause.
    attempt_ended_at: float | None = None
    ran_s: float = 0.0  # seconds it ran in its attempts ended so far (a retry, a pause, the end)
    # The status a cancel asked for, applied when the agent confirms the end.
    cancel_status: TrialStatus | None = None
    waiting_reason: str = ""
    # A retried trial is not placed before this moment (monotonic): backoff.
    not_before: float = 0.0
    log_refused: bool = False  # a bad log chunk was reported once
    env_overrides: dict[str, str] = field(default_factory=dict)
    # The platforms it may use, most preferred first; (): the experiment's.
    platforms: tuple[str, ...] = ()
    lost_on: str = ""  # the platform of the environment it was last lost with
    # Its own checkpoints kept, oldest first; and the one it was forked from (another
    # trial's) until it saves its own.
    checkpoints: list[Checkpoint] = field(default_factory=list)
    forked_from: Checkpoint | None = None
    # Asked to pause: its agent ends it at its next checkpoint.
    pausing: bool = False
    # Retries used against maxTrialRetries, and whether it saved a checkpoint since its last loss.
    retries: int = 0
    progressed: bool = False
    refused_steps: set[int] = field(default_factory=set)  # a part of that save was refused
    # Saves refused since its last recorded one, told again to an agent that reconnects.
    refusals: dict[int, str] = field(default_factory=dict)

    @property
    def placed(self) -> bool:
        return self.env_id is not None

    @property
    def checkpoint(self) -> Checkpoint | None:
        """What it continues from: its newest checkpoint, else the one it was forked from."""
        return self.checkpoints[-1] if self.checkpoints else self.forked_from

    def info(self) -> TrialInfo:
        return TrialInfo(
            id=self.id,
            sequence_id=self.seq,
            status=self.status,
            parameters=self.parameters,
            environment_id=self.env_id,
            gpu_indices=self.gpu_indices,
            final_metric=self.final_metric,
            # A value an older version stored unchecked may not parse: shown as None.
            final_metric_value=None if self.final_metric_json is None else loads_or(self.final_metric_json, None),
            exit_code=self.exit_code,
            signal=self.signal,
            reason=self.reason or (self.waiting_reason if self.status is TrialStatus.WAITING else ""),
            stderr_tail=self.stderr_tail,
            submitted_at=self.submitted_at,
            started_at=self.started_at,
            ended_at=self.ended_at,
            attempts=self.attempts,
            stopping=self.cancel_status is not None and not self.status.terminal,
            waiting_reason=self.waiting_reason if self.status is TrialStatus.WAITING else "",
            checkpoint_step=self.checkpoints[-1].step if self.checkpoints else None,
            nodes=self.nodes, ranks=self.ranks, ran_s=self.ran_s, last_environment_id=self.env_id or self.last_env_id,
        )


@dataclass
class EnvState:
    id: str
    status: EnvStatus
    single_use: bool
    trial_slots: int
    platform: str = ""
    platform_id: str = ""
    reason: str = ""
    hostname: str = ""
    instance_id: str = ""
    last_seq: int = 0
    # A save's held ack when the stream broke: (the last seq acknowledged before it, until when)
    held_over: tuple[int, float] | None = None
    link: int | None = None  # the shell's id of the agent's open stream
    started_here: bool = True  # the coordinator started it (not an agent an operator started)
    left: bool = False  # stopped as its agent said it leaves (Leaving): that agent is told so if it dials again
    holders: set[str] = field(default_factory=set)
    gpus: list[GpuSlot] = field(default_factory=list)
    gpu_names: dict[str, str] = field(default_factory=dict)
    gpu_reason: str = ""
    last_seen: float = 0.0  # monotonic
    requested_at: float = 0.0  # monotonic
    used: bool = False  # a single-use environment that has had its trial
    shutdown_sent: bool = False
    draining: bool = False
    gpu_usage: dict[str, tuple[float, int, int]] = field(default_factory=dict)  # uuid -> util, used, total
    gpu_seen: dict[str, set[str]] = field(default_factory=dict)  # uuid -> trials with processes on it
    gpu_recorded_at: float = 0.0  # monotonic, when a GPU sample of this env was last stored
    gpu_recorded_holders: list[set[str]] = field(default_factory=list)  # per GPU, when last recorded
    use_active_gpu: bool = False
    # (maxTrialNumberPerGpu, useActiveGpu) its platform set for it; None: its section's.
    gpu_sharing: tuple[int, bool] | None = None
    # Started as one of a group of environments for a waiting trial (a platform that groups
    # environments, supply.py): the group's id (its first member's) and the trial's.
    group: str = ""
    group_for: str = ""

    @property
    def connected(self) -> bool:
        return self.link is not None
