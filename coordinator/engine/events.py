"""What the decision core hears (events, named in the past tense) and what it asks the shell
to do (instructions, in the imperative).

Plain frozen dataclasses: no protobuf, no gRPC, no asyncio. The transport turns agent
messages into events (``wire.py``) and the core's messages to agents back into protobuf;
the shell (``shell.py``) feeds the rest and carries every instruction out. The facts, what
happened for the store to keep, are in ``facts.py`` and named here too.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from . import checkpoints as ck

# The facts are named here too (ev.TrialAdded, ev.FACTS): the engine and the store speak of them as events.
from .facts import (  # noqa: F401
    FACTS,
    AgentConnected,
    AgentJoined,
    AgentMessagesStored,
    EnvironmentAdded,
    EnvironmentGrouped,
    EnvironmentLaunched,
    EnvironmentLeft,
    EnvironmentStatusChanged,
    EnvironmentWaits,
    Fact,
    FinalResultSet,
    TrialAdded,
    TrialExited,
    TrialPlaced,
    TrialRan,
    TrialRanks,
    TrialStatusChanged,
    TrialStopping,
    TrialUnplaced,
    WaitingReasonsChanged,
)
from .model import MetricEvent, StatusEvent
from .policy import Policy
from .rows import GpuSampleRow, MetricRun
from .states import TrialStatus

# ---- what agents say (the transport's events) ----------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as an agent registered it."""

    uuid: str
    index: int
    name: str
    memory_total_bytes: int
    simulated: bool = False
    mig: bool = False


@dataclass(frozen=True)
class AgentRegistered:
    """An agent opened a stream (``link``: the shell's id of that stream) and registered."""

    env_id: str
    link: int
    instance_id: str
    hostname: str
    pid: int
    platform: str
    gpus: tuple[GpuInfo, ...]
    gpu_unavailable_reason: str
    active_trial_ids: frozenset[str]
    info: Mapping[str, Any]  # what is kept about the agent as it registered (the store's info_json)


@dataclass(frozen=True)
class AgentDisconnected:
    env_id: str
    link: int


@dataclass(frozen=True)
class TrialStartReported:
    trial_id: str
    pid: int
    started_at: float  # wall clock on the agent; 0 when it did not say
    # Rank 0 of a multi-node trial: where the other ranks reach it (MASTER_ADDR, MASTER_PORT).
    address: str = ""
    port: int = 0


@dataclass(frozen=True)
class MetricsReported:
    runs: tuple[MetricRun, ...]  # kinds already named; results the edge refused are not here


@dataclass(frozen=True)
class LogReported:
    trial_id: str
    stream: str  # "stdout" | "stderr"
    offset: int
    data: bytes


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    LOST = "lost"  # its environment went away under it
    PAUSED = "paused"  # it ended asked to pause (after a checkpoint, or stopped past the grace)


@dataclass(frozen=True)
class TrialEndReported:
    trial_id: str
    outcome: Outcome
    exit_code: int | None
    signal: int | None
    reason: str
    stderr_tail: str
    ended_at: float  # wall clock on the agent; 0 when it did not say
    gpus_still_in_use: tuple[str, ...] = ()


@dataclass(frozen=True)
class AgentLeft:
    """The agent exits of its own accord (an operator stopped it), its trials' ends sent."""

    drained: bool  # its trials ran to their ends; False: it canceled them


Report = (
    TrialStartReported | MetricsReported | LogReported | TrialEndReported | ck.CheckpointChunkReported
    | ck.CheckpointSavedReported | AgentLeft
)


@dataclass(frozen=True)
class AgentReported:
    """A numbered agent message: stored, then acknowledged."""

    env_id: str
    link: int
    seq: int
    report: Report | None  # None: a kind that carries nothing the core uses


class GpuProcess(NamedTuple):  # tuples: a thousand agents send eight of these a second each
    trial_id: str  # "" for a process that is not one of our trials
    used_memory_bytes: int


