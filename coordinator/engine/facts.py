"""Facts: what happened, in the decision core's own words, for the store to keep (trials
added, placed and ended, environments added and their statuses, agents joined, the messages
stored). Which columns and JSON each fact becomes is the store's business (store/facts.py,
one table). The engine's other events and instructions are in ``events.py``, which names
these too."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import checkpoints as ck
from .model import RankInfo
from .states import EnvStatus, TrialStatus


@dataclass(frozen=True)
class TrialAdded:
    trial_id: str
    seq: int
    status: TrialStatus
    parameters: Mapping[str, Any]
    command: str
    gpu_number: int
    submitted_at: float
    platforms: tuple[str, ...] = ()
    # The checkpoint it starts from, another trial's: (that trial, its step).
    forked_from: tuple[str, int] | None = None
    nodes: int = 1
    max_duration: float = 0.0


@dataclass(frozen=True)
class TrialStatusChanged:
    trial_id: str
    old: str  # the value stored before (a status this version may not know, on a resume)
    new: TrialStatus
    reason: str  # what the trial's row says now
    because: str  # why this change (kept in the trial's history)
    ended_at: float | None = None  # set with a terminal status
    ran_s: float = 0.0  # seconds it has run in its attempts ended so far


@dataclass(frozen=True)
class TrialPlaced:
    trial_id: str
    env_id: str
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    attempts: int


@dataclass(frozen=True)
class TrialUnplaced:
    """It waits again, placed nowhere (a retry, or its environment ended meanwhile)."""

    trial_id: str


@dataclass(frozen=True)
class TrialRanks:
    """A multi-node trial's ranks changed (placed, started, ended)."""

    trial_id: str
    ranks: tuple[RankInfo, ...]


@dataclass(frozen=True)
class TrialRan:
    """Its agent started its process."""

    trial_id: str
    started_at: float


@dataclass(frozen=True)
class TrialStopping:
    """Canceled while its agent runs it: shown until the agent confirms the end."""

    trial_id: str
    reason: str


@dataclass(frozen=True)
class TrialExited:
    """Its process ended (how); when, is the trial's end only with a terminal status."""

    trial_id: str
    exit_code: int | None
    signal: int | None
    stderr_tail: str


@dataclass(frozen=True)
class FinalResultSet:
    trial_id: str
    value: float
    value_json: str


@dataclass(frozen=True)
class WaitingReasonsChanged:
    """Why each of these trials waits (only reasons that changed)."""

    reasons: Mapping[str, str]


@dataclass(frozen=True)
class EnvironmentAdded:
    env_id: str
    platform: str
    status: EnvStatus
    created_at: float
    # A fresh start of an ended environment of this id (its operator started its agent
    # again): its row is replaced.
    again: bool = False


@dataclass(frozen=True)
class EnvironmentGrouped:
    """``env_id`` is a member of group ``group`` (its first member's id), started for
    ``trial_id``: kept, so that a resumed coordinator still holds the group for that trial."""

    env_id: str
    group: str
    trial_id: str


@dataclass(frozen=True)
class EnvironmentStatusChanged:
    env_id: str
    old: str
    new: EnvStatus
    reason: str
    ended_at: float | None = None  # set with a terminal status


@dataclass(frozen=True)
class EnvironmentLaunched:
    """The platform took the start: its own id for the environment."""

    env_id: str
    platform_id: str


@dataclass(frozen=True)
class EnvironmentWaits:
    """What the platform says a starting environment waits for."""

    env_id: str
    reason: str


@dataclass(frozen=True)
class EnvironmentLeft:
    """The environment's agent said it leaves (Leaving), and the environment ended stopped:
    that agent, should it dial again (its ack lost), is told it had left, after a restart too."""

    env_id: str


@dataclass(frozen=True)
class AgentJoined:
    """A new agent (instance) registered for the environment."""

    env_id: str
    hostname: str
    instance_id: str
    info: Mapping[str, Any]


@dataclass(frozen=True)
class AgentConnected:
    env_id: str
    connected: bool


@dataclass(frozen=True)
class AgentMessagesStored:
    """The agent's numbered messages up to ``last_seq`` are stored."""

    env_id: str
    last_seq: int


Fact = (
    TrialAdded | TrialStatusChanged | TrialPlaced | TrialUnplaced | TrialRan | TrialStopping | TrialExited
    | FinalResultSet | WaitingReasonsChanged | EnvironmentAdded | EnvironmentStatusChanged
    | EnvironmentLaunched | EnvironmentWaits | EnvironmentLeft | AgentJoined | AgentConnected | AgentMessagesStored
    | ck.CheckpointRecorded | ck.CheckpointRemoved | ck.MetricsSuperseded | ck.TrialRetried
    | ck.TrialParametersChanged | ck.CheckpointDigestKnown | ck.TrialForked | TrialRanks | EnvironmentGrouped
)

FACTS = (
    TrialAdded, TrialStatusChanged, TrialPlaced, TrialUnplaced, TrialRan, TrialStopping, TrialExited,
    FinalResultSet, WaitingReasonsChanged, EnvironmentAdded, EnvironmentStatusChanged,
    EnvironmentLaunched, EnvironmentWaits, AgentJoined, AgentConnected, AgentMessagesStored, *ck.CHECKPOINT_FACTS,
    TrialRanks, EnvironmentGrouped, EnvironmentLeft,
)