class GpuSample(NamedTuple):
    uuid: str
    utilization_percent: float
    memory_used_bytes: int
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class HeartbeatReceived:
    env_id: str
    link: int
    draining: bool
    gpus: tuple[GpuSample, ...] = ()
    # The agent left its GPU samples out: they are as in the last it sent on this stream.
    gpus_unchanged: bool = False


# ---- what the shell and the embedding API say ----------------------------------------------


@dataclass(frozen=True)
class TrialSubmitted:
    trial_id: str
    parameters: dict[str, Any]
    command: str
    gpu_number: int
    gpu_memory: int
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    # The platforms it may use, most preferred first; (): the experiment's.
    platforms: tuple[str, ...] = ()
    # Start from this trial's newest checkpoint ("": a fresh start).
    checkpoint_from: str = ""
    nodes: int = 1  # environments it runs on at once (trialNodes)
    max_duration: float = 0.0  # its own time limit in seconds (0: maxTrialDuration's)


@dataclass(frozen=True)
class CancelRequested:
    trial_id: str
    reason: str
    status: TrialStatus


@dataclass(frozen=True)
class EnvironmentStarted:
    env_id: str
    platform_id: str
    # (maxTrialNumberPerGpu, useActiveGpu) for this environment, as its platform and section
    # set them; None: the section's.
    gpu_sharing: tuple[int, bool] | None = None


@dataclass(frozen=True)
class EnvironmentStartFailed:
    env_id: str
    error: str


# ---- what platforms say (the environment services' answers) --------------------------------

ObservedState = Literal["starting", "running", "exited", "failed", "unknown"]


@dataclass(frozen=True)
class Observation:
    """What the platform says about one environment."""

    state: ObservedState
    detail: str = ""
    platform_id: str = ""


@dataclass(frozen=True)
class EnvironmentsPolled:
    """What the platform said about every live environment (the lost-agent timers run too)."""

    observations: Mapping[str, Observation]


@dataclass(frozen=True)
class Ticked:
    """Time passed or something changed: place waiting trials, top up environments."""


@dataclass(frozen=True)
class StopRequested:
    """The experiment ends: cancel every trial, shut every environment down (``pause``:
    pause the trials instead, the experiment to be resumed later)."""

    grace_s: float
    pause: bool = False


@dataclass(frozen=True)
class StopCompleted:
    """The shell waited for the agents: what is still open is ended without them."""


@dataclass(frozen=True)
class UpdateRequested:
    """The experiment's limits changed while it runs (``trialkeeper update``): the engine
    decides with ``policy`` from now on (a new trialConcurrency, and the environments it
    asks for)."""

    policy: Policy


Event = (
    AgentRegistered | AgentDisconnected | AgentReported | HeartbeatReceived | TrialSubmitted
    | CancelRequested | EnvironmentStarted | EnvironmentStartFailed | EnvironmentsPolled | Ticked
    | StopRequested | StopCompleted | ck.CheckpointFetchRequested | ck.PauseRequested | ck.ContinueRequested
    | ck.CheckpointDigested
    | UpdateRequested
)

# ---- messages to agents (the transport turns them into protobuf) ---------------------------


@dataclass(frozen=True)
class Welcome:
    experiment_id: str
    acked_seq: int
    heartbeat_interval_s: float
    cancel_trial_ids: tuple[str, ...]
    # Heartbeats may leave unchanged GPU samples out for up to this long (0: never).
    gpu_sample_interval_s: float = 0.0
    # Where its checkpoints go (see the protocol's Welcome).
    checkpoint_dir: str = ""
    checkpoint_storage: str = ""
    max_checkpoint_bytes: int = 0
    checkpoint_refusals: tuple[ck.CheckpointRefused, ...] = ()
    checkpoint_data_port: int = 0


@dataclass(frozen=True)
class StartTrial:
    trial_id: str
    sequence_id: int
    command: str
    parameters: dict[str, Any]
    env: Mapping[str, str]
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    max_duration_s: float
    attempt: int
    experiment_id: str
    working_directory: str
    resumes_metrics: bool  # a retry: its metric indices go on after those already stored
    first_metric_index: int = 0  # filled in by the shell from the store when resumes_metrics
    checkpoint: ck.Checkpoint | None = None  # continue from it
    # A multi-node trial: this process's rank among ``nodes`` and rank 0's address and port
    # ("" and 0 for rank 0 itself: its agent chooses them).
    node_rank: int = 0
    nodes: int = 1
    master_addr: str = ""
    master_port: int = 0


@dataclass(frozen=True)
class CancelTrial:
    trial_id: str
    grace_s: float
    reason: str


@dataclass(frozen=True)
class Shutdown:
    drain: bool
    grace_s: float
    reason: str


@dataclass(frozen=True)
class Settings:
    heartbeat_interval_s: float
    gpu_sample_interval_s: float = 0.0


ToAgent = (
    Welcome | StartTrial | CancelTrial | Shutdown | Settings | ck.PauseTrial | ck.CheckpointRefused | ck.CheckpointData
)

# ---- instructions --------------------------------------------------------------------------


class Refusal(enum.Enum):
    """Why an agent is refused; the transport maps each to a gRPC status in one table."""

    NOT_NOW = "not-now"  # the experiment is stopping, or the environment ended
    UNKNOWN_ENVIRONMENT = "unknown-environment"
    ALREADY_CONNECTED = "already-connected"
    LEFT = "left"  # the agent that left its environment (Leaving), which ended stopped, dials again


@dataclass(frozen=True)
class RefuseAgent:
    env_id: str
    why: Refusal
    message: str


@dataclass(frozen=True)
class Send:
    link: int
    message: ToAgent


@dataclass(frozen=True)
class Ack:
    link: int
    seq: int


@dataclass(frozen=True)
class CloseLink:
    link: int


@dataclass(frozen=True)
class StartEnvironment:
    env_id: str


@dataclass(frozen=True)
class StartEnvironmentGroup:
    """Start ``env_ids`` as one group (one object on the platform, its first member's id the
    group's), for ``trial_id``: each is answered as a StartEnvironment is."""

    group: str
    env_ids: tuple[str, ...]
    trial_id: str


@dataclass(frozen=True)
class StopEnvironment:
    env_id: str
    grace_s: float


@dataclass(frozen=True)
class PollSoon:
    """Ask the platform about the environments at once, not at the next tick."""


@dataclass(frozen=True)
class StoreMetrics:
    runs: tuple[MetricRun, ...]


@dataclass(frozen=True)
class StoreGpuSamples:
    rows: tuple[GpuSampleRow, ...]


@dataclass(frozen=True)
class WriteLog:
    """Append what an agent streamed of a trial's output to its log file."""

    trial_id: str
    stream: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class CheckpointSaved:
    """A trial's checkpoint is recorded (published while ``Engine.publish_checkpoints``)."""

    trial_id: str
    step: int
    metric_index: int  # the results it had reported when it saved it


@dataclass(frozen=True)
class Publish:
    event: StatusEvent | MetricEvent | CheckpointSaved


@dataclass(frozen=True)
class HeartbeatsRescaled:
    """Agents heartbeat at this interval now (logged by the shell)."""

    interval_s: float
    connected: int


# What the shell writes in one transaction before anything goes out.
STORE_WRITES = (*FACTS, StoreMetrics)

Instruction = (
    RefuseAgent | Send | Ack | CloseLink | StartEnvironment | StartEnvironmentGroup | StopEnvironment | PollSoon | Fact
    | StoreMetrics | StoreGpuSamples | WriteLog | Publish | HeartbeatsRescaled | ck.WriteCheckpointChunk
    | ck.SendCheckpoint | ck.RemoveCheckpoint
)
